"""One prepared run for a lent GPU: the CUDA paths against transformers, then throughput.

    python benchmarks/gpu_check.py --out /tmp/gpu-check          # GPU: sized for 8 min on an H200
    python benchmarks/gpu_check.py --device cpu --smoke          # the same logic, tiny, seconds

1. **Correctness** (bfloat16, logprob-close). A Qwen3-0.6B-shaped model with random weights
   (or ``--model DIR``) generates greedy continuations of a few prompts whose lengths straddle
   block boundaries, with the logprob of every chosen token, in each engine configuration:
   the torch backend (eager), and flash-attn with CUDA graphs on and off when ``flash_attn``
   imports (block size 256, which its paged kernels need). transformers then scores the same
   token sequences (one forward per prompt + continuation, teacher-forced), and each token's
   logprob must agree within ``--logprob-tol``. The first position that does not is
   reported (prompt, position, both tokens and logprobs), with how often transformers'
   argmax is our token. On CPU the configurations are the torch and cpu-kernel backends.
2. **Throughput** on nano-vllm's workload: 256 requests, prompt and output lengths uniform in
   [100, 1024], token ids in [0, 10000], temperature 0.6, ignore_eos, every request its own
   max_tokens; output tok/s = those tokens / the ``generate`` call's time (nano-vllm's
   figure: 1,434 tok/s for Qwen3-0.6B on an RTX 4070 Laptop). Runs in priority order (flash
   with CUDA graphs, flash eager, torch eager), each skipped if the time budget would be
   exceeded.

Everything goes to ``--out``: ``report.json`` (all results), ``table.txt``; the last line
printed is the report as one JSON line. Exit status 1 if a correctness check failed.
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

import torch  # noqa: E402

from pagectl.bench.options import log, model_vocab_size  # noqa: E402
from pagectl.bench.workload import WorkloadSpec, random_workload, total_prompt_tokens  # noqa: E402

# Qwen3-0.6B's shape; random weights (seed 0).
QWEN3_06B = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=151936,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)
SMOKE = dict(QWEN3_06B, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
SMOKE.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512)
NANO_VLLM = {"output_tok_s": 1434, "hardware": "RTX 4070 Laptop", "model": "Qwen3-0.6B"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--smoke", action="store_true", help="tiny model and workload (tests)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"), help="output dir")
    p.add_argument("--model", default=None, help="model dir instead of the random Qwen3-0.6B")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=None, help="default 256 (smoke 6)")
    p.add_argument("--prompts", type=int, default=None, help="correctness prompts (8; smoke 4)")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens (32; smoke 6)")
    p.add_argument("--logprob-tol", type=float, default=0.2, help="max |logprob difference|")
    p.add_argument("--temperature", type=float, default=0.6, help="throughput sampling")
    p.add_argument("--time-budget-s", type=float, default=450.0, help="skip runs past this")
    p.add_argument("--skip-correctness", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
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


def build_random_model(out_dir: Path, shape: dict, device: str, dtype: torch.dtype) -> Path:
    """A Qwen3 checkpoint with random weights (transformers' init, seed 0), built once."""
    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        return out_dir
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(dtype)
    model.save_pretrained(out_dir)
    del model
    return out_dir


def engine_configs(device: str, phase: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, LLM keyword arguments) per engine configuration, in priority order."""
    if device == "cpu":
        return [
            ("torch", dict(attention_backend="torch", block_size=16)),
            ("cpu-kernel", dict(attention_backend="cpu-kernel", block_size=16)),
        ]
    runs = [
        ("flash, CUDA graphs", dict(attention_backend="flash", block_size=256)),
        ("flash, eager", dict(attention_backend="flash", block_size=256, enforce_eager=True)),
        ("torch, eager", dict(attention_backend="torch", block_size=256, enforce_eager=True)),
    ]
    if phase == "correctness":
        runs.insert(0, runs.pop())  # the backend that always exists first
    return runs


def flash_missing(device: str) -> str | None:
    if device == "cpu":
        return "no CUDA"
    try:
        import flash_attn  # noqa: F401
    except ImportError as e:
        return f"flash_attn is not importable ({e})"
    return None


def correctness_prompts(n: int, vocab: int, block_size: int = 256) -> list[list[int]]:
    """Prompt lengths on and around block boundaries (256 and 16), seeded."""
    g = torch.Generator().manual_seed(1)
    lengths = [1, 15, 17, block_size - 1, block_size, block_size + 1, 600, 1000][:n]
    return [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]


def hf_scores(hf: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each position that predicted ``tokens[j]``: [n, vocab]."""
    ids = torch.tensor([prompt + tokens[:-1]], device=hf.device)
    with torch.inference_mode():
        logits = hf(input_ids=ids).logits[0, len(prompt) - 1 :]
    return logits.float().log_softmax(-1)


def check_correctness(llm: Any, hf: Any, prompts: list[list[int]], args: argparse.Namespace):
    """Greedy + logprobs through ``llm``; every chosen token scored by transformers."""
    from pagectl import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    worst = 0.0
    agree = total = 0
    first = None
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        tokens = list(out.outputs[0].token_ids)
        ours = [lp.logprob for lp in out.outputs[0].logprobs]
        ref = hf_scores(hf, prompt, tokens)
        for j, tok in enumerate(tokens):
            theirs = float(ref[j, tok])
            diff = abs(ours[j] - theirs)
            worst = max(worst, diff)
            top = int(ref[j].argmax())
            agree += top == tok
            total += 1
            if diff > args.logprob_tol and first is None:
                first = dict(
                    prompt=i,
                    prompt_len=len(prompt),
                    position=j,
                    token=tok,
                    logprob=ours[j],
                    hf_logprob=theirs,
                    hf_argmax=top,
                    hf_argmax_logprob=float(ref[j, top]),
                )
    return dict(
        passed=first is None,
        max_abs_logprob_diff=worst,
        tokens=total,
        hf_argmax_agreement=agree / max(total, 1),
        first_divergence=first,
    )


def run_throughput(llm: Any, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    from pagectl import SamplingParams

    lo, hi = (8, 48) if args.smoke else (100, 1024)
    spec = WorkloadSpec(args.num_requests, lo, hi, lo, hi, vocab_size=min(vocab, 10001), seed=0)
    work = random_workload(spec, low_token_id=0)
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=r.output_len, ignore_eos=True)
        for r in work
    ]
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in work], params)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = total_prompt_tokens(work)
    return dict(
        requests=len(work),
        prompt_tokens=prompt_tokens,
        output_tokens=out_tokens,
        wrong_lengths=sum(
            len(o.outputs[0].token_ids) != r.output_len for o, r in zip(outs, work, strict=True)
        ),
        time_s=elapsed,
        output_tok_s=out_tokens / elapsed,
        total_tok_s=(out_tokens + prompt_tokens) / elapsed,
    )


def make_llm(model: Path, args: argparse.Namespace, kw: dict, phase: str) -> Any:
    from pagectl import LLM

    sizing: dict[str, Any] = dict(max_model_len=4096)
    if phase == "correctness" or args.device == "cpu":
        # Few sequences: a small pool, and few CUDA graph buckets to capture.
        sizing.update(max_num_seqs=16, kv_cache_memory="256MiB" if args.smoke else "4GiB")
    else:
        sizing.update(max_num_seqs=512, max_num_batched_tokens=16384)  # nano-vllm's settings
    return LLM(model=str(model), dtype=args.dtype, device=args.device, seed=0, **sizing, **kw)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    report: dict[str, Any] = dict(
        device=args.device,
        device_name=(
            torch.cuda.get_device_name(0)
            if args.device.startswith("cuda")
            else platform.processor() or platform.machine()
        ),
        torch=torch.__version__,
        transformers=_version("transformers"),
        smoke=args.smoke,
        dtype=args.dtype,
        correctness=[],
        throughput=[],
        nano_vllm_reference=NANO_VLLM,
    )
    missing = flash_missing(args.device)
    report["flash_attn"] = missing or f"flash_attn {_version('flash_attn') or '?'}"
    shape = SMOKE if args.smoke else QWEN3_06B
    if args.model:
        model = Path(args.model)
        vocab = model_vocab_size(args.model)
    else:
        tag = "smoke" if args.smoke else "qwen3-0.6b"
        log(f"building the random {tag} model ...")
        model = build_random_model(out / f"model-{tag}", shape, args.device, dtype)
        vocab = int(shape["vocab_size"])
        report["model_shape"] = shape
    report["model"] = str(model)

    if not args.skip_correctness:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(args.device).eval()
        prompts = correctness_prompts(args.prompts, vocab)
        for name, kw in engine_configs(args.device, "correctness"):
            row: dict[str, Any] = dict(config=name, **kw)
            if kw["attention_backend"] == "flash" and missing:
                row["skipped"] = missing
            else:
                log(f"correctness: {name} ...")
                try:
                    with make_llm(model, args, kw, "correctness") as llm:
                        row.update(check_correctness(llm, hf, prompts, args))
                except Exception as e:  # recorded; the other configurations still run
                    row.update(passed=False, error=f"{type(e).__name__}: {e}")
                    row["traceback"] = traceback.format_exc()
            report["correctness"].append(row)
        del hf

    if not args.skip_throughput:
        last_s = 0.0
        for name, kw in engine_configs(args.device, "throughput"):
            row = dict(config=name, **kw)
            spent = time.perf_counter() - start
            if kw["attention_backend"] == "flash" and missing:
                row["skipped"] = missing
            elif last_s and spent + 1.5 * last_s > args.time_budget_s:
                row["skipped"] = f"time budget ({spent:.0f} s spent of {args.time_budget_s:.0f})"
            else:
                log(f"throughput: {name} ...")
                t0 = time.perf_counter()
                try:
                    with make_llm(model, args, kw, "throughput") as llm:
                        row["build_s"] = time.perf_counter() - t0
                        row.update(run_throughput(llm, args, vocab))
                except Exception as e:  # recorded; the other configurations still run
                    row["error"] = f"{type(e).__name__}: {e}"
                    row["traceback"] = traceback.format_exc()
                last_s = time.perf_counter() - t0
            report["throughput"].append(row)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    report["elapsed_s"] = time.perf_counter() - start
    report["passed"] = all(r.get("passed", True) for r in report["correctness"])
    table = render(report)
    (out / "table.txt").write_text(table + "\n")
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table)
    print(json.dumps({k: v for k, v in report.items() if k != "model_shape"}, default=str))
    return 0 if report["passed"] else 1


def render(report: dict) -> str:
    lines = [
        f"device: {report['device_name']} ({report['device']}), torch {report['torch']}, "
        f"flash_attn: {report['flash_attn']}, model: {report['model']}",
        "",
        "correctness (logprob-close to transformers, teacher-forced on our greedy tokens):",
    ]
    for r in report["correctness"]:
        if "skipped" in r or "error" in r:
            lines.append(f"  {r['config']:<20} {r.get('skipped') or r.get('error')}")
            continue
        verdict = "ok" if r["passed"] else f"DIVERGES at {r['first_divergence']}"
        lines.append(
            f"  {r['config']:<20} max |dlogprob| {r['max_abs_logprob_diff']:.4f} over "
            f"{r['tokens']} tokens, argmax agreement {r['hf_argmax_agreement']:.1%}: {verdict}"
        )
    lines += ["", "throughput (nano-vllm workload):"]
    lines.append(
        f"  {'config':<20} {'requests':>8} {'out tokens':>10} {'time s':>8} {'out tok/s':>10}"
    )
    for r in report["throughput"]:
        if "output_tok_s" not in r:
            lines.append(f"  {r['config']:<20} {r.get('skipped') or r.get('error')}")
            continue
        lines.append(
            f"  {r['config']:<20} {r['requests']:>8} {r['output_tokens']:>10} "
            f"{r['time_s']:>8.1f} {r['output_tok_s']:>10.1f}"
        )
    ref = report["nano_vllm_reference"]
    lines.append(f"  nano-vllm's published figure: {ref['output_tok_s']} tok/s ({ref['hardware']})")
    lines.append(f"total {report['elapsed_s']:.0f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
