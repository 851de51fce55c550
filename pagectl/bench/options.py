"""Options and inputs shared by the benchmarks: the workload flags, the benchmark model
(``--model``, or a synthetic random-weight model built once into a cache dir), and the
random workload's spec made from them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagectl.bench.workload import WorkloadSpec

DEFAULT_SYNTHETIC = "qwen3-33m"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_workload_arguments(p: argparse.ArgumentParser, num_requests: int = 64) -> None:
    g = p.add_argument_group("workload (random token-id prompts, ignore_eos)")
    g.add_argument("--num-requests", type=int, default=num_requests)
    g.add_argument("--min-input-len", type=int, default=64)
    g.add_argument("--max-input-len", type=int, default=512)
    g.add_argument("--min-output-len", type=int, default=32)
    g.add_argument("--max-output-len", type=int, default=256)
    g.add_argument("--workload-seed", type=int, default=0, help="seed of the random workload")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark model")
    g.add_argument(
        "--synthetic-model",
        default=None,
        help=f"build (once, into a cache dir) and use a random-weight model: qwen3-33m or qwen3-tiny "
        f"(default when --model is not given: {DEFAULT_SYNTHETIC})",
    )
    g.add_argument("--synthetic-cache-dir", default=None, help="where synthetic models are built")


def resolve_model(args: argparse.Namespace) -> str:
    """The model directory or id to benchmark: --model, else the synthetic model."""
    if args.model is not None and args.synthetic_model is None:
        return args.model
    from pagectl.bench.synthetic import ensure_synthetic_model

    name = args.synthetic_model or DEFAULT_SYNTHETIC
    log(f"synthetic model {name}: building or reusing in the cache dir ...")
    return str(ensure_synthetic_model(name, args.synthetic_cache_dir))


def model_vocab_size(model: str) -> int:
    cfg = Path(model) / "config.json"
    if cfg.exists():
        data = json.loads(cfg.read_text())
        text = data.get("text_config") or data
        return int(text["vocab_size"])
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    return int(c.get_text_config().vocab_size)


def hf_token_budget(args: argparse.Namespace) -> int:
    """Token budget per step of transformers' continuous batching: pagectl's (its flag, else
    its default on the device the flags name)."""
    if args.hf_max_batch_tokens:
        return int(args.hf_max_batch_tokens)
    from pagectl.engine.args import EngineArgs
    from pagectl.engine.builder import resolve_device

    return EngineArgs.from_cli(args).token_budget(resolve_device(args.device).type)


def workload_spec(args: argparse.Namespace, vocab_size: int) -> WorkloadSpec:
    """The random workload the workload flags describe (``random_workload`` makes it)."""
    return WorkloadSpec(
        num_requests=args.num_requests,
        min_input_len=args.min_input_len,
        max_input_len=args.max_input_len,
        min_output_len=args.min_output_len,
        max_output_len=args.max_output_len,
        vocab_size=vocab_size,
        seed=args.workload_seed,
    )
