"""One prepared run for a lent GPU: every CUDA path against transformers, then throughput.

    python benchmarks/gpu_check.py --out $OUT          # GPU: sized for about 8 min on an H200
    python benchmarks/gpu_check.py --device cpu --smoke # the same logic, tiny, seconds

No downloads: the models are Qwen3-0.6B- and Qwen3-8B-shaped with random weights, built on
the device itself (``--model DIR`` to use a checkpoint instead). Phases, in order:

1. **bfloat16, logprob-close** (``correctness``): greedy continuations of prompts whose
   lengths straddle block boundaries, with the logprob of every chosen token, per engine
   configuration: triton with CUDA graphs and eager, torch eager, flash-attn with graphs
   when ``flash_attn`` imports (block size 256); on CPU torch and cpu-kernel. transformers
   scores the same tokens teacher-forced; each logprob must agree within ``--logprob-tol``.
   The first position that does not is reported (prompt, position, both tokens, logprobs).
2. **float32, token for token** (``exact_fp32``): the same configurations and prompts in
   float32; transformers' argmax must be our token wherever it wins by more than
   ``--tie-tol`` nats.
3. **Throughput** (``throughput``) on nano-vllm's workload: 256 requests, prompt and output
   lengths uniform in [100, 1024], temperature 0.6, ignore_eos; output tok/s = those tokens /
   the ``generate`` call's time (nano-vllm: 1,434 tok/s for Qwen3-0.6B on an RTX 4070
   Laptop), per backend with CUDA graphs on and off; in the same engine, decode tok/s at
   batch 1, 16 and 256 (``decode``).
4. **K/V write** (``kv_write``): the triton write kernel against torch's ``index_copy_``.
5. **TP = 2** (``tp2``) when two GPUs are present: throughput and decode, triton + graphs.
6. **Qwen3-8B shape** (``qwen3_8b``): bfloat16 logprob-close check and decode tok/s.

Every phase checks the time budget (``--time-budget-s``) before each configuration and
records a skip rather than overrun. Everything goes to ``--out``: ``report.json``,
``table.txt``; the last line printed is the report as one JSON line. Exit status 1 if a
correctness check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from gpu_measure import (  # noqa: E402
    QWEN3_06B,
    QWEN3_8B,
    SMOKE,
    build_random_model,
    check_against_hf,
    correctness_prompts,
    decode_rate,
    kv_write_timing,
    nano_vllm_throughput,
)

from pagectl.bench.options import log, model_vocab_size  # noqa: E402

NANO_VLLM = {"output_tok_s": 1434, "hardware": "RTX 4070 Laptop", "model": "Qwen3-0.6B"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--smoke", action="store_true", help="tiny model and workload (tests)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"), help="output dir")
    p.add_argument("--model", default=None, help="model dir instead of the random Qwen3-0.6B")
    p.add_argument(
        "--models-dir",
        default=None,
        help="where the random models are written (default: /tmp/gpu-check-models; smoke: "
        "under --out); kept out of --out, which a lent machine sends back",
    )
    p.add_argument("--dtype", default="bfloat16", help="dtype of the logprob-close phase")
    p.add_argument("--num-requests", type=int, default=None, help="default 256 (smoke 6)")
    p.add_argument("--prompts", type=int, default=None, help="correctness prompts (8; smoke 4)")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens (32; smoke 6)")
    p.add_argument("--logprob-tol", type=float, default=0.2, help="max |logprob difference|")
    p.add_argument("--tie-tol", type=float, default=1e-3, help="float32: argmax tie, nats")
    p.add_argument("--temperature", type=float, default=0.6, help="throughput sampling")
    p.add_argument("--time-budget-s", type=float, default=480.0, help="skip runs past this")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-fp32", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--skip-8b", action="store_true")
    args = p.parse_args(argv)
    small = args.smoke
    args.num_requests = args.num_requests or (6 if small else 256)
    args.prompts = args.prompts or (4 if small else 8)
    args.new_tokens = args.new_tokens or (6 if small else 32)
    return args


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def engine_configs(device: str, phase: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, LLM keyword arguments) per engine configuration, in priority order."""
    if device == "cpu":
        return [
            ("torch", dict(attention_backend="torch", block_size=16)),
            ("cpu-kernel", dict(attention_backend="cpu-kernel", block_size=16)),
        ]
    runs = [
        ("triton, CUDA graphs", dict(attention_backend="triton", block_size=16)),
        ("triton, eager", dict(attention_backend="triton", block_size=16, enforce_eager=True)),
        ("torch, eager", dict(attention_backend="torch", block_size=16, enforce_eager=True)),
        ("flash, CUDA graphs", dict(attention_backend="flash", block_size=256)),
        ("flash, eager", dict(attention_backend="flash", block_size=256, enforce_eager=True)),
    ]
    if phase != "throughput":
        runs = [r for r in runs if r[0] != "flash, eager"]
    if phase == "exact_fp32":  # flash-attn has no float32 kernels
        runs = [r for r in runs if r[1]["attention_backend"] != "flash"]
    return runs


def missing_reason(device: str, backend: str) -> str | None:
    """Why ``backend`` cannot run here (None when it can)."""
    if backend not in ("triton", "flash"):
        return None
    if device == "cpu":
        return "no CUDA"
    module = "flash_attn" if backend == "flash" else "triton"
    try:
        __import__(module)
    except ImportError as e:
        return f"{module} is not importable ({e})"
    return None


class Budget:
    """Seconds left of ``--time-budget-s``; a run is skipped when its estimate (1.5x the last
    run of the same phase) would overrun."""

    def __init__(self, total_s: float) -> None:
        self.start = time.perf_counter()
        self.total_s = total_s
        self.last: dict[str, float] = {}

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def refuse(self, phase: str, first_run_s: float = 0.0) -> str | None:
        """Why not to start a run of ``phase`` now (None: go); ``first_run_s`` is the
        estimate when the phase has not run yet."""
        est = 1.5 * self.last.get(phase, first_run_s)
        if self.spent() + est > self.total_s:
            return f"time budget ({self.spent():.0f} s spent of {self.total_s:.0f})"
        return None


def make_llm(model: Path, args: argparse.Namespace, kw: dict, phase: str, dtype: str) -> Any:
    from pagectl import LLM

    sizing: dict[str, Any] = dict(max_model_len=4096)
    if phase != "throughput" or args.device == "cpu":
        # Few sequences: a small pool, and few CUDA graph buckets to capture.
        sizing.update(max_num_seqs=16, kv_cache_memory="256MiB" if args.smoke else "4GiB")
    else:
        sizing.update(max_num_seqs=512, max_num_batched_tokens=16384)  # nano-vllm's settings
    sizing.update(kw)
    return LLM(model=str(model), dtype=dtype, device=args.device, seed=0, **sizing)


def run_rows(
    phase: str,
    configs: list[tuple[str, dict]],
    args: argparse.Namespace,
    budget: Budget,
    body: Any,
) -> list[dict[str, Any]]:
    """One report row per configuration: ``body(name, kw)`` fills it, unless the backend is
    missing or the budget is spent; an exception is recorded and the next one still runs."""
    rows = []
    for name, kw in configs:
        row: dict[str, Any] = dict(config=name, **kw)
        why = missing_reason(args.device, kw["attention_backend"]) or budget.refuse(phase)
        if why:
            row["skipped"] = why
            rows.append(row)
            continue
        log(f"{phase}: {name} ...")
        t0 = time.perf_counter()
        try:
            row.update(body(name, kw))
        except Exception as e:  # recorded; the other configurations still run
            row.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
            if phase in ("correctness", "exact_fp32", "qwen3_8b"):
                row["passed"] = False
        row["wall_s"] = time.perf_counter() - t0
        budget.last[phase] = row["wall_s"]
        rows.append(row)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def correctness_phase(
    phase: str, model: Path, vocab: int, dtype: str, args: argparse.Namespace, budget: Budget
) -> list[dict]:
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).to(args.device).eval()
    prompts = correctness_prompts(args.prompts, vocab)
    tie = args.tie_tol if dtype == "float32" else None
    tol = args.logprob_tol if dtype != "float32" else min(args.logprob_tol, 1e-2)

    def body(name: str, kw: dict) -> dict:
        with make_llm(model, args, kw, phase, dtype) as llm:
            out = check_against_hf(llm, hf, prompts, args.new_tokens, tol, tie)
            out["engine"] = engine_facts(llm)
            return out

    return run_rows(phase, engine_configs(args.device, phase), args, budget, body)


def engine_facts(llm: Any) -> dict[str, Any]:
    info = llm.core.model_info
    return dict(
        attention_backend=info.attention_backend,
        kv_cache_dtype=info.kv_cache_dtype,
        cuda_graph_max_batch=info.cuda_graph_max_batch,
        cuda_graph_capture_s=info.cuda_graph_capture_s,
        cuda_graph_bytes=info.cuda_graph_bytes,
        kv_bytes=info.kv_bytes_per_rank,
        memory_profile=dict(info.memory_profile),
    )


def decode_batches(args: argparse.Namespace) -> tuple[list[int], int, int]:
    """(batch sizes, prompt length, tokens) of the decode-rate runs."""
    return ([1, 4], 16, 4) if args.smoke else ([1, 16, 256], 512, 64)


def throughput_phase(
    model: Path, vocab: int, args: argparse.Namespace, budget: Budget, **extra: Any
) -> tuple[list[dict], list[dict]]:
    lo, hi = (8, 48) if args.smoke else (100, 1024)
    decode_rows: list[dict] = []
    configs = extra.pop("configs", None) or engine_configs(args.device, "throughput")

    def body(name: str, kw: dict) -> dict:
        t0 = time.perf_counter()
        with make_llm(model, args, dict(kw, **extra), "throughput", args.dtype) as llm:
            row: dict[str, Any] = dict(build_s=time.perf_counter() - t0)
            row["tensor_parallel_size"] = extra.get("tensor_parallel_size", 1)
            row["engine"] = engine_facts(llm)
            row.update(
                nano_vllm_throughput(llm, args.num_requests, lo, hi, vocab, args.temperature)
            )
            batches, plen, new = decode_batches(args)
            for b in batches:
                d = dict(config=name, tp=extra.get("tensor_parallel_size", 1))
                try:
                    d.update(decode_rate(llm, b, plen, new, vocab))
                except Exception as e:  # recorded; the next batch still runs
                    d.update(batch=b, error=f"{type(e).__name__}: {e}")
                decode_rows.append(d)
            return row

    rows = run_rows("throughput", configs, args, budget, body)
    return rows, decode_rows


def large_model_phase(out: Path, args: argparse.Namespace, budget: Budget) -> dict[str, Any]:
    """The Qwen3-8B shape: built, checked (bf16, 2 prompts), decode tok/s (triton + graphs)."""
    if args.device == "cpu" or args.skip_8b or args.model:
        return dict(skipped="cpu, --skip-8b or --model")
    # Building, saving and loading 16 GB of weights twice, then the runs: about 3 minutes.
    why = missing_reason(args.device, "triton") or budget.refuse("qwen3_8b", 120.0)
    if why:
        return dict(skipped=why)
    t0 = time.perf_counter()
    row: dict[str, Any] = dict(shape=QWEN3_8B)
    try:
        model = build_random_model(
            models_dir(args) / "qwen3-8b", QWEN3_8B, args.device, torch.bfloat16
        )
        row["build_s"] = time.perf_counter() - t0
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(args.device)
        vocab = int(QWEN3_8B["vocab_size"])
        kw = dict(attention_backend="triton", block_size=16, max_num_seqs=256)
        from pagectl import LLM

        with LLM(model=str(model), dtype="bfloat16", device=args.device, **kw) as llm:
            prompts = correctness_prompts(3, vocab)
            row["correctness"] = check_against_hf(llm, hf, prompts, 16, args.logprob_tol)
            del hf
            torch.cuda.empty_cache()
            row["engine"] = engine_facts(llm)
            row["decode"] = [decode_rate(llm, b, 512, 64, vocab) for b in (1, 16, 256)]
    except Exception as e:  # recorded; the report is still written
        row.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        row.setdefault("correctness", dict(passed=False))
    row["wall_s"] = time.perf_counter() - t0
    return row


def models_dir(args: argparse.Namespace) -> Path:
    if args.models_dir:
        return Path(args.models_dir)
    return Path(args.out) / "models" if args.smoke else Path("/tmp/gpu-check-models")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import msgspec  # noqa: F401  (the engine's one dependency a bare GPU image may lack)
    except ImportError:
        log("msgspec is not importable: carry its wheel (docs/PERFORMANCE.md, section 6)")
        return 2
    budget = Budget(args.time_budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    report: dict[str, Any] = dict(
        device=args.device,
        device_name=torch.cuda.get_device_name(0) if cuda else platform.machine(),
        gpus=torch.cuda.device_count() if cuda else 0,
        torch=torch.__version__,
        triton=_version("triton"),
        transformers=_version("transformers"),
        flash_attn=missing_reason(args.device, "flash") or _version("flash_attn"),
        smoke=args.smoke,
        dtype=args.dtype,
        correctness=[],
        exact_fp32=[],
        throughput=[],
        decode=[],
        nano_vllm_reference=NANO_VLLM,
    )
    shape = SMOKE if args.smoke else QWEN3_06B
    if args.model:
        model = Path(args.model)
        vocab = model_vocab_size(args.model)
    else:
        tag = "smoke" if args.smoke else "qwen3-0.6b"
        log(f"building the random {tag} model ...")
        model = build_random_model(models_dir(args) / tag, shape, args.device, torch.bfloat16)
        vocab = int(shape["vocab_size"])
        report["model_shape"] = shape
    report["model"] = str(model)

    if not args.skip_correctness:
        report["correctness"] = correctness_phase(
            "correctness", model, vocab, args.dtype, args, budget
        )
        if not args.skip_fp32:
            report["exact_fp32"] = correctness_phase(
                "exact_fp32", model, vocab, "float32", args, budget
            )
    if not args.skip_throughput:
        report["throughput"], report["decode"] = throughput_phase(model, vocab, args, budget)
    if cuda and missing_reason(args.device, "triton") is None:
        try:
            report["kv_write"] = [kv_write_timing(args.device, n, 8, 128) for n in (1, 256, 8192)]
        except Exception as e:  # recorded; the report is still written
            report["kv_write"] = dict(error=f"{type(e).__name__}: {e}")
    if cuda and report["gpus"] >= 2 and not args.skip_throughput:
        tp_configs = [
            c for c in engine_configs(args.device, "throughput") if c[0].startswith("triton, C")
        ]
        report["tp2"], report["tp2_decode"] = throughput_phase(
            model, vocab, args, budget, tensor_parallel_size=2, configs=tp_configs
        )
    elif cuda:
        report["tp2"] = dict(skipped=f"{report['gpus']} GPU(s)")
    if cuda:
        report["qwen3_8b"] = large_model_phase(out, args, budget)

    report["elapsed_s"] = budget.spent()
    checks = report["correctness"] + report["exact_fp32"]
    large = report.get("qwen3_8b") or {}
    report["passed"] = all(r.get("passed", True) for r in checks) and large.get(
        "correctness", {}
    ).get("passed", True)
    table = render(report)
    (out / "table.txt").write_text(table + "\n")
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(table)
    print(json.dumps({k: v for k, v in report.items() if k != "model_shape"}, default=str))
    return 0 if report["passed"] else 1


def render(report: dict) -> str:
    lines = [
        f"device: {report['device_name']} ({report['device']}, {report['gpus']} GPU), torch "
        f"{report['torch']}, triton {report['triton']}, flash_attn {report['flash_attn']}, "
        f"model: {report['model']}",
    ]
    for key, title in (
        ("correctness", f"{report['dtype']}, logprob-close to transformers (teacher-forced):"),
        ("exact_fp32", "float32, token for token (argmax ties excepted):"),
    ):
        lines += ["", title]
        for r in report[key]:
            if "skipped" in r or "error" in r:
                lines.append(f"  {r['config']:<20} {r.get('skipped') or r.get('error')}")
                continue
            verdict = "ok" if r["passed"] else f"DIVERGES at {r['first_divergence']}"
            lines.append(
                f"  {r['config']:<20} max |dlogprob| {r['max_abs_logprob_diff']:.4f} over "
                f"{r['tokens']} tokens, argmax agreement {r['hf_argmax_agreement']:.1%}: "
                f"{verdict}"
            )
    lines += ["", "throughput (nano-vllm workload):"]
    lines.append(
        f"  {'config':<20} {'requests':>8} {'out tokens':>10} {'time s':>8} {'out tok/s':>10}"
    )
    for r in report["throughput"] + (
        report.get("tp2") if isinstance(report.get("tp2"), list) else []
    ):
        name = r["config"] + (" TP2" if r.get("tensor_parallel_size") == 2 else "")
        if "output_tok_s" not in r:
            lines.append(f"  {name:<20} {r.get('skipped') or r.get('error')}")
            continue
        lines.append(
            f"  {name:<20} {r['requests']:>8} {r['output_tokens']:>10} "
            f"{r['time_s']:>8.1f} {r['output_tok_s']:>10.1f}"
        )
    ref = report["nano_vllm_reference"]
    lines.append(f"  nano-vllm's published figure: {ref['output_tok_s']} tok/s ({ref['hardware']})")
    lines += ["", "decode tok/s at a fixed batch:"]
    for d in report["decode"] + report.get("tp2_decode", []):
        figure = f"{d['decode_tok_s']:.1f} tok/s" if "decode_tok_s" in d else d.get("error")
        lines.append(f"  {d['config']:<20} TP{d.get('tp', 1)} batch {d['batch']:>4}: {figure}")
    lines.append(f"total {report['elapsed_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
