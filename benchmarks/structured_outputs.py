"""Structured outputs: what a JSON-schema constraint costs the engine.

Cases (one engine, the built-in model unless --model):
- throughput: a batch of --num-requests greedy requests of --max-tokens, unconstrained, then
  the same batch with every other request constrained by a JSON schema; generated tokens per
  second of wall time for both, and their ratio.
- compile: seconds from submit until the grammar is ready, for a schema never seen (first)
  and the same schema again (cached), on the manager's compile thread.
- mask: the sampler's structured-outputs step alone (fill each constrained row's bitmask,
  apply it to the logits) for 1, 8 and 32 constrained rows, microseconds per step.

Usage:
    python benchmarks/structured_outputs.py [--model DIR] [--num-requests 16] [--max-tokens 64] [--json]
With --json the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagectl.engine.args import EngineArgs
from pagectl.engine.builder import build_engine
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.structured_outputs import StructuredOutputsParams
from pagectl.engine.structured_outputs.bitmask import apply_grammar_bitmask
from pagectl.engine.structured_outputs.manager import StructuredOutputManager

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 6},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "count", "tags", "ok"],
}


def _run_batch(core, prompts, max_tokens: int, constrain_every: int | None, tag: str) -> dict:
    for i, p in enumerate(prompts):
        so = None
        if constrain_every and i % constrain_every == 0:
            so = StructuredOutputsParams(json=SCHEMA)
        core.add_request(
            f"{tag}{i}",
            p,
            SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=so),
        )
    tokens = 0
    t0 = time.perf_counter()
    while core.has_unfinished():
        for o in core.step():
            tokens += len(o.new_token_ids)
    wall = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def _compile_times(tokenizer, vocab_size: int, eos) -> dict:
    mgr = StructuredOutputManager(tokenizer, vocab_size, eos, disable_any_whitespace=True)
    out = {}
    for name in ("first", "cached"):
        t0 = time.perf_counter()
        state = mgr.submit(StructuredOutputsParams(json=SCHEMA))
        state.future.result()
        out[f"{name}_s"] = time.perf_counter() - t0
    mgr.shutdown()
    return out


def _mask_cost(tokenizer, vocab_size: int, eos, reps: int) -> dict:
    mgr = StructuredOutputManager(tokenizer, vocab_size, eos, disable_any_whitespace=True)
    out = {}
    for rows in (1, 8, 32):

        class _Seq:
            pass

        seqs = []
        for _ in range(rows):
            s = _Seq()
            s.grammar = mgr.submit(StructuredOutputsParams(json=SCHEMA))
            s.grammar.future.result()
            s.grammar.activate()
            seqs.append(s)
        logits = torch.randn(rows, vocab_size)
        idx = list(range(rows))
        times = []
        for _ in range(reps):
            x = logits.clone()
            t0 = time.perf_counter()
            apply_grammar_bitmask(x, seqs, idx, vocab_size)
            times.append(time.perf_counter() - t0)
        out[f"rows_{rows}_us"] = statistics.median(times) * 1e6
    mgr.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mask-reps", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    built = build_engine(
        EngineArgs(
            model=a.model,
            num_kv_blocks=1024,
            structured_outputs_config={"disable_any_whitespace": True},
        )
    )
    core, tok = built.core, built.tokenizer
    texts = ["def add(a, b):", "import os\n", "class Stack:", "for i in range(10):"]
    prompts = [tok.encode(texts[i % len(texts)] + f" # {i}") for i in range(a.num_requests)]
    _run_batch(core, prompts[:2], 4, 2, "warm")  # warm-up (and the first compile)
    plain = _run_batch(core, prompts, a.max_tokens, None, "u")
    half = _run_batch(core, prompts, a.max_tokens, 2, "c")
    result = {
        "model": built.model_name,
        "vocab_size": built.vocab_size,
        "num_requests": a.num_requests,
        "max_tokens": a.max_tokens,
        "unconstrained": plain,
        "half_constrained": half,
        "throughput_ratio": half["tokens_per_s"] / plain["tokens_per_s"],
        "compile": _compile_times(tok, built.vocab_size, built.eos_token_ids),
        "mask": _mask_cost(tok, built.vocab_size, built.eos_token_ids, a.mask_reps),
    }
    built.shutdown()
    print(f"model {result['model']} (vocab {result['vocab_size']})")
    print(
        f"throughput: unconstrained {plain['tokens_per_s']:.1f} tok/s "
        f"({plain['tokens']} tokens), half constrained {half['tokens_per_s']:.1f} tok/s "
        f"({half['tokens']} tokens), ratio {result['throughput_ratio']:.2f}"
    )
    c = result["compile"]
    print(f"compile: first {c['first_s'] * 1e3:.1f} ms, cached {c['cached_s'] * 1e3:.3f} ms")
    m = result["mask"]
    print("mask step: " + ", ".join(f"{k.split('_')[1]} rows {v:.0f} us" for k, v in m.items()))
    if a.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
