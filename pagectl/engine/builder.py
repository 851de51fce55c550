"""From ``EngineArgs`` to a running ``EngineCore``: model, KV pool, runner, scheduler.

The daemon and the offline ``LLM`` both call ``build_engine``. Sizing rules:

- ``max_num_batched_tokens``: the argument, else 2048 on CPU and 8192 on CUDA;
- KV blocks: ``num_kv_blocks``; else ``kv_cache_memory`` bytes; else on CUDA the
  ``gpu_memory_utilization`` share of the device left after the weights and a warm-up forward
  at the token budget; else on CPU 2 GiB capped at a quarter of RAM;
- ``max_model_len``: the argument, else the model's ``max_position_embeddings``; capped at the
  pool's token capacity (a longer sequence could never be held).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagectl.engine.args import EngineArgs, parse_size
from pagectl.engine.config import CacheConfig, SchedulerConfig
from pagectl.engine.core import EngineCore
from pagectl.engine.loader import check_supported, load_model, resolve_dtype, resolve_model_path
from pagectl.engine.model_config import ModelConfig
from pagectl.engine.runner.kv_cache import cuda_kv_bytes, default_cpu_kv_bytes, kv_bytes_per_block
from pagectl.engine.runner.model_runner import ModelRunner
from pagectl.engine.scheduler import Scheduler
from pagectl.engine.telemetry import ModelInfo
from pagectl.engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

BUILTIN_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "pycoder"
BUILTIN_MODEL_NAME = "pycoder"


def resolve_model(model: str | None) -> str:
    """A local model directory: the built-in model for None, else a directory or hub id."""
    if model is None:
        if not (BUILTIN_MODEL_DIR / "config.json").is_file():
            raise FileNotFoundError(
                f"the built-in model is missing from {BUILTIN_MODEL_DIR}; pass --model, or "
                "train it with scripts/train_builtin_model.py"
            )
        return str(BUILTIN_MODEL_DIR)
    return resolve_model_path(model)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was requested but CUDA is not available")
    return dev


@dataclass
class BuiltEngine:
    """An engine ready to serve, plus what its callers need to know about the model."""

    core: EngineCore
    tokenizer: Any | None
    model_name: str
    model_path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    def shutdown(self) -> None:
        """Release the model and KV memory (idempotent)."""
        runner = self.core.executor
        if isinstance(runner, ModelRunner):
            for layer in runner.model.attention_layers:
                layer.kv_cache = None
            runner.kv.release()
            runner.cuda_graphs = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def build_engine(args: EngineArgs) -> BuiltEngine:
    """Load the model named by ``args`` and assemble scheduler, runner and engine core."""
    if args.tensor_parallel_size != 1:
        raise ValueError(
            f"tensor_parallel_size={args.tensor_parallel_size} is not available in this build "
            "(single-device only)"
        )
    path = resolve_model(args.model)
    mcfg = ModelConfig.from_dir(path)
    check_supported(mcfg)
    device = resolve_device(args.device)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    torch.manual_seed(args.seed)
    dtype = resolve_dtype(args.dtype, mcfg, device)
    model = load_model(path, mcfg, dtype, device)

    max_tokens = args.max_num_batched_tokens or (8192 if device.type == "cuda" else 2048)
    attn = model.attention_layers[0]
    per_block = kv_bytes_per_block(
        mcfg.num_hidden_layers, args.block_size, attn.num_kv_heads, attn.head_dim, dtype
    )
    num_blocks = _num_kv_blocks(args, model, per_block, max_tokens, device)
    capacity = num_blocks * args.block_size
    max_model_len = args.max_model_len or mcfg.max_position_embeddings
    if max_model_len > capacity:
        log.warning(
            "max_model_len %d exceeds the KV pool (%d tokens); capped", max_model_len, capacity
        )
        max_model_len = capacity

    runner = ModelRunner(
        model,
        mcfg,
        device=device,
        dtype=dtype,
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
    )
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
        ),
        CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=num_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
    )
    tokenizer = load_tokenizer(args.tokenizer or path)
    eos = mcfg.eos_token_ids
    if not eos and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos = (int(tokenizer.eos_token_id),)
    name = args.served_model_name or args.model or BUILTIN_MODEL_NAME
    info = ModelInfo(
        model=name,
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
        tp_size=args.tensor_parallel_size,
        kv_bytes_per_block=per_block,
        kv_bytes_per_rank=per_block * num_blocks,
        max_model_len=max_model_len,
    )
    core = EngineCore(
        scheduler,
        runner,
        vocab_size=mcfg.vocab_size,
        eos_token_ids=eos,
        model_info=info,
        tokenizer_decode=tokenizer.decode if tokenizer is not None else None,
    )
    return BuiltEngine(core, tokenizer, name, path, mcfg.vocab_size, max_model_len, tuple(eos))


def _num_kv_blocks(
    args: EngineArgs, model: Any, per_block: int, max_tokens: int, device: torch.device
) -> int:
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    if args.kv_cache_memory is not None:
        budget = parse_size(args.kv_cache_memory)
    elif device.type == "cuda":
        from pagectl.engine.runner.profiling import measure_peak_activation

        free, total = torch.cuda.mem_get_info(device)
        peak = measure_peak_activation(
            model, max_tokens, args.max_num_seqs, args.block_size, args.attention_backend, device
        )
        budget = cuda_kv_bytes(device, args.gpu_memory_utilization, total - free, peak)
    else:
        budget = default_cpu_kv_bytes()
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: the budget is {budget} bytes and one block of "
            f"{args.block_size} tokens takes {per_block} bytes"
        )
    return int(num_blocks)
