"""The telemetry snapshot: a cheap, read-only picture of the whole engine core.

Boundary type: built by ``EngineCore.snapshot()``, published by the daemon as one msgpack
frame, read by ``pagectl top``. Per-block data travels as packed byte arrays (one byte per
block), never as a dict per block, so a 1,000,000-block pool is a few megabytes.

Version 1. A reader must check ``version`` and refuse a newer major version.
"""

from __future__ import annotations

import msgspec

TELEMETRY_VERSION = 1


class BlockMap(msgspec.Struct):
    """Per-block state of the KV pool. Arrays are indexed by block id."""

    # Blocks in the pool and token slots per block.
    num_blocks: int
    block_size: int
    # uint8 per block: number of block tables holding it, clipped to 255. 0 = free.
    ref_counts: bytes
    # uint8 per block: 1 if the block is registered in the prefix cache (full, reusable).
    hashed: bytes


class RequestRow(msgspec.Struct, gc=False):
    """One sequence known to the scheduler (waiting or running)."""

    request_id: str
    # Index among the request's n samples.
    index: int
    # "waiting", "running" or "preempted" (waiting again after losing its blocks).
    state: str
    priority: int
    num_prompt_tokens: int
    num_output_tokens: int
    # Tokens whose K/V are in the sequence's blocks.
    num_computed_tokens: int
    # Prompt tokens served by the prefix cache at first admission (0 until ``admitted``).
    num_cached_tokens: int
    # Blocks in the sequence's block table, and how many of them others hold too.
    num_blocks: int
    num_shared_blocks: int
    num_preemptions: int
    # Seconds since arrival.
    age_s: float
    # The block table, uint32 little-endian block ids in token order.
    block_ids: bytes
    # Whether the scheduler has admitted the sequence once (its prefix was looked up).
    admitted: bool = True
    # The engine's name for the sequence: ``request_id`` for sample 0, "id#i" for sample i,
    # "id#b<k>" for a beam forked during a beam search ("" from an older daemon: readers
    # fall back to request_id and index).
    seq_id: str = ""
    # A beam of a beam search: the search's width W (0: not a beam), and the beam's
    # cumulative logprob so far. A search's beams share ``request_id`` (the group's id).
    beam_width: int = 0
    cum_logprob: float = 0.0


class Counters(msgspec.Struct):
    """Totals since start."""

    # Prefix cache, in tokens: tokens looked up at first admission, and tokens served from
    # the cache. Re-prefill after a preemption is in neither.
    prefix_queries: int = 0
    prefix_hits: int = 0
    # Preemptions, total and by reason.
    preemptions: int = 0
    preemptions_by_reason: dict[str, int] = {}
    # Tokens recomputed because of preemption.
    recomputed_tokens: int = 0
    # Prompt tokens computed (cache hits excluded) and tokens generated.
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Engine steps that ran a forward, and token positions they fed to the model.
    steps: int = 0
    scheduled_tokens: int = 0
    # Finished sequences by finish reason; requests refused at submission.
    finished_by_reason: dict[str, int] = {}
    rejected: int = 0
    # Cached blocks handed out again (prefix cache evictions).
    evictions: int = 0
    # Structured outputs: grammars compiled (and their total seconds), and constrained
    # requests served by the compiled-grammar cache.
    grammar_compiles: int = 0
    grammar_compile_seconds: float = 0.0
    grammar_cache_hits: int = 0
    # Speculative decoding (vLLM's names): verifications run (one per sequence per step with
    # proposals), tokens proposed, proposals accepted, and accepted proposals by position
    # (index j: the (j+1)-th proposal of a run was accepted).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


class StepStat(msgspec.Struct, array_like=True):
    """One engine step."""

    step_id: int
    # time.time() when the step finished, and its duration in seconds.
    time: float
    duration_s: float
    # Tokens scheduled and the budget in force.
    num_scheduled_tokens: int
    token_budget: int
    # Sequences in the batch; prompt tokens computed and tokens sampled in it.
    num_seqs: int
    num_prompt_tokens: int
    num_generated_tokens: int


class Event(msgspec.Struct):
    """A notable event: preemption, config change, cache reset, rejected request."""

    # Monotonic event number (a reader dedups by it).
    event_id: int
    time: float
    # "preemption", "config", "prefix_cache_reset", "rejected", "pause", "resume", "abort",
    # "error".
    kind: str
    # One line for humans.
    message: str
    # Structured details, e.g. {"victim": ..., "reason": ..., "tokens_lost": ...}.
    data: dict[str, str | int | float | bool | None] = {}


class ModelInfo(msgspec.Struct):
    """Static facts about what is served."""

    model: str = ""
    dtype: str = ""
    device: str = ""
    tp_size: int = 1
    # Bytes of KV memory per block on each rank, and per rank in total.
    kv_bytes_per_block: int = 0
    kv_bytes_per_rank: int = 0
    max_model_len: int = 0
    # The attention backend the engine runs ("torch", "cpu-kernel", "triton", "flash"), and
    # the KV cache's dtype; "" when unknown.
    attention_backend: str = ""
    kv_cache_dtype: str = ""
    # Decode batch sizes captured as CUDA graphs (0: eager), what capturing took and holds.
    cuda_graph_max_batch: int = 0
    cuda_graph_capture_s: float = 0.0
    cuda_graph_bytes: int = 0
    # CUDA, KV pool sized from memory: total_bytes, gpu_memory_utilization,
    # used_after_load_bytes, peak_activation_bytes, profiled_tokens, kv_budget_bytes.
    memory_profile: dict[str, float] = msgspec.field(default_factory=dict)


class TelemetrySnapshot(msgspec.Struct):
    """Everything the console shows, at one instant between two engine steps."""

    version: int
    # Snapshot sequence number, +1 per snapshot built.
    seq: int
    # time.time() when built, and when the engine started.
    time: float
    start_time: float
    # "running", "paused" (admission paused), "draining" or "dead".
    engine_state: str
    model: ModelInfo
    # The live configuration under snake_case names (max_num_batched_tokens, max_num_seqs,
    # long_prefill_token_threshold, enable_prefix_caching, ...) and the start-up limits.
    config: dict[str, int | float | str | bool]
    blocks: BlockMap
    # Pool summary: free (incl. cached), cached-and-evictable, in use (refcount > 0).
    num_free_blocks: int
    num_cached_free_blocks: int
    num_used_blocks: int
    # Token slots holding live tokens in blocks in use (the rest is fragmentation).
    num_used_token_slots: int
    num_running: int
    num_waiting: int
    requests: list[RequestRow]
    counters: Counters
    # The most recent steps (a reader dedups by step_id).
    steps: list[StepStat]
    # The most recent events (a reader dedups by event_id).
    events: list[Event]


class Heartbeat(msgspec.Struct, array_like=True):
    """Liveness between snapshots, sent on the telemetry socket by the publisher thread when
    no snapshot went out for a while: the engine is alive, and maybe busy in one long step.

    Encoded as a msgpack **array** (a snapshot is a map), so a reader tells the two apart by
    the first byte (``is_heartbeat``) without decoding a snapshot.
    """

    # Always "hb" (a reader may check it).
    kind: str
    # time.time() when sent, and ``TelemetrySnapshot.seq`` of the newest snapshot published.
    time: float
    last_seq: int
    # Seconds the engine has been inside the current step (0.0: between steps, idle).
    busy_s: float
    # The step in progress (0 when idle): the next ``StepStat.step_id``.
    step_id: int = 0


def is_heartbeat(frame: bytes) -> bool:
    """A msgpack array (fixarray 0x90-0x9f, array16 0xdc, array32 0xdd) is a ``Heartbeat``."""
    return bool(frame) and (0x90 <= frame[0] <= 0x9F or frame[0] in (0xDC, 0xDD))


_heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)


def encode_heartbeat(hb: Heartbeat) -> bytes:
    return msgspec.msgpack.encode(hb)


def decode_heartbeat(data: bytes) -> Heartbeat:
    return _heartbeat_decoder.decode(data)


def encode_snapshot(snap: TelemetrySnapshot) -> bytes:
    return msgspec.msgpack.encode(snap)


def decode_snapshot(data: bytes) -> TelemetrySnapshot:
    snap = msgspec.msgpack.decode(data, type=TelemetrySnapshot)
    if snap.version > TELEMETRY_VERSION:
        raise ValueError(f"telemetry version {snap.version} is newer than {TELEMETRY_VERSION}")
    return snap
