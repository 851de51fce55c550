"""EngineCore: the single-threaded heart of the engine.

add_request / abort / step / apply_command / snapshot. Everything here runs on the engine loop
thread; admin commands are applied by the caller between two ``step()`` calls, never inside one.
The model executor is anything with ``execute_model(SchedulerOutput) -> ModelRunnerOutput``.
"""

from __future__ import annotations

import time
from array import array
from typing import Protocol

from pagectl.engine.commands import (
    Abort,
    Command,
    CommandError,
    GetStatus,
    InspectBlock,
    Pause,
    ResetPrefixCache,
    Resume,
    SetConfig,
    SetPrefixCaching,
)
from pagectl.engine.kv.events import KVEvent, KVEventRecorder
from pagectl.engine.outputs import (
    EngineCoreOutput,
    EngineRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagectl.engine.request import Request, RequestStatus
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.scheduler import Scheduler
from pagectl.engine.telemetry import (
    TELEMETRY_VERSION,
    BlockMap,
    Counters,
    ModelInfo,
    RequestRow,
    TelemetrySnapshot,
)


class ModelExecutor(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


_STATE_NAMES = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.RUNNING: "running",
    RequestStatus.PREEMPTED: "preempted",
}


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: ModelExecutor,
        *,
        vocab_size: int,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        model_info: ModelInfo | None = None,
        tokenizer_decode=None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.model_info = model_info or ModelInfo(max_model_len=scheduler.config.max_model_len)
        # Optional callable(list[int]) -> str, used for block previews in InspectBlock.
        self.tokenizer_decode = tokenizer_decode
        self.start_time = time.time()
        # Set by the daemon: "draining" during shutdown, "dead" after a fatal error.
        self.state_override: str | None = None
        self._snapshot_seq = 0
        self.max_model_len = scheduler.config.max_model_len

    # -- requests -----------------------------------------------------------------------

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Request:
        """Validate and build a request. Raises ``ValueError`` with a clear message."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        for t in prompt_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt token id {t!r} is outside the vocabulary [0, {vocab})")
        sampling_params.validate(vocab)
        n_prompt = len(prompt_token_ids)
        if n_prompt >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n_prompt} tokens; the maximum context length is "
                f"{self.max_model_len}, leaving no room to generate"
            )
        if (
            sampling_params.max_tokens is not None
            and n_prompt + sampling_params.max_tokens > self.max_model_len
        ):
            raise ValueError(
                f"prompt ({n_prompt} tokens) + max_tokens ({sampling_params.max_tokens}) exceeds "
                f"the maximum context length {self.max_model_len}"
            )
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        return Request(
            request_id,
            list(prompt_token_ids),
            sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            priority=priority,
            cache_salt=cache_salt,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        **kw,
    ) -> None:
        try:
            req = self.make_request(request_id, prompt_token_ids, sampling_params, **kw)
            self.scheduler.add_request(req)
        except ValueError as e:
            self.scheduler.counters.rejected += 1
            self.scheduler.add_event("rejected", f"rejected {request_id}: {e}", request=request_id)
            raise

    def add_engine_request(self, er: EngineRequest) -> None:
        sp = SamplingParams(**er.sampling_params)
        self.add_request(
            er.request_id,
            er.prompt_token_ids,
            sp,
            priority=er.priority,
            cache_salt=er.cache_salt,
        )

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.scheduler.has_pending_outputs()

    def finish_by_stop_string(self, request_id: str, index: int, stop: str) -> None:
        """Finish sample ``index`` of a request whose text hit ``stop`` (found by the output
        processor, outside the engine); a sequence already finished is left alone."""
        self.scheduler.finish_by_stop_string(request_id, index, stop)

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        """The outputs produced outside a step (aborts, refusals), once each."""
        return self.scheduler.take_pending_outputs()

    def add_event(self, kind: str, message: str, **data: object) -> None:
        """Record an event in the engine's event log (telemetry and the console show it)."""
        self.scheduler.add_event(kind, message, **data)

    def enable_kv_events(self) -> KVEventRecorder:
        """Start recording the block pool's KV-cache events (see ``engine/kv/events.py``)."""
        pool = self.scheduler.kv.pool
        if pool.events is None:
            pool.events = KVEventRecorder()
        return pool.events

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events since the last call (empty when recording is off)."""
        rec = self.scheduler.kv.pool.events
        return rec.take() if rec is not None else []

    @property
    def block_size(self) -> int:
        return self.scheduler.kv.pool.block_size

    def live_config(self) -> dict[str, int | float | str | bool]:
        """The settings in force (live ones and their start-up limits)."""
        return self.scheduler.live_config()

    @property
    def counters(self) -> Counters:
        """The engine's running totals (steps, tokens, preemptions, ...); read-only use."""
        return self.scheduler.counters

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run one forward, update. Returns outputs for every sequence that moved."""
        sched = self.scheduler
        so = sched.schedule()
        if so.is_empty and not so.block_copies:
            return sched.take_pending_outputs()
        t0 = time.perf_counter()
        ro = self.executor.execute_model(so)
        return sched.update_from_output(so, ro, time.perf_counter() - t0)

    # -- admin --------------------------------------------------------------------------

    def apply_command(self, cmd: Command, client: str = "") -> dict:
        """Apply one admin command. Returns a result dict; raises ``CommandError``."""
        sched = self.scheduler
        if isinstance(cmd, SetConfig):
            name = cmd.name.replace("-", "_")
            try:
                old, new = sched.set(name, cmd.value, client)
            except KeyError as e:
                raise CommandError("unknown_setting", str(e.args[0])) from None
            except ValueError as e:
                raise CommandError("invalid_value", str(e)) from None
            return {"name": name, "old": old, "new": new}
        if isinstance(cmd, SetPrefixCaching):
            old, new = sched.set("enable_prefix_caching", cmd.enabled, client)
            return {"name": "enable_prefix_caching", "old": old, "new": new}
        if isinstance(cmd, ResetPrefixCache):
            return {"released_blocks": sched.reset_prefix_cache(client)}
        if isinstance(cmd, Pause):
            return {"paused": True, "was_paused": sched.set_paused(True, client)}
        if isinstance(cmd, Resume):
            return {"paused": False, "was_paused": sched.set_paused(False, client)}
        if isinstance(cmd, Abort):
            if not sched.abort_request(cmd.request_id):
                raise CommandError("not_found", f"no live request with id {cmd.request_id!r}")
            who = f" by {client}" if client else ""
            sched.add_event(
                "abort", f"aborted {cmd.request_id}{who}", request=cmd.request_id, client=client
            )
            return {"aborted": cmd.request_id}
        if isinstance(cmd, GetStatus):
            return self.status()
        if isinstance(cmd, InspectBlock):
            return self.inspect_block(cmd.block_id)
        raise CommandError("unknown_command", f"unknown command {type(cmd).__name__}")

    def engine_state(self) -> str:
        if self.state_override:
            return self.state_override
        return "paused" if self.scheduler.paused else "running"

    def status(self) -> dict:
        sched = self.scheduler
        kv = sched.kv
        pool = kv.pool
        used_slots = self.used_token_slots()
        total_slots = pool.num_blocks * pool.block_size
        c = sched.counters
        return {
            "engine_state": self.engine_state(),
            "model": self.model_info.model,
            "dtype": self.model_info.dtype,
            "device": self.model_info.device,
            "tp_size": self.model_info.tp_size,
            "kv_bytes_per_rank": self.model_info.kv_bytes_per_rank,
            "uptime_s": round(time.time() - self.start_time, 3),
            "config": sched.live_config(),
            "kv": {
                "num_blocks": pool.num_blocks,
                "block_size": pool.block_size,
                "num_used_blocks": pool.num_used_blocks,
                "num_free_blocks": pool.num_free_blocks,
                "num_cached_free_blocks": pool.num_cached_free_blocks,
                "usage_perc": pool.num_used_blocks / pool.num_blocks,
                "token_usage_perc": used_slots / total_slots,
            },
            "counters": {
                "prefix_queries": c.prefix_queries,
                "prefix_hits": c.prefix_hits,
                "preemptions": c.preemptions,
                "preemptions_by_reason": dict(c.preemptions_by_reason),
                "prompt_tokens": c.prompt_tokens,
                "generation_tokens": c.generation_tokens,
                "steps": c.steps,
                "finished_by_reason": dict(c.finished_by_reason),
                "rejected": c.rejected,
                "evictions": pool.num_evictions,
            },
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "requests": [
                {
                    "request_id": r.request_id,
                    "index": r.index,
                    "state": _STATE_NAMES.get(r.status, "finished"),
                    "priority": r.priority,
                    "num_prompt_tokens": r.num_prompt_tokens,
                    "num_output_tokens": r.num_output_tokens,
                    "num_computed_tokens": r.num_computed_tokens,
                    "num_cached_tokens": r.num_cached_tokens,
                    "num_blocks": len(r.blocks),
                    "num_preemptions": r.num_preemptions,
                }
                for r in self._live_requests()
            ],
            "last_steps": [
                {
                    "step_id": s.step_id,
                    "num_scheduled_tokens": s.num_scheduled_tokens,
                    "token_budget": s.token_budget,
                }
                for s in list(sched.step_stats)[-8:]
            ],
        }

    def inspect_block(self, block_id: int) -> dict:
        pool = self.scheduler.kv.pool
        if not 0 <= block_id < pool.num_blocks:
            raise CommandError(
                "not_found", f"block {block_id} does not exist (pool has {pool.num_blocks})"
            )
        b = pool.blocks[block_id]
        owners = []
        tokens: list[int] | None = list(b.token_ids) if b.token_ids else None
        fill = pool.block_size if b.block_hash is not None else 0
        bs = pool.block_size
        for r in self._live_requests():
            if block_id in r.block_ids:
                i = r.block_ids.index(block_id)
                owners.append(r.seq_id)
                start = i * bs
                f = max(0, min(bs, r.num_computed_tokens - start))
                fill = max(fill, f)
                if tokens is None or len(tokens) < f:
                    tokens = r.all_token_ids[start : start + f]
        text = None
        if tokens and self.tokenizer_decode is not None:
            try:
                text = self.tokenizer_decode(tokens)
            except Exception:  # a preview must never fail the command
                text = None
        return {
            "block_id": block_id,
            "ref_cnt": b.ref_cnt,
            "state": _block_state(b.ref_cnt, b.block_hash is not None),
            "hash": b.block_hash.hex() if b.block_hash else None,
            "owners": owners,
            "fill": fill,
            "token_ids": tokens or [],
            "text": text,
        }

    # -- telemetry ----------------------------------------------------------------------

    def _live_requests(self) -> list[Request]:
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    def used_token_slots(self) -> int:
        """Token slots holding computed tokens in blocks in use (shared blocks counted once)."""
        pool = self.scheduler.kv.pool
        bs = pool.block_size
        empty: dict[int, int] = {}
        for r in self.scheduler.running:
            if r.block_ids:
                filled_in_last = r.num_computed_tokens - (len(r.block_ids) - 1) * bs
                if filled_in_last < bs:
                    bid = r.block_ids[-1]
                    gap = bs - max(filled_in_last, 0)
                    prev = empty.get(bid)
                    empty[bid] = gap if prev is None else min(prev, gap)
        return pool.num_used_blocks * bs - sum(empty.values())

    def snapshot(self) -> TelemetrySnapshot:
        """Build a telemetry snapshot (cost: O(blocks) memory copy + O(requests))."""
        sched = self.scheduler
        pool = sched.kv.pool
        now = time.time()
        mono = time.monotonic()
        rows = []
        for r in self._live_requests():
            shared = 0
            for b in r.blocks:
                if b.ref_cnt > 1:
                    shared += 1
            rows.append(
                RequestRow(
                    r.request_id,
                    r.index,
                    _STATE_NAMES.get(r.status, "finished"),
                    r.priority,
                    r.num_prompt_tokens,
                    r.num_output_tokens,
                    r.num_computed_tokens,
                    r.num_cached_tokens,
                    len(r.block_ids),
                    shared,
                    r.num_preemptions,
                    max(0.0, mono - r.arrival_time),
                    array("I", r.block_ids).tobytes(),
                )
            )
        c = sched.counters
        c.evictions = pool.num_evictions
        self._snapshot_seq += 1
        return TelemetrySnapshot(
            version=TELEMETRY_VERSION,
            seq=self._snapshot_seq,
            time=now,
            start_time=self.start_time,
            engine_state=self.engine_state(),
            model=self.model_info,
            config=sched.live_config(),
            blocks=BlockMap(
                pool.num_blocks, pool.block_size, bytes(pool.ref_bytes), bytes(pool.hashed_bytes)
            ),
            num_free_blocks=pool.num_free_blocks,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_used_token_slots=self.used_token_slots(),
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            requests=rows,
            counters=c,
            steps=list(sched.step_stats)[-64:],
            events=list(sched.events)[-64:],
        )


def _block_state(ref_cnt: int, hashed: bool) -> str:
    if ref_cnt == 0:
        return "cached" if hashed else "free"
    return "shared" if ref_cnt > 1 else "in_use"
