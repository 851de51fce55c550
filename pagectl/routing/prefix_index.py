"""Which block hashes each target holds, kept from its KV-cache events (vLLM's
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``), never guessed.

Invariant: ``blocks[t]`` is the set of hashes target ``t`` last reported stored and not
removed since (or since its last ``AllBlocksCleared``, or since the index lost track of it:
a gap in the sequence numbers that replay could not fill clears it).
"""

from __future__ import annotations

from collections.abc import Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self.blocks: dict[str, set[bytes]] = {}

    def stored(self, target: str, block_hashes: Sequence[bytes]) -> None:
        self.blocks.setdefault(target, set()).update(block_hashes)

    def removed(self, target: str, block_hashes: Sequence[bytes]) -> None:
        s = self.blocks.get(target)
        if s is not None:
            s.difference_update(block_hashes)

    def cleared(self, target: str) -> None:
        self.blocks[target] = set()

    def forget(self, target: str) -> None:
        self.blocks.pop(target, None)

    def matched_blocks(self, target: str, request_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of the request ``target`` holds (chain hashes: the first
        miss ends the prefix)."""
        s = self.blocks.get(target)
        if not s:
            return 0
        n = 0
        for h in request_hashes:
            if h not in s:
                break
            n += 1
        return n
