"""The result of running one engine (pagectl or a peer) on a workload."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class EngineResult:
    """Useful output tokens and wall time of one engine on one workload."""

    # Short key ("pagectl", "hf-cb", "hf-static", "forward") and a label for the table.
    name: str
    label: str
    # Requests run and output tokens that count: each request's own output length at most
    # (padding and tokens past a request's length are not useful).
    num_requests: int = 0
    useful_output_tokens: int = 0
    # Wall time of the timed part, in seconds (model loading and warm-up excluded).
    elapsed_s: float = 0.0
    # Tokens the engine computed but that count for nothing (static batches: padding rows).
    wasted_tokens: int = 0
    # Token positions the model's forward passes processed (prompts, decode inputs, padding).
    model_tokens: int = 0
    # Requests whose output length differed from the workload's (should be 0 with ignore_eos).
    num_length_mismatches: int = 0
    # For the forward-pass limit, tokens/s is measured directly and stored here.
    tokens_per_s_override: float | None = None
    # Set when the engine could not run; the row is shown as skipped.
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float | None:
        return self._per_second(self.useful_output_tokens)

    @property
    def model_tokens_per_s(self) -> float | None:
        """Positions through the model per second (the forward limit's own unit)."""
        return self._per_second(self.model_tokens or None)  # 0: not counted by this engine

    def _per_second(self, tokens: int | None) -> float | None:
        # The forward limit's measured rate stands for both units.
        if self.error is not None:
            return None
        if self.tokens_per_s_override is not None:
            return self.tokens_per_s_override
        if tokens is None or self.elapsed_s <= 0:
            return None
        return tokens / self.elapsed_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("tokens_per_s_override")
        d["tokens_per_s"] = self.tokens_per_s
        d["model_tokens_per_s"] = self.model_tokens_per_s
        return d


def count_useful(outputs: list[list[int]], expected_lens: list[int]) -> tuple[int, int]:
    """(useful tokens, length mismatches) of per-request generated token lists.

    A request counts at most its expected length; one that produced a different number of
    tokens is a mismatch (a sign that EOS was not ignored or a length was not honoured).
    """
    if len(outputs) != len(expected_lens):
        raise ValueError(f"{len(outputs)} outputs for {len(expected_lens)} requests")
    useful = 0
    mismatches = 0
    for toks, n in zip(outputs, expected_lens, strict=True):
        useful += min(len(toks), n)
        mismatches += len(toks) != n
    return useful, mismatches
