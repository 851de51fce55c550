"""``SpeculativeConfig``: the ``speculative_config`` start-up option, checked once.

Keys as vLLM's: ``method`` ("ngram" or "draft_model"), ``num_speculative_tokens`` (K, the
most tokens proposed per sequence per step), ``prompt_lookup_max`` / ``prompt_lookup_min``
(n-gram lengths tried, longest first), ``model`` (the draft model of "draft_model") and
``disable_by_batch_size`` (no proposals in a step that runs at least this many sequences).

Unlike vLLM, where speculation is on at any batch size unless ``disable_by_batch_size`` is
given, pagectl turns it off from ``DEFAULT_DISABLE_BY_BATCH_SIZE`` running sequences when the
key is absent: on the 2-core CPU machine n-gram speculation measured break-even at 8 streams
and 0.52-0.86x at 16 (docs/PERFORMANCE.md section 11), because a verification multiplies the
decode rows of a step whose cost already grows with them. ``0`` keeps it on at any size.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

METHODS = ("ngram", "draft_model")
_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "disable_by_batch_size",
}
# Steps running at least this many sequences propose nothing unless the config says so.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# Upper bound of K: a verification feeds K + 1 tokens per sequence.
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    # "ngram" (prompt lookup) or "draft_model".
    method: str
    # K: most tokens proposed per sequence per step (the live setting may lower it to 0).
    num_speculative_tokens: int
    # n-gram lengths tried when looking the sequence's tail up in its own tokens.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # "draft_model" only: the draft model's directory or hub id.
    model: str | None = None
    # Steps that run at least this many sequences propose nothing (0: never off).
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a dict or its JSON text; None stays None. Raises ``ValueError``."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = set(value) - _KEYS
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(sorted(unknown))}; "
                f"known: {', '.join(sorted(_KEYS))}"
            )
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        cfg = cls(**value)
        cfg.check()
        return cfg

    def check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _int_in("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
        _int_in("prompt_lookup_max", self.prompt_lookup_max, self.prompt_lookup_min, 64)
        _int_in("disable_by_batch_size", self.disable_by_batch_size, 0, 1 << 20)
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs 'model'")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config: 'model' is only for method 'draft_model'")

    def to_dict(self) -> dict:
        return asdict(self)


def _int_in(name: str, v: object, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"speculative_config.{name} must be an integer in [{lo}, {hi}], got {v!r}")
