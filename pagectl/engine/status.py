"""The ``status`` command's map, rendered from a telemetry snapshot.

There is one picture of the engine, ``TelemetrySnapshot`` (telemetry.py); ``pagectl ctl
status`` and the ``status`` command show a summary of it under the keys listed in
docs/ADMIN_PROTOCOL.md ("Status map"), never values gathered a second way.
"""

from __future__ import annotations

from typing import Any

from pagectl.engine.telemetry import TelemetrySnapshot

# Steps the status map lists (the snapshot carries more).
STATUS_STEPS = 8
# Counters the status map shows.
_COUNTERS = (
    "prefix_queries",
    "prefix_hits",
    "preemptions",
    "preemptions_by_reason",
    "prompt_tokens",
    "generation_tokens",
    "steps",
    "finished_by_reason",
    "rejected",
    "evictions",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def status_view(snap: TelemetrySnapshot) -> dict[str, Any]:
    """The status map of ``snap`` (JSON-ready: plain dicts, lists and scalars)."""
    blocks = snap.blocks
    total_slots = blocks.num_blocks * blocks.block_size
    c = snap.counters
    return {
        "engine_state": snap.engine_state,
        "model": snap.model.model,
        "dtype": snap.model.dtype,
        "device": snap.model.device,
        "tp_size": snap.model.tp_size,
        "kv_bytes_per_rank": snap.model.kv_bytes_per_rank,
        "attention_backend": snap.model.attention_backend,
        "kv_cache_dtype": snap.model.kv_cache_dtype,
        "cuda_graph_max_batch": snap.model.cuda_graph_max_batch,
        "memory_profile": dict(snap.model.memory_profile),
        "uptime_s": round(snap.time - snap.start_time, 3),
        "config": dict(snap.config),
        "kv": {
            "num_blocks": blocks.num_blocks,
            "block_size": blocks.block_size,
            "num_used_blocks": snap.num_used_blocks,
            "num_free_blocks": snap.num_free_blocks,
            "num_cached_free_blocks": snap.num_cached_free_blocks,
            "usage_perc": snap.num_used_blocks / blocks.num_blocks,
            "token_usage_perc": snap.num_used_token_slots / total_slots,
        },
        "counters": {
            name: dict(v) if isinstance(v := getattr(c, name), dict) else v for name in _COUNTERS
        },
        "num_running": snap.num_running,
        "num_waiting": snap.num_waiting,
        "requests": [
            {
                "request_id": r.request_id,
                "index": r.index,
                "seq_id": r.seq_id,
                "beam_width": r.beam_width,
                "state": r.state,
                "priority": r.priority,
                "num_prompt_tokens": r.num_prompt_tokens,
                "num_output_tokens": r.num_output_tokens,
                "num_computed_tokens": r.num_computed_tokens,
                "num_cached_tokens": r.num_cached_tokens,
                "admitted": r.admitted,
                "num_blocks": r.num_blocks,
                "num_preemptions": r.num_preemptions,
            }
            for r in snap.requests
        ],
        "last_steps": [
            {
                "step_id": s.step_id,
                "num_scheduled_tokens": s.num_scheduled_tokens,
                "token_budget": s.token_budget,
            }
            for s in snap.steps[-STATUS_STEPS:]
        ],
    }
