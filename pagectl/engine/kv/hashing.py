"""Chained block hashing for the prefix cache.

hash(block i) = sha256(hash(block i-1) || token ids of block i || extra keys of block i).

The chain makes a block's hash depend on every token before it, so equal hashes mean equal
prefixes. Extra keys (the per-request ``cache_salt``) enter the first block only; through the
chain they reach every later block, so requests with different salts never share a block.
sha256 is used deliberately: a predictable hash lets one tenant poison another's cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

# Parent of the first block of every request.
ROOT_HASH = b"\x00" * 32


def hash_block_tokens(
    parent_hash: bytes, token_ids: Sequence[int], extra_keys: bytes | None = None
) -> bytes:
    """sha256 over the parent hash, the block's token ids (uint32 LE) and extra keys."""
    h = hashlib.sha256(parent_hash)
    h.update(array("I", token_ids).tobytes())
    if extra_keys:
        h.update(b"\x01salt")
        h.update(extra_keys)
    return h.digest()


def salt_bytes(cache_salt: str | None) -> bytes | None:
    return cache_salt.encode("utf-8") if cache_salt else None


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    hashes: list[bytes],
    cache_salt: str | None = None,
    upto_blocks: int | None = None,
) -> list[bytes]:
    """Extend ``hashes`` (the request's chain so far) to cover its full blocks.

    Only whole blocks are hashed; ``upto_blocks`` caps how many blocks the chain reaches.
    Returns ``hashes`` (extended in place).
    """
    n_full = len(token_ids) // block_size
    if upto_blocks is not None:
        n_full = min(n_full, upto_blocks)
    salt = salt_bytes(cache_salt)
    for i in range(len(hashes), n_full):
        parent = hashes[i - 1] if i else ROOT_HASH
        start = i * block_size
        hashes.append(
            hash_block_tokens(
                parent, token_ids[start : start + block_size], salt if i == 0 else None
            )
        )
    return hashes
