"""Profile the model runner on the performance issue's benchmark model and workload.

Model: Qwen3 architecture, hidden 512, 8 layers, 8 heads / 4 KV heads, head_dim 64,
intermediate 1536, vocab 16384, float32, random weights. Workload: N requests with prompt
lengths uniform in [64, 512] and output lengths uniform in [32, 256], random token ids, greedy,
ignore_eos, all submitted at once, run through the real EngineCore (scheduler + runner).

Prints the time per step split into batch preparation / forward (incl. LM head) / sampling /
scheduler, prefill and decode steps apart, useful output tokens/s and model tokens/s (prompt
and output tokens through the forward), and the forward-pass limit: tokens/s of a bare forward
over one 512-token sequence on the same model and threads (ours, and transformers' with
``--hf``), compared with model tokens/s as ``docs/PERFORMANCE.md`` does. Wall-clock figures
and per-CPU-second figures are both printed: on a shared machine the latter (with
``--threads 1``) are the steadier ones.

    python benchmarks/runner_profile.py --requests 48 --threads 2
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: threads that wait sleep instead of spinning. On a machine shared
# with other CPU-bound jobs, spinning OpenMP threads made a 2-thread run 5x slower here; set
# OMP_WAIT_POLICY=ACTIVE to measure the spinning behaviour.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from pagectl.engine.config import CacheConfig, SchedulerConfig
from pagectl.engine.core import EngineCore
from pagectl.engine.model_config import ModelConfig
from pagectl.engine.models import get_model_class
from pagectl.engine.runner.model_runner import ModelRunner
from pagectl.engine.runner.profiling import dummy_prefill_metadata
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.scheduler import Scheduler

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 16384,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "dtype": "float32",
}


def build_model(seed: int = 0):
    cfg = ModelConfig.from_dict(CONFIG)
    torch.manual_seed(seed)
    model = get_model_class(cfg.architecture)(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    for attn in model.attention_layers:
        attn.process_weights_after_loading()
    return cfg, model.eval()


def build_core(cfg, model, args) -> EngineCore:
    runner = ModelRunner(
        model,
        cfg,
        device=torch.device("cpu"),
        dtype=torch.float32,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=1024,
        max_num_seqs=256,
        attention_backend=args.attention_backend,
    )
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=args.budget,
            max_num_seqs=256,
            max_model_len=1024,
            long_prefill_token_threshold=0,
            policy="fcfs",
        ),
        CacheConfig(
            block_size=args.block_size, num_kv_blocks=args.num_blocks, enable_prefix_caching=True
        ),
    )
    return EngineCore(sched, runner, vocab_size=cfg.vocab_size)


def workload(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(64, 512))], rng.randint(32, 256))
        for _ in range(n)
    ]


@torch.inference_mode()
def bare_forward_tokens_per_s(model, block_size: int, repeats: int = 3) -> tuple[float, float]:
    """Tokens/s of one 512-token prefill through our model (LM head on every row, as a plain
    causal-LM forward computes it)."""
    n = 512
    attn = model.attention_layers[0]
    cache = torch.zeros(2, 1, block_size, attn.num_kv_heads, attn.head_dim)
    from pagectl.engine.attention import TorchPagedAttention

    backend = TorchPagedAttention(torch.device("cpu"))
    saved = [a.kv_cache for a in model.attention_layers]
    model.bind_kv_cache([cache] * len(model.attention_layers), backend)
    meta = dummy_prefill_metadata(n, block_size, 0, torch.device("cpu"))
    backend.prepare(meta)
    ids = torch.randint(0, model.config.vocab_size, (n,))
    pos = torch.arange(n)
    best = best_cpu = float("inf")
    for _ in range(repeats + 1):
        t, c = time.perf_counter(), time.process_time()
        model.compute_logits(model(ids, pos, meta))
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    for a, c in zip(model.attention_layers, saved, strict=True):
        a.kv_cache = c
    return n / best, n / best_cpu


@torch.inference_mode()
def hf_forward_tokens_per_s(repeats: int = 3) -> tuple[float, float]:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(CONFIG)
    cfg.pop("architectures")
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 512))
    best = best_cpu = float("inf")
    for _ in range(repeats + 1):
        t, c = time.perf_counter(), time.process_time()
        hf(ids)
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    return 512 / best, 512 / best_cpu


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--attention-backend", default="auto", help="auto, torch or cpu-kernel (default auto)"
    )
    ap.add_argument("--hf", action="store_true", help="also time transformers' bare forward")
    ap.add_argument("--profile", action="store_true", help="print a torch profiler table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    cfg, model = build_model(args.seed)
    core = build_core(cfg, model, args)
    # Warm-up: one short request (first-call allocations, thread pools).
    core.add_request("warm", list(range(1, 65)), SamplingParams(temperature=0.0, max_tokens=4))
    while core.has_unfinished():
        core.step()
    runner = core.executor
    runner.timings.reset()

    reqs = workload(args.requests, args.seed, cfg.vocab_size)
    for i, (prompt, out_len) in enumerate(reqs):
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=out_len)
        core.add_request(f"r{i}", prompt, sp)
    useful = sum(o for _, o in reqs)
    prompt_tokens = sum(len(p) for p, _ in reqs)

    prof = None
    if args.profile:
        from torch.profiler import profile

        prof = profile()
        prof.__enter__()
    steps = 0
    generated = 0
    step_time = 0.0
    # (scheduled tokens, sequences, CPU seconds) per step.
    step_log: list[tuple[int, int, float]] = []
    t0 = time.perf_counter()
    c0 = time.process_time()
    while core.has_unfinished():
        ts, cs = time.perf_counter(), time.process_time()
        for o in core.step():
            generated += len(o.new_token_ids)
        step_time += time.perf_counter() - ts
        stat = core.scheduler.step_stats[-1] if core.scheduler.step_stats else None
        if stat is not None:
            step_log.append((stat.num_scheduled_tokens, stat.num_seqs, time.process_time() - cs))
        steps += 1
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    if prof is not None:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    tm = runner.timings
    sched_s = step_time - tm.prepare_s - tm.forward_s - tm.sample_s
    print(
        f"requests {args.requests}, prompt tokens {prompt_tokens}, output tokens {generated} (useful {useful})"
    )
    print(
        f"threads {args.threads}, budget {args.budget}, block size {args.block_size}, "
        f"attention {runner.backend.name}"
    )
    print(
        f"wall {wall:.2f} s over {steps} steps ({tm.steps} with a forward); process CPU {cpu:.2f} s"
    )
    print(
        "per step: prepare {:.2f} ms | forward {:.2f} ms | sample {:.2f} ms | scheduler+core {:.2f} ms".format(
            *(
                1000 * x / max(tm.steps, 1)
                for x in (tm.prepare_s, tm.forward_s, tm.sample_s, sched_s)
            )
        )
    )
    print(
        f"share of wall: prepare {tm.prepare_s / wall:.1%}, forward {tm.forward_s / wall:.1%}, "
        f"sample {tm.sample_s / wall:.1%}, scheduler+core {sched_s / wall:.1%}"
    )
    decode = [s for s in step_log if s[0] == s[1]]
    mixed = [s for s in step_log if s[0] != s[1]]
    for name, group in (("steps with prefill", mixed), ("decode-only steps", decode)):
        if group:
            toks = sum(s[0] for s in group)
            secs = sum(s[2] for s in group)
            print(
                f"{name}: {len(group)}, {toks} tokens, {secs:.2f} CPU-s, "
                f"{1000 * secs / len(group):.1f} ms/step, {toks / secs:.0f} tokens/CPU-s"
            )
    tps = useful / wall
    model_tps = (useful + prompt_tokens) / wall
    model_cpu = (useful + prompt_tokens) / cpu
    print(f"useful output tokens/s: {tps:.1f}   model tokens/s (prompt + output): {model_tps:.1f}")
    # On a shared machine wall time includes waiting for the CPU; per CPU-second (meaningful
    # with --threads 1) is the steadier figure.
    print(f"per CPU-second: useful {useful / cpu:.1f}, model tokens {model_cpu:.1f}")
    # The forward-pass limit is compared with model tokens/s (prompts cost forwards too).
    limit, limit_cpu = bare_forward_tokens_per_s(model, args.block_size)
    print(
        f"bare forward, ours, 512 tokens: {limit:.1f} tok/s ({limit_cpu:.1f} per CPU-s) -> "
        f"pagectl model tokens at {model_tps / limit:.1%} ({model_cpu / limit_cpu:.1%} per CPU-s)"
    )
    if args.hf:
        hf, hf_cpu = hf_forward_tokens_per_s()
        print(
            f"bare forward, transformers, 512 tokens: {hf:.1f} tok/s ({hf_cpu:.1f} per CPU-s) -> "
            f"pagectl model tokens at {model_tps / hf:.1%} ({model_cpu / hf_cpu:.1%} per CPU-s)"
        )


if __name__ == "__main__":
    main()
