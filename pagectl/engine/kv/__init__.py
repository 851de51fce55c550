"""Paged KV cache bookkeeping: block pool, chained hashing, cache manager."""
