"""Speculative decoding on the built-in model: n-gram and draft-model proposals against none.

    PYTHONPATH=$PWD python3 benchmarks/speculative.py                 # defaults below
    PYTHONPATH=$PWD python3 benchmarks/speculative.py --quick         # seconds, smaller

Workloads (greedy, ``ignore_eos``, ``--max-tokens`` new tokens per request):

- **code**: windows of ``--prompt-tokens`` tokens cut from Python standard-library sources
  (which repeat themselves: the case prompt lookup is for);
- **random**: uniformly random token ids (the case where proposals are rarely right).

For each, output tok/s with 1 stream (``--single`` requests one after another) and with 16
concurrent streams (16 requests in one ``generate``), for speculation off and n-gram at each
K, with the acceptance rate (accepted / proposed tokens) and the mean accepted length
(1 + accepted / verifications: tokens gained per verification). Every configuration is the
same engine with the live ``num_speculative_tokens`` changed, so weights and caches are
shared; prefix caching is off so runs do not feed each other. A last run repeats the
16-stream random case with ``disable_by_batch_size`` (speculation off in steps running at
least that many sequences), the engine's answer to high load.

The draft-model method (``--methods``) runs the same workloads and stream counts at each K
with a draft cut from the built-in model: its first ``--draft-layers`` decoder layers, its
embedding, norm and LM head, its tokenizer (``scripts/make_draft_model.py``; written to a
temporary directory unless ``--draft DIR`` names one). Its ratios are against the n-gram
engine's run without speculation (an engine without a draft model).

Every speculative run's output is checked token for token against the run without
speculation; a mismatch fails the benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagectl import LLM, SamplingParams  # noqa: E402

STDLIB_FILES = ("textwrap.py", "argparse.py", "dataclasses.py", "typing.py", "enum.py")


def code_prompts(tok, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` windows of ``length`` tokens from standard-library sources."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for name in STDLIB_FILES:
        ids += tok((lib / name).read_text()).input_ids
    rng = random.Random(seed)
    return [ids[s : s + length] for s in (rng.randrange(0, len(ids) - length) for _ in range(n))]


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def run(
    llm: LLM, prompts: list[list[int]], streams: int, k: int, max_tokens: int, repeats: int = 1
) -> dict:
    """The best of ``repeats`` timings (the machine is shared: the fastest run is the one
    least disturbed); acceptance figures from the first."""
    best = _run_once(llm, prompts, streams, k, max_tokens)
    for _ in range(repeats - 1):
        r = _run_once(llm, prompts, streams, k, max_tokens)
        if r["seconds"] < best["seconds"]:
            best = dict(
                r,
                acceptance_rate=best["acceptance_rate"],
                mean_accepted_length=best["mean_accepted_length"],
            )
    return best


def _run_once(llm: LLM, prompts: list[list[int]], streams: int, k: int, max_tokens: int) -> dict:
    sched = llm.core.scheduler
    sched.set("num_speculative_tokens", k)
    c = sched.counters
    before = (c.spec_decode_num_drafts, c.spec_decode_num_draft_tokens)
    acc0 = c.spec_decode_num_accepted_tokens
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    outs: list[list[int]] = []
    t0 = time.perf_counter()
    for i in range(0, len(prompts), streams):
        batch = [{"prompt_token_ids": p} for p in prompts[i : i + streams]]
        outs += [o.outputs[0].token_ids for o in llm.generate(batch, sp)]
    dt = time.perf_counter() - t0
    drafts = c.spec_decode_num_drafts - before[0]
    proposed = c.spec_decode_num_draft_tokens - before[1]
    accepted = c.spec_decode_num_accepted_tokens - acc0
    return {
        "k": k,
        "streams": streams,
        "output_tokens": sum(len(o) for o in outs),
        "seconds": round(dt, 3),
        "tok_s": round(sum(len(o) for o in outs) / dt, 1),
        "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
        "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else None,
        "outputs": outs,
    }


def _or_dash(value: object) -> object:
    """A figure, or "-" where none was measured (nothing proposed)."""
    return "-" if value is None else value


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--single", type=int, default=4, help="requests run one by one")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--ks", default="2,4,8")
    ap.add_argument("--disable-by-batch-size", type=int, default=8)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="best of this many timings")
    ap.add_argument("--workloads", default="code,random")
    ap.add_argument("--methods", default="ngram,draft_model")
    ap.add_argument("--draft", default=None, help="draft model directory (default: built)")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    if a.quick:
        a.prompt_tokens, a.max_tokens, a.single, a.streams, a.repeats = 64, 32, 1, 4, 1
    ks = [int(k) for k in a.ks.split(",")]
    common = dict(
        dtype="float32",
        enable_prefix_caching=False,
        max_num_seqs=max(a.streams, 16),
        num_threads=a.num_threads,
    )
    # Speculation at every batch size: the method's own cost (the engine's default turns it
    # off from 8 running sequences; the last rows measure that).
    spec = {"method": "ngram", "num_speculative_tokens": max(ks), "disable_by_batch_size": 0}
    llm = LLM(speculative_config=spec, **common)
    tok = llm.get_tokenizer()
    vocab = llm.engine.vocab_size
    n = max(a.single, a.streams)
    workloads = {
        "code": code_prompts(tok, n, a.prompt_tokens, 0),
        "random": random_prompts(vocab, n, a.prompt_tokens, 0),
    }
    report: dict = {"load": os.getloadavg(), "args": vars(a), "runs": []}
    ok = True
    print(f"load average at start: {os.getloadavg()}", flush=True)
    print(
        f"{'workload':8} {'streams':>7} {'K':>3} {'tok/s':>8} {'x none':>7} "
        f"{'accept':>7} {'mean len':>8}"
    )
    methods = a.methods.split(",")
    bases: dict[tuple[str, int], dict] = {}
    for name, prompts in workloads.items():
        if name not in a.workloads.split(","):
            continue
        for streams, count in ((1, a.single), (a.streams, a.streams)):
            base = None
            for k in [0, *ks] if "ngram" in methods else [0]:
                r = run(llm, prompts[:count], streams, k, a.max_tokens, a.repeats)
                if base is None:
                    base = bases[name, streams] = r
                elif r["outputs"] != base["outputs"]:
                    ok = False
                    print(f"MISMATCH: {name} streams={streams} K={k} differs from K=0")
                ratio = r["tok_s"] / base["tok_s"]
                print(
                    f"{name:8} {streams:7} {k:3} {r['tok_s']:8.1f} {ratio:7.2f} "
                    f"{_or_dash(r['acceptance_rate']):>7} {_or_dash(r['mean_accepted_length']):>8}",
                    flush=True,
                )
                report["runs"].append(
                    dict(
                        {k2: v for k2, v in r.items() if k2 != "outputs"},
                        workload=name,
                        method="ngram" if k else "none",
                        ratio=round(ratio, 3),
                    )
                )
    llm.shutdown()
    if "draft_model" in methods:
        ok = _draft_model_runs(a, ks, common, workloads, bases, report) and ok
    if "ngram" in methods:
        ok = _disable_by_batch_size_runs(a, ks, common, spec, workloads, report) and ok
    print(f"load average at end: {os.getloadavg()}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    print("outputs identical to no speculation:", ok)
    return 0 if ok else 1


def _draft_model_runs(a, ks, common, workloads, bases, report) -> bool:
    """Each workload and stream count at each K with the draft model, against ``bases``
    (the same prompts on an engine without a draft)."""
    from pagectl.engine.builder import resolve_model
    from pagectl.testing.truncated_draft import write_truncated_draft

    ok = True
    with tempfile.TemporaryDirectory(prefix="pagectl-draft-") as tmp:
        draft = a.draft or str(write_truncated_draft(resolve_model(None), tmp, a.draft_layers))
        spec = {
            "method": "draft_model",
            "model": draft,
            "num_speculative_tokens": max(ks),
            "disable_by_batch_size": 0,
        }
        llm = LLM(speculative_config=spec, **common)
        print(f"draft model: {draft} ({a.draft_layers} layers unless --draft)", flush=True)
        for (name, streams), base in bases.items():
            count = a.single if streams == 1 else a.streams
            prompts = workloads[name][:count]
            for k in ks:
                r = run(llm, prompts, streams, k, a.max_tokens, a.repeats)
                if r["outputs"] != base["outputs"]:
                    ok = False
                    print(f"MISMATCH: draft {name} streams={streams} K={k} differs from none")
                ratio = r["tok_s"] / base["tok_s"]
                print(
                    f"{name:8} {streams:7} {k:3} {r['tok_s']:8.1f} {ratio:7.2f} "
                    f"{_or_dash(r['acceptance_rate']):>7} "
                    f"{_or_dash(r['mean_accepted_length']):>8}   (draft model)",
                    flush=True,
                )
                report["runs"].append(
                    dict(
                        {k2: v for k2, v in r.items() if k2 != "outputs"},
                        workload=name,
                        method="draft_model",
                        ratio=round(ratio, 3),
                    )
                )
        llm.shutdown()
    return ok


def _disable_by_batch_size_runs(a, ks, common, spec, workloads, report) -> bool:
    ok = True
    # High load: the same 16-stream random run with speculation off in big steps.
    spec_dbs = dict(spec, disable_by_batch_size=a.disable_by_batch_size)
    llm = LLM(speculative_config=spec_dbs, **common)
    prompts = workloads["random"][: a.streams]
    base = run(llm, prompts, a.streams, 0, a.max_tokens, a.repeats)
    for k in ks:
        r = run(llm, prompts, a.streams, k, a.max_tokens, a.repeats)
        ok = ok and r["outputs"] == base["outputs"]
        ratio = r["tok_s"] / base["tok_s"]
        print(
            f"random   {a.streams:7} {k:3} {r['tok_s']:8.1f} {ratio:7.2f}   "
            f"(disable_by_batch_size={a.disable_by_batch_size})",
            flush=True,
        )
        report["runs"].append(
            dict(
                {k2: v for k2, v in r.items() if k2 != "outputs"},
                workload="random",
                disable_by_batch_size=a.disable_by_batch_size,
                ratio=round(ratio, 3),
            )
        )
    llm.shutdown()
    return ok


if __name__ == "__main__":
    sys.exit(main())
