"""pagectl: a paged-KV-cache LLM serving daemon with a live KV-cache operator console."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# OpenMP threads that spin while idle steal the CPU from the engine's own Python thread and
# from other processes (docs/MODEL_EXECUTION.md, "Threads on a shared machine"). Must be set
# before torch is imported; an explicit setting in the environment wins.
# On a machine whose cores the engine has to itself, a short spin before sleeping is faster:
# `GOMP_SPINCOUNT=10000` (libgomp's count of polls, about half a millisecond here) keeps the
# threads awake between the parallel regions of one step (docs/PERFORMANCE.md, section 12).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = ["LLM", "BeamSearchParams", "SamplingParams", "StructuredOutputsParams", "__version__"]

if TYPE_CHECKING:
    from pagectl.engine.beam_search import BeamSearchParams
    from pagectl.engine.llm import LLM
    from pagectl.engine.sampling_params import SamplingParams
    from pagectl.engine.structured_outputs import StructuredOutputsParams


def __getattr__(name: str):
    # Lazy: importing pagectl (e.g. for the CLI or the console) must not import torch.
    if name == "LLM":
        from pagectl.engine.llm import LLM

        return LLM
    if name == "StructuredOutputsParams":
        from pagectl.engine.structured_outputs import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "BeamSearchParams":
        from pagectl.engine.beam_search import BeamSearchParams

        return BeamSearchParams
    if name == "SamplingParams":
        from pagectl.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
