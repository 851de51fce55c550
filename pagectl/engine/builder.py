"""From ``EngineArgs`` to a running ``EngineCore``: model, KV pool, runner, scheduler.

The daemon and the offline ``LLM`` both call ``build_engine``. Sizing rules:

- ``max_num_batched_tokens``: ``EngineArgs.token_budget`` (the argument, else by device);
- KV blocks: ``num_kv_blocks``; else ``kv_cache_memory`` bytes; else on CUDA the
  ``gpu_memory_utilization`` share of the device left after the weights and a warm-up forward
  at the token budget; else on CPU 2 GiB capped at a quarter of RAM;
- ``max_model_len``: the argument, else the model's ``max_position_embeddings``; capped at the
  pool's token capacity (a longer sequence could never be held).

Tensor parallelism: this process is rank 0; ``distributed.TPWorkers`` runs ranks 1..N-1.
Every rank runs ``build_rank`` (load its shard, size its KV pool, build its runner); the
sizes above are per rank (a ``kv_cache_memory`` budget is each rank's; the CPU default is
split among the ranks of a machine) and all ranks take the smallest block count any of them
can hold, since block ids are the same everywhere.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import torch

from pagectl.engine.args import EngineArgs, parse_size, parse_structured_outputs_config
from pagectl.engine.config import CacheConfig, SchedulerConfig
from pagectl.engine.core import EngineCore
from pagectl.engine.distributed.sync import NO_SYNC, RankSync
from pagectl.engine.distributed.workers import TPWorkers, default_cpu_threads
from pagectl.engine.loader import (
    check_supported,
    load_model,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_model_path,
)
from pagectl.engine.model_config import ModelConfig
from pagectl.engine.models.parallel import SINGLE, TPGroup, check_tp_split
from pagectl.engine.runner.kv_cache import cuda_kv_bytes, default_cpu_kv_bytes, kv_bytes_per_block
from pagectl.engine.runner.model_runner import ModelRunner
from pagectl.engine.scheduler import Scheduler
from pagectl.engine.spec_decode.config import SpeculativeConfig
from pagectl.engine.spec_decode.draft_build import (
    check_draft_context,
    check_same_tokenizer,
    load_draft,
    resolve_draft,
)
from pagectl.engine.spec_decode.draft_model import DraftModelProposer
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
    # Default SamplingParams fields (from generation_config.json unless turned off).
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # Ranks 1..N-1 of a tensor-parallel engine, and whether this engine started them (and so
    # ends them at shutdown) or borrowed them.
    tp_workers: TPWorkers | None = None
    owns_tp_workers: bool = False
    # torch's thread count before this engine changed it (restored at shutdown).
    previous_num_threads: int | None = None

    def shutdown(self) -> None:
        """Release the model and KV memory and end the tensor-parallel workers this engine
        started (idempotent; never raises for a dead worker)."""
        runner = self.core.executor
        if isinstance(runner, ModelRunner):
            runner.release()
        workers = self.tp_workers
        self.tp_workers = None
        if workers is not None:
            if self.owns_tp_workers:
                workers.shutdown()
            else:
                workers.end_engine()
        if self.previous_num_threads is not None:
            torch.set_num_threads(self.previous_num_threads)
            self.previous_num_threads = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@dataclass
class RankBuild:
    """One rank's share of an engine: its runner and the sizes every rank agreed on."""

    runner: ModelRunner
    dtype: torch.dtype
    # KV bytes per block on this rank (its KV heads only; with a draft model, both pools).
    kv_bytes_per_block: int
    num_blocks: int
    max_num_batched_tokens: int
    max_model_len: int
    # CUDA pool sized from memory: the profile's figures (bytes; see _num_kv_blocks).
    memory_profile: dict[str, float] = field(default_factory=dict)


def build_engine(args: EngineArgs, tp_workers: TPWorkers | None = None) -> BuiltEngine:
    """Load the model named by ``args`` and assemble scheduler, runner and engine core.

    With ``tensor_parallel_size`` N > 1 this process is rank 0 and ranks 1..N-1 run in
    worker processes: started here (and ended by ``BuiltEngine.shutdown``), or the given
    ``tp_workers`` of that size, which outlive the engine. A model that cannot be split over
    N ranks fails here, before any process is started.
    """
    path = resolve_model(args.model)
    mcfg = ModelConfig.from_dir(path)
    spec = SpeculativeConfig.parse(args.speculative_config)
    device = resolve_device(args.device)
    check_supported(mcfg, args.quantization, device.type)
    tokenizer = load_tokenizer(args.tokenizer or path)
    draft = None
    if spec is not None and spec.method == "draft_model":
        # Checked before any process starts or weight loads; loaded on rank 0 only.
        draft = resolve_draft(spec, device.type)
        check_same_tokenizer(tokenizer, mcfg, *draft)
    tp_size = args.tensor_parallel_size
    previous_threads = None
    if tp_size == 1:
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        rank = build_rank(args, path, mcfg, device, draft=draft)
        workers, owned = None, False
    else:
        check_tp_split(
            mcfg.num_attention_heads, mcfg.num_key_value_heads, mcfg.intermediate_size, tp_size
        )
        if tp_workers is not None and tp_workers.size != tp_size:
            raise ValueError(
                f"tensor_parallel_size is {tp_size} but the given workers form a group of "
                f"{tp_workers.size}"
            )
        owned = tp_workers is None
        workers = tp_workers or TPWorkers.start(tp_size, device.type, device.index or 0)
        try:
            if device.type == "cpu":
                previous_threads = torch.get_num_threads()
                torch.set_num_threads(
                    args.num_threads or default_cpu_threads(workers.rdzv.local_size)
                )
            enforce_eager = args.enforce_eager or workers.backend != "nccl"
            workers.begin_engine(
                {
                    "engine_args": msgspec.to_builtins(args),
                    "model_path": path,
                    "enforce_eager": enforce_eager,
                }
            )
            rank = build_rank(
                args,
                path,
                mcfg,
                device,
                tp=workers.tp_group,
                sync=workers,
                tp_driver=workers,
                local_size=workers.rdzv.local_size,
                enforce_eager=enforce_eager,
                draft=draft,
            )
        except BaseException as e:
            # A worker that failed shows on rank 0 as a broken connection: name the worker.
            err = workers.explain(e)
            if previous_threads is not None:
                torch.set_num_threads(previous_threads)
            if owned:
                workers.shutdown()
            else:
                workers.end_engine()
            if err is e:
                raise
            raise err from e

    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=rank.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=rank.max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
        ),
        CacheConfig(
            block_size=args.block_size,
            num_kv_blocks=rank.num_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        speculative_config=spec,
    )
    eos = mcfg.eos_token_ids
    if not eos and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        eos = (int(tokenizer.eos_token_id),)
    name = args.served_model_name or args.model or BUILTIN_MODEL_NAME
    info = ModelInfo(
        model=name,
        dtype=str(rank.dtype).removeprefix("torch."),
        device=str(device),
        tp_size=tp_size,
        kv_bytes_per_block=rank.kv_bytes_per_block,
        kv_bytes_per_rank=rank.kv_bytes_per_block * rank.num_blocks,
        max_model_len=rank.max_model_len,
        attention_backend=rank.runner.backend.name,
        kv_cache_dtype=str(rank.runner.kv.tensor.dtype).removeprefix("torch."),
        memory_profile=rank.memory_profile,
    )
    graphs = rank.runner.cuda_graphs
    if graphs is not None:
        info.cuda_graph_max_batch = graphs.max_batch_size
        info.cuda_graph_capture_s = graphs.capture_s
        info.cuda_graph_bytes = graphs.capture_bytes
    structured = None
    if tokenizer is not None:
        from pagectl.engine.structured_outputs.manager import StructuredOutputManager

        so_config = parse_structured_outputs_config(args.structured_outputs_config)
        structured = StructuredOutputManager(
            tokenizer,
            mcfg.vocab_size,
            eos,
            disable_any_whitespace=so_config["disable_any_whitespace"],
        )
    core = EngineCore(
        scheduler,
        rank.runner,
        vocab_size=mcfg.vocab_size,
        eos_token_ids=eos,
        model_info=info,
        tokenizer_decode=tokenizer.decode if tokenizer is not None else None,
        structured_outputs=structured,
    )
    return BuiltEngine(
        core,
        tokenizer,
        name,
        path,
        mcfg.vocab_size,
        rank.max_model_len,
        tuple(eos),
        sampling_defaults=dict(mcfg.sampling_defaults) if args.generation_config == "auto" else {},
        tp_workers=workers,
        owns_tp_workers=owned,
        previous_num_threads=previous_threads,
    )


def build_rank(
    args: EngineArgs,
    path: str,
    mcfg: ModelConfig,
    device: torch.device,
    *,
    tp: TPGroup = SINGLE,
    sync: RankSync = NO_SYNC,
    tp_driver: Any = None,
    local_size: int = 1,
    enforce_eager: bool | None = None,
    draft: tuple[str, ModelConfig] | None = None,
) -> RankBuild:
    """Load this rank's shard and build its runner; every rank of a group runs this, meeting
    at the ``sync`` barriers (weights loaded, KV pool size agreed, runner ready).

    ``draft`` (rank 0 only): the draft model of speculative method "draft_model", loaded
    whole here; its KV pool has the same blocks as the target's, so a block costs both."""
    torch.manual_seed(args.seed)
    dtype = resolve_dtype(args.dtype, mcfg, device)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    model = load_model(path, mcfg, dtype, device, tp, args.quantization)
    drafted = None
    if draft is not None:
        drafted = load_draft(*draft, dtype, kv_dtype, device, args.block_size)
    sync.barrier("loaded")

    max_tokens = args.token_budget(device.type)
    attn = model.attention_layers[0]
    per_block = kv_bytes_per_block(
        mcfg.num_hidden_layers, args.block_size, attn.num_kv_heads, attn.head_dim, kv_dtype
    )
    # Every rank holds the same block ids: the pool is as large as the smallest rank allows.
    profile: dict[str, float] = {}
    pool_per_block = per_block + (drafted.kv_bytes_per_block if drafted is not None else 0)
    num_blocks = sync.agree_min(
        "num_kv_blocks",
        _num_kv_blocks(
            args, model, pool_per_block, max_tokens, device, local_size, kv_dtype, profile
        ),
    )
    capacity = num_blocks * args.block_size
    if args.max_model_len and args.max_model_len > mcfg.max_position_embeddings:
        # As vLLM: a longer context than the model was built for is refused, not served.
        raise ValueError(
            f"max_model_len {args.max_model_len} is longer than the model's "
            f"max_position_embeddings ({mcfg.max_position_embeddings})"
        )
    max_model_len = args.max_model_len or mcfg.max_position_embeddings
    if max_model_len > capacity:
        if tp.rank == 0:
            log.warning(
                "max_model_len %d exceeds the KV pool (%d tokens); capped", max_model_len, capacity
            )
        max_model_len = capacity

    # The target's runner and the draft's share everything about the pool and the batch.
    make_runner = functools.partial(
        ModelRunner,
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv_dtype,
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        attention_backend=args.attention_backend,
        seed=args.seed,
    )
    runner = make_runner(
        model,
        mcfg,
        enforce_eager=args.enforce_eager if enforce_eager is None else enforce_eager,
        tp_rank=tp.rank,
        tp_driver=tp_driver,
    )
    if drafted is not None:
        check_draft_context(drafted, max_model_len)
        draft_runner = make_runner(drafted.model, drafted.config, enforce_eager=True, samples=False)
        runner.drafter = DraftModelProposer(draft_runner, mcfg.vocab_size, args.seed)
    sync.barrier("ready")
    return RankBuild(runner, dtype, pool_per_block, num_blocks, max_tokens, max_model_len, profile)


def build_worker_runner(
    config: dict[str, Any], tp: TPGroup, sync: RankSync, device: torch.device, local_size: int
) -> ModelRunner:
    """A worker rank's runner for the engine rank 0 described in ``config``."""
    args = msgspec.convert(config["engine_args"], EngineArgs)
    path = config["model_path"]
    if not Path(path, "config.json").is_file():  # another node: its own copy of the model
        path = resolve_model(args.model)
    mcfg = ModelConfig.from_dir(path)
    if device.type == "cpu":
        torch.set_num_threads(args.num_threads or default_cpu_threads(local_size))
    rank = build_rank(
        args,
        path,
        mcfg,
        device,
        tp=tp,
        sync=sync,
        local_size=local_size,
        enforce_eager=config["enforce_eager"],
    )
    return rank.runner


def _num_kv_blocks(
    args: EngineArgs,
    model: Any,
    per_block: int,
    max_tokens: int,
    device: torch.device,
    local_size: int = 1,
    kv_dtype: torch.dtype | None = None,
    profile: dict[str, float] | None = None,
) -> int:
    """The pool's block count on this rank; on CUDA without an explicit size, the memory
    profile's figures go into ``profile`` and the log (as vLLM: the ``utilization`` share
    of the device, less what is in use after loading, less the peak a forward at the token
    budget adds; CUDA graphs, captured later, come out of the remaining headroom)."""
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    if args.kv_cache_memory is not None:
        budget = parse_size(args.kv_cache_memory)
    elif device.type == "cuda":
        from pagectl.engine.runner.profiling import measure_peak_activation

        free, total = torch.cuda.mem_get_info(device)
        peak = measure_peak_activation(
            model,
            max_tokens,
            args.max_num_seqs,
            args.block_size,
            args.attention_backend,
            device,
            kv_dtype,
        )
        budget = cuda_kv_bytes(device, args.gpu_memory_utilization, total - free, peak)
        figures = dict(
            total_bytes=total,
            gpu_memory_utilization=args.gpu_memory_utilization,
            used_after_load_bytes=total - free,
            peak_activation_bytes=peak,
            profiled_tokens=max_tokens,
            kv_budget_bytes=budget,
        )
        if profile is not None:
            profile.update(figures)
        gib = 2**30
        log.info(
            "GPU memory: %.2f GiB total x %.2f utilization - %.2f GiB in use after loading - "
            "%.2f GiB peak activation (a %d-token forward) = %.2f GiB for the KV cache",
            total / gib,
            args.gpu_memory_utilization,
            (total - free) / gib,
            peak / gib,
            max_tokens,
            budget / gib,
        )
    else:
        # The CPU default is a share of this machine's RAM: split among its ranks.
        budget = default_cpu_kv_bytes() // local_size
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache: the budget is {budget} bytes and one block of "
            f"{args.block_size} tokens takes {per_block} bytes"
        )
    return int(num_blocks)
