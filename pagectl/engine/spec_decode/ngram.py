"""The n-gram proposer (prompt lookup): find the sequence's last n tokens earlier in the
sequence and propose the tokens that followed them there.

n runs from ``prompt_lookup_max`` down to ``prompt_lookup_min``; the first n with a match
wins, and of its matches the most recent one that is followed by k tokens (else the most
recent one). The search is ``bytes.rfind`` over the tokens
packed as uint32, so it runs in C; a hit at an offset that is not a token boundary is skipped.
"""

from __future__ import annotations

from array import array


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that may follow ``token_ids`` (empty when no n-gram matches)."""
        num = len(token_ids)
        if k <= 0 or num <= self.min_n:
            return []
        data = array("I", token_ids).tobytes()
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            pattern = data[-4 * n :]
            # The most recent match followed by k tokens, else by fewer (at least one).
            pos = _rfind_aligned(data, pattern, 4 * (num - k))
            if pos < 0:
                pos = _rfind_aligned(data, pattern, 4 * (num - 1))
            if pos >= 0:
                start = pos // 4 + n
                return token_ids[start : start + k]
        return []


def _rfind_aligned(data: bytes, pattern: bytes, end: int) -> int:
    """Byte offset of the last token-aligned ``pattern`` ending at or before ``end``."""
    pos = data.rfind(pattern, 0, end)
    while pos > 0 and pos % 4:
        pos = data.rfind(pattern, 0, pos + len(pattern) - 1)
    return pos
