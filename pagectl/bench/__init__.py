"""Benchmark harness: workloads, peers (transformers), serving clients, tables and JSON.

Nothing here is imported by the engine or the daemon; ``pagectl bench`` and the scripts in
``benchmarks/`` use it.
"""
