"""EngineArgs: every start-up option of the engine, declared once.

``LLM(...)``, ``pagectl generate``, ``pagectl daemon`` and the benchmarks all build an
``EngineArgs``: the CLI through ``add_cli_arguments`` / ``EngineArgs.from_cli`` (the flags are
generated from the fields below, so a flag, its help, default and choices live in one
place), the daemon ships it to its engine process as the struct itself (msgspec encodes the
dataclass), and ``__post_init__`` is the one validation. Adding an option is adding one field
with ``option(...)`` metadata.

Names follow vLLM's where the meaning is the same, so operators bring their habits along.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Weight-only quantization made at load time (pagectl/engine/quant).
QUANTIZATIONS = ("int8", "int4")
# KV cache element types; "auto" is the model's dtype. fp8 caches are not implemented.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")
# Attention backends (see pagectl/engine/attention/__init__.py: select_backend).
ATTENTION_BACKENDS = ("auto", "torch", "cpu-kernel", "triton", "flash")
GENERATION_CONFIG_MODES = ("auto", "none")
SCHEDULING_POLICIES = ("fcfs", "priority")
# Token budget per step when none is given, by device type.
DEFAULT_TOKEN_BUDGET = {"cpu": 2048, "cuda": 8192}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}

# Argument groups of the generated flags, in --help order.
MODEL_GROUP = "model"
CACHE_GROUP = "KV cache and scheduler"
# Options of one mutually exclusive set: at most one of them on a command line.
_KV_POOL_SIZE = "kv pool size"


def parse_size(value: str | int | float) -> int:
    """'4GiB' -> 4294967296, '512MB' -> 512000000, 1024 -> 1024."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (examples: 4GiB, 512MiB, 2GB, 1073741824)")
    size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


def option(
    default: Any,
    help: str,
    *,
    type: Any = str,
    choices: tuple[str, ...] | None = None,
    group: str = MODEL_GROUP,
    aliases: tuple[str, ...] = (),
    exclusive: str | None = None,
    metavar: str | None = None,
) -> Any:
    """A field of ``EngineArgs`` with what its command-line flag needs.

    ``type`` converts the flag's text (``bool`` makes a ``--x`` / ``--no-x`` pair);
    ``aliases`` are extra spellings listed before the ``--field-name`` one; options sharing an
    ``exclusive`` name may not be given together.
    """
    meta = {
        "help": help,
        "type": type,
        "choices": choices,
        "group": group,
        "aliases": aliases,
        "exclusive": exclusive,
        "metavar": metavar,
    }
    return field(default=default, metadata=meta)


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")
_LENGTH_UNITS = {"": 1, "k": 1000, "m": 1000**2, "K": 1024, "M": 1024**2}


def parse_length(value: str | int) -> int:
    """A token count as vLLM writes them: '4096', '4k' (4000), '4K' (4096), '1m', '1M'."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmM]?)\s*", str(value))
    if not m:
        raise ValueError(f"not a token count: {value!r} (examples: 4096, 4k, 4K)")
    n = float(m.group(1)) * _LENGTH_UNITS[m.group(2)]
    if n != int(n):
        raise ValueError(f"not a whole number of tokens: {value!r}")
    return int(n)


def length_flag(value: str) -> int:
    """argparse type for token counts (``parse_length``)."""
    try:
        return parse_length(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_structured_outputs_config(value: dict | str | None) -> dict:
    """Validate --structured-outputs-config; returns {"backend", "disable_any_whitespace"}."""
    import json

    if value is None or value == "":
        value = {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs_config is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("structured_outputs_config must be a JSON object")
    unknown = set(value) - {"backend", "disable_any_whitespace"}
    if unknown:
        raise ValueError(
            f"structured_outputs_config: {', '.join(sorted(unknown))} is not supported by "
            "pagectl (known: backend, disable_any_whitespace)"
        )
    backend = value.get("backend", "auto")
    if backend not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(
            f"structured_outputs_config.backend must be one of "
            f"{', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, got {backend!r}"
        )
    ws = value.get("disable_any_whitespace", False)
    if not isinstance(ws, bool):
        raise ValueError("structured_outputs_config.disable_any_whitespace must be a boolean")
    return {"backend": backend, "disable_any_whitespace": ws}


@dataclass
class EngineArgs:
    """Start-up options. ``model=None`` serves the built-in model shipped with the package."""

    # Hugging Face model directory or hub id; None: the built-in model.
    model: str | None = option(
        None, "Hugging Face model directory or hub id (default: the built-in model)"
    )
    # Tokenizer directory or hub id; None: the model's.
    tokenizer: str | None = option(None, "tokenizer directory or hub id (default: the model's)")
    # Name the API reports and accepts; None: the model path / id.
    served_model_name: str | None = option(
        None, "name the API reports and accepts (default: the model's)"
    )
    # "auto" follows the checkpoint; on CPU a half-precision checkpoint runs in bfloat16
    # where the CPU has bf16 instructions, else in float32 (loader.resolve_dtype).
    dtype: str = option("auto", "weights and activations dtype", choices=DTYPES)
    # "auto": cuda when available, else cpu.
    device: str = option("auto", "cpu, cuda, cuda:N or auto (cuda when available)")
    # Weight-only quantization made at load time from a float checkpoint (CPU): "int8" (per
    # output channel) or "int4" (groups of 128 input features); None: as the checkpoint
    # (AWQ/GPTQ load as int4, FP8 with its scales applied, anything else refused by name).
    quantization: str | None = option(
        None,
        "weight-only quantization made at load time (CPU): int8 per output channel, int4 in "
        "groups of 128 (default: as the checkpoint; AWQ/GPTQ load as int4)",
        choices=QUANTIZATIONS,
    )
    # KV cache element type; "auto": the model's dtype. fp8 is refused (not implemented).
    kv_cache_dtype: str = option(
        "auto", "KV cache dtype (auto: the model's)", choices=KV_CACHE_DTYPES, group=CACHE_GROUP
    )
    # Ranks the model is split over (this process is rank 0).
    tensor_parallel_size: int = option(1, "tensor-parallel ranks", type=int, aliases=("--tp",))
    # Token slots per KV block.
    block_size: int = option(16, "token slots per KV block", type=int, group=CACHE_GROUP)
    # KV pool size: an exact block count, or a memory budget, or (CUDA) a fraction of memory;
    # None for both counts: the default budget (see builder.py).
    num_kv_blocks: int | None = option(
        None, "exact number of KV blocks", type=int, group=CACHE_GROUP, exclusive=_KV_POOL_SIZE
    )
    kv_cache_memory: str | int | None = option(
        None, "KV memory budget, e.g. 4GiB", group=CACHE_GROUP, exclusive=_KV_POOL_SIZE
    )
    gpu_memory_utilization: float = option(
        0.9,
        "CUDA: fraction of GPU memory for weights + KV",
        type=float,
        group=CACHE_GROUP,
        exclusive=_KV_POOL_SIZE,
    )
    # Token budget per step; None: DEFAULT_TOKEN_BUDGET for the device (``token_budget``).
    max_num_batched_tokens: int | None = option(
        None,
        "token budget per step (live; default 2048 CPU / 8192 CUDA; 4096, 4k or 4K)",
        type=length_flag,
        group=CACHE_GROUP,
    )
    max_num_seqs: int = option(
        256,
        "most sequences running at once (live, up to this start-up value)",
        type=int,
        group=CACHE_GROUP,
    )
    # Longest prompt + output; None: the model's max_position_embeddings, capped by the pool.
    max_model_len: int | None = option(
        None,
        "longest prompt + output, e.g. 4096, 4k (4000) or 4K (4096); at most the model's "
        "max_position_embeddings",
        type=length_flag,
        group=CACHE_GROUP,
    )
    enable_prefix_caching: bool = option(
        True, "prefix caching (live)", type=bool, group=CACHE_GROUP
    )
    long_prefill_token_threshold: int = option(
        0,
        "most prompt tokens one request prefills per step (live; 0: no cap)",
        type=int,
        group=CACHE_GROUP,
    )
    scheduling_policy: str = option(
        "fcfs",
        "fcfs, or priority (lower value first, ties by arrival)",
        choices=SCHEDULING_POLICIES,
        group=CACHE_GROUP,
    )

    # Model options, continued (flags come in field order; --help lists them by group).
    # Global seed for unseeded sampling.
    seed: int = option(0, "seed for unseeded sampling", type=int)
    # CUDA only: no CUDA graphs.
    enforce_eager: bool = option(False, "CUDA: no CUDA graphs", type=bool)
    # CPU threads for torch; None: torch's own choice (a share of the cores under TP).
    num_threads: int | None = option(None, "CPU threads for torch", type=int)
    # "auto" picks triton, else flash, else torch on CUDA; the CPU kernel (compiled on first
    # use), else torch on CPU. "triton" runs on CPU through Triton's interpreter.
    attention_backend: str = option(
        "auto",
        "auto: triton on CUDA (else flash-attn, else torch); the compiled kernel on CPU",
        choices=ATTENTION_BACKENDS,
    )
    # Default sampling parameters: "auto" takes them from the model's generation_config.json
    # (temperature, top_p, top_k, min_p when it sets do_sample; repetition_penalty;
    # max_new_tokens as max_tokens), "none" keeps the engine's own (OpenAI's) defaults.
    generation_config: str = option(
        "auto",
        "auto: a request's unset sampling fields take the model's generation_config.json "
        "values; none: the engine's own defaults",
        choices=GENERATION_CONFIG_MODES,
    )
    # Structured outputs, as vLLM's --structured-outputs-config: a JSON object (or its
    # text) with "backend" ("xgrammar" or "auto") and "disable_any_whitespace" (the default
    # for requests that do not say; true keeps a weak model from padding JSON forever).
    structured_outputs_config: dict | str | None = option(
        None,
        'structured outputs, JSON: {"backend": "xgrammar"|"auto", "disable_any_whitespace": bool}',
        metavar="JSON",
    )
    # Speculative decoding, as vLLM's: {"method": "ngram", "num_speculative_tokens": K,
    # "prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", "model":
    # DRAFT, "num_speculative_tokens": K} (or its JSON text); None: off. Kept as
    # given (a plain dict travels to tensor-parallel workers); checked here, parsed by the
    # builder with SpeculativeConfig.parse.
    speculative_config: dict | str | None = option(
        None,
        'speculative decoding, JSON: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": "draft_model", '
        '"model": DRAFT, "num_speculative_tokens": K}',
        metavar="JSON",
    )

    def __post_init__(self) -> None:
        self.structured_outputs_config = parse_structured_outputs_config(
            self.structured_outputs_config
        )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            hint = " (fp8 KV caches are not supported yet)" if "fp8" in self.kv_cache_dtype else ""
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}{hint}"
            )
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("block_size", self.block_size, 1, 1024)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        for name in ("num_kv_blocks", "max_num_batched_tokens", "max_model_len", "num_threads"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 1)
        if self.kv_cache_memory is not None:
            parse_size(self.kv_cache_memory)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        for name, allowed in (
            ("attention_backend", ATTENTION_BACKENDS),
            ("generation_config", GENERATION_CONFIG_MODES),
            ("scheduling_policy", SCHEDULING_POLICIES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )

        from pagectl.engine.spec_decode.config import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)

    def token_budget(self, device_type: str) -> int:
        """The start-up token budget per step on a device of this type ("cpu", "cuda")."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return DEFAULT_TOKEN_BUDGET.get(device_type, DEFAULT_TOKEN_BUDGET["cpu"])

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_cli(cls, ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The options ``add_cli_arguments`` parsed into ``ns`` (raises ``ValueError``)."""
        values = {name: getattr(ns, name) for name in cls.field_names() if hasattr(ns, name)}
        values.update(overrides)
        return cls(**values)


def add_cli_arguments(p: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Add one flag per ``EngineArgs`` field (but those in ``skip``), in its group."""
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    for f in fields(EngineArgs):
        if f.name in skip:
            continue
        meta = f.metadata
        group = groups.get(meta["group"])
        if group is None:
            group = groups[meta["group"]] = p.add_argument_group(meta["group"])
        target = group
        if meta["exclusive"]:
            target = exclusive.get(meta["exclusive"])
            if target is None:
                target = exclusive[meta["exclusive"]] = group.add_mutually_exclusive_group()
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        kw: dict[str, Any] = {"dest": f.name, "default": default}
        if meta["type"] is bool:
            kw["action"] = argparse.BooleanOptionalAction
            kw["help"] = f"{meta['help']} (default: {'on' if default else 'off'})"
        else:
            kw["type"] = meta["type"]
            if meta["choices"]:
                kw["choices"] = meta["choices"]
            if meta["metavar"]:
                kw["metavar"] = meta["metavar"]
            shown = "" if default is None or "default" in meta["help"] else f" (default: {default})"
            kw["help"] = meta["help"] + shown
        target.add_argument(*meta["aliases"], flag, **kw)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
