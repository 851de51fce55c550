"""Timing pagectl's offline ``LLM.generate`` on a benchmark workload (``run_pagectl``).

Shared by ``bench throughput`` and its ``--peer`` rounds (peer_rounds.py); it imports neither.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from pagectl.bench.results import EngineResult, count_useful
from pagectl.bench.workload import BenchRequest


def run_pagectl(
    llm: Any, workload: list[BenchRequest], temperature: float = 0.0, profile: bool = False
) -> EngineResult:
    """Time ``llm.generate`` on the whole workload, one ``SamplingParams`` per request.

    Token ids only (``detokenize=False``), as every peer is run: no engine's figure includes
    making text.

    With ``profile``, the run is also split into engine-step phases and profiled with
    cProfile (``extra["profile"]``); both add a little overhead to the figure.
    """
    from pagectl.engine.sampling_params import SamplingParams

    res = EngineResult("pagectl", "pagectl (LLM.generate)", len(workload))
    params = [
        SamplingParams(
            max_tokens=r.output_len,
            ignore_eos=True,
            temperature=temperature,
            seed=i,
            detokenize=False,
        )
        for i, r in enumerate(workload)
    ]
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in workload]
    # Warm-up, not timed: first-call costs (allocations, kernels) out of the figure.
    llm.generate(
        {"prompt_token_ids": [1, 2, 3, 4]},
        SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0),
    )
    counters = _engine_counters(llm)
    from pagectl.bench.profile import ModelTokenCounter, PhaseTimer, top_functions

    with contextlib.ExitStack() as stack:
        fed = stack.enter_context(ModelTokenCounter(llm))
        if profile:
            import cProfile

            phases = stack.enter_context(PhaseTimer(llm))
            prof = stack.enter_context(cProfile.Profile())
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        res.elapsed_s = time.perf_counter() - t0
    res.model_tokens = fed.tokens
    after = _engine_counters(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    res.useful_output_tokens, res.num_length_mismatches = count_useful(
        tokens, [r.output_len for r in workload]
    )
    res.extra = {k: after[k] - counters.get(k, 0) for k in after}
    if profile:
        res.extra["profile"] = {
            "phases_s": phases.breakdown(res.elapsed_s),
            "top_functions": top_functions(prof, 25),
        }
    return res


def _engine_counters(llm: Any) -> dict[str, int]:
    """Scheduler counters (steps, prompt tokens computed, preemptions), when reachable."""
    try:
        c = llm.core.counters
    except AttributeError:
        return {}
    return {
        "steps": c.steps,
        "prompt_tokens_computed": c.prompt_tokens,
        "generation_tokens": c.generation_tokens,
        "preemptions": c.preemptions,
    }
