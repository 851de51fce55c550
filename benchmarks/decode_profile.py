"""Where one single-stream decode step's time goes, on a benchmark model.

One request (random prompt of ``--prompt-len`` token ids, greedy, ``ignore_eos``) runs
through a real ``LLM`` engine (loader, oneDNN packing, attention backend, scheduler, sampler:
everything a served request gets). After the prefill and ``--warmup`` decode steps, it times
``--steps`` decode steps three ways:

1. **plain**: ``EngineCore.step`` wall time, split by the runner's own timers into batch
   preparation, forward (with the LM head), sampling, and what is left (scheduler, engine core,
   Python around the forward). The tok/s printed is 1 / the median step. Where the model's
   layers run chained in one C++ op (``models/layer_chain.py``, what a served request gets),
   the same steps also run through the layer modules, in alternating rounds
   (``--rounds``), and the median of the per-round ratios is printed.
2. **by part** (a second pass, through the layer modules: timers on every part add a few
   microseconds per call, so its total is a little above the plain modules' one): per
   layer, the q/k/v, o, gate/up and down
   projections, the attention backend (KV write + decode kernel), the q/k norm + rotary
   (what the attention module does between its projections), RMSNorms and residual adds,
   SiLU-and-mul, the embedding, rotary cos/sin, the final norm and the LM head.
3. **launch overhead**: how many torch ops a step dispatches (torch.profiler) times the
   measured cost of dispatching one trivial op on a tiny tensor.

``--profile`` prints torch.profiler's table (by self CPU time) for the timed steps.

    python benchmarks/decode_profile.py --synthetic-model qwen3-33m --threads 2
    python benchmarks/decode_profile.py --synthetic-model qwen3-0.6b --threads 2 --steps 16
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: waiting threads sleep (the engine's own default on a shared box).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from pagectl.bench.synthetic import ensure_synthetic_model  # noqa: E402
from pagectl.engine.llm import LLM  # noqa: E402
from pagectl.engine.sampling_params import SamplingParams  # noqa: E402


class PartTimer:
    """Exclusive wall time per named part: a part's time excludes the parts timed inside
    it (a stack of open parts), so the parts add up to the step."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # [name, start, child time]
        self.enabled = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            if not self.enabled:
                return fn(*args, **kw)
            frame = [name, time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kw)
            finally:
                self._stack.pop()
                dt = time.perf_counter() - frame[1]
                self.totals[name] += dt - frame[2]
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][2] += dt

        return timed


def instrument(llm: LLM, timer: PartTimer) -> None:
    """Timers on every part of the forward, the logits and the sampler (instance attributes
    shadow the methods; nothing in the engine changes)."""
    runner = llm.core.executor
    model = runner.model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for name, mod in (
            ("qkv_proj", attn.qkv_proj),
            ("o_proj", attn.o_proj),
            ("gate_up_proj", mlp.gate_up_proj),
            ("down_proj", mlp.down_proj),
            ("silu_and_mul", mlp.act_fn),
            ("rms_norm + residual add", layer.input_layernorm),
            ("rms_norm + residual add", layer.post_attention_layernorm),
        ):
            mod.forward = timer.wrap(name, mod.forward)  # type: ignore[method-assign]
        attn.forward = timer.wrap(  # type: ignore[method-assign]
            "q/k norm + rotary + views (attention module's own ops)", attn.forward
        )
        layer.forward = timer.wrap("decoder layer's own ops", layer.forward)  # type: ignore[method-assign]
    backend = runner.backend
    backend.write_kv = timer.wrap("attention: KV write", backend.write_kv)  # type: ignore[method-assign]
    backend.attend = timer.wrap("attention: decode kernel", backend.attend)  # type: ignore[method-assign]
    backend.forward = timer.wrap("attention: backend's own ops", backend.forward)  # type: ignore[method-assign]
    backend.prepare = timer.wrap("batch preparation (backend)", backend.prepare)  # type: ignore[method-assign]
    emb = model.model.embed_tokens
    emb.forward = timer.wrap("embedding", emb.forward)  # type: ignore[method-assign]
    rot = model.rotary_emb
    rot.cos_sin = timer.wrap("rotary cos/sin", rot.cos_sin)  # type: ignore[method-assign]
    norm = model.model.norm
    norm.forward = timer.wrap("final norm", norm.forward)  # type: ignore[method-assign]
    model.compute_logits = timer.wrap("LM head (logits)", model.compute_logits)  # type: ignore[method-assign]
    model.forward = timer.wrap("model forward's own ops", model.forward)  # type: ignore[method-assign]
    bb = runner.batch_builder
    bb.plan = timer.wrap("batch preparation (plan)", bb.plan)  # type: ignore[method-assign]
    bb.from_arrays = timer.wrap("batch preparation (tensors)", bb.from_arrays)  # type: ignore[method-assign]
    sampler = runner.sampler
    runner._sample = timer.wrap("sampler", runner._sample)  # type: ignore[method-assign]
    assert sampler is not None
    runner.execute_model = timer.wrap("runner's own ops", runner.execute_model)  # type: ignore[method-assign]
    core = llm.core
    core.step = timer.wrap("scheduler + engine core (rest of the step)", core.step)  # type: ignore[method-assign]


def dispatch_cost_us(repeats: int = 2000) -> float:
    """Median microseconds of one ``torch.add`` on two 512-float tensors (a trivial op: its
    time is dispatch, not arithmetic)."""
    a, b = torch.randn(1, 512), torch.randn(1, 512)
    for _ in range(200):
        torch.add(a, b)
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(repeats):
            torch.add(a, b)
        runs.append((time.perf_counter() - t) / repeats * 1e6)
    return statistics.median(runs)


def run_steps(llm: LLM, n: int) -> list[float]:
    core = llm.core
    times = []
    for _ in range(n):
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--synthetic-model", default="qwen3-33m")
    ap.add_argument("--model", help="a model directory instead of a synthetic model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="chain / modules rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="print torch.profiler's table")
    ap.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = ap.parse_args()

    model = args.model or str(ensure_synthetic_model(args.synthetic_model))
    total = args.prompt_len + args.warmup + (3 + 2 * args.rounds) * args.steps + 8
    llm = LLM(
        model,
        dtype=args.dtype,
        quantization=args.quantization,
        num_threads=args.threads,
        num_kv_blocks=-(-total // 16) + 8,
        max_model_len=total + 16,
        enable_prefix_caching=False,
    )
    core = llm.core
    vocab = llm.core.executor.model.config.vocab_size
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_len)]
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=total - args.prompt_len)
    core.add_request("single", prompt, sp)
    # Prefill (one step at this prompt length) and warm-up decode steps.
    while core.executor.timings.steps < 1 + args.warmup:
        core.step()

    runner = core.executor
    runner.timings.reset()
    plain = run_steps(llm, args.steps)
    tm = runner.timings
    n = tm.steps
    step_ms = 1000 * statistics.median(plain)
    mean_ms = 1000 * sum(plain) / n
    prep_ms, fwd_ms, smp_ms = (1000 * x / n for x in (tm.prepare_s, tm.forward_s, tm.sample_s))
    rest_ms = mean_ms - prep_ms - fwd_ms - smp_ms

    net = runner.model
    chain = net.layer_chain
    rounds: list[tuple[float, float]] = []
    if chain is not None:
        for _ in range(args.rounds):
            chained = statistics.median(run_steps(llm, args.steps))
            net.layer_chain = None
            modules = statistics.median(run_steps(llm, args.steps))
            net.layer_chain = chain
            rounds.append((1000 * chained, 1000 * modules))
    net.layer_chain = None  # the timers and the op count below are the modules''

    timer = PartTimer()
    instrument(llm, timer)
    timer.enabled = True
    parted = run_steps(llm, args.steps)
    timer.enabled = False

    prof_ops = 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run_steps(llm, 4)
    # Top-level ops only (an op's own callees are not separate dispatches from Python).
    events = [e for e in prof.events() if e.cpu_parent is None and not e.name.startswith("[")]
    prof_ops = len(events) // 4
    disp_us = dispatch_cost_us()
    if args.profile:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof2:
            run_steps(llm, args.steps)
        print(
            prof2.key_averages(group_by_input_shape=True).table(
                sort_by="self_cpu_time_total", row_limit=30
            )
        )

    cfg = runner.model.config
    print(
        f"model {args.model or args.synthetic_model}: {cfg.num_hidden_layers} layers, hidden "
        f"{cfg.hidden_size}, vocab {cfg.vocab_size}; dtype {args.dtype}, quantization "
        f"{args.quantization}; threads {args.threads}; attention {runner.backend.name}; "
        f"context {args.prompt_len + args.warmup}..{args.prompt_len + args.warmup + (2 + 2 * args.rounds) * args.steps}"
    )
    print(
        f"plain: {n} decode steps, median {step_ms:.2f} ms ({1000 / step_ms:.1f} tok/s), mean "
        f"{mean_ms:.2f} ms: prepare {prep_ms:.2f} | forward + LM head {fwd_ms:.2f} | sample "
        f"{smp_ms:.2f} | scheduler, core, Python {rest_ms:.2f}"
    )
    if rounds:
        ratio = statistics.median(m / c for c, m in rounds)
        print(
            "layers chained in one op against the layer modules, median step per round: "
            + ", ".join(f"{c:.2f} vs {m:.2f} ms" for c, m in rounds)
            + f"; median ratio {ratio:.2f}x"
        )
    else:
        print("layers chained in one op: not for this model (the modules' forward throughout)")
    parted_ms = 1000 * sum(parted) / len(parted)
    print(f"by part: {len(parted)} steps, mean {parted_ms:.2f} ms (timers included)")
    rows = sorted(timer.totals.items(), key=lambda kv: -kv[1])
    per_step = {k: 1000 * v / len(parted) for k, v in rows}
    width = max(len(k) for k in per_step)
    for k, v in per_step.items():
        calls = timer.calls[k] / len(parted)
        print(f"  {k:<{width}}  {v:7.3f} ms  {v / parted_ms:6.1%}  {calls:5.0f} calls/step")
    layers = cfg.num_hidden_layers
    layer_parts = [
        k
        for k in per_step
        if k.endswith("_proj")
        or k.startswith(("attention", "q/k", "rms_norm", "silu", "decoder layer"))
    ]
    per_layer = sum(per_step[k] for k in layer_parts) / layers
    print(f"  per layer (all its parts): {per_layer:.3f} ms x {layers} layers")
    print(
        f"launch overhead: {prof_ops} top-level torch ops per step x {disp_us:.2f} us per "
        f"trivial op = {prof_ops * disp_us / 1000:.2f} ms ({prof_ops * disp_us / 1000 / step_ms:.0%} "
        "of the median plain step)"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "median_step_ms": step_ms,
                    "tok_s": 1000 / step_ms,
                    "prepare_ms": prep_ms,
                    "forward_ms": fwd_ms,
                    "sample_ms": smp_ms,
                    "rest_ms": rest_ms,
                    "parts_ms": per_step,
                    "ops_per_step": prof_ops,
                    "dispatch_us": disp_us,
                    "chain_vs_modules_ms": rounds,
                }
            )
        )
    llm.shutdown()


if __name__ == "__main__":
    main()
