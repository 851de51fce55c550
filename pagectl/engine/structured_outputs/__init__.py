"""Structured outputs (constrained decoding) with xgrammar.

``params.py``: what a request asks for (``StructuredOutputsParams``) and the grammar it
means. ``manager.py``: compiling grammars off the engine step, the compiled-grammar cache, and
each sequence's matcher (``GrammarState``). The sampler applies a row's token bitmask to its
logits (``runner/sampler.py``); the scheduler feeds each sampled token to the matcher.
"""

from pagectl.engine.structured_outputs.params import (
    StructuredOutputsError,
    StructuredOutputsParams,
)

__all__ = ["StructuredOutputsError", "StructuredOutputsParams"]
