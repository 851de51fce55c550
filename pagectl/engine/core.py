"""EngineCore: the single-threaded heart of the engine.

add_request / abort / step / apply_command / snapshot. Everything here runs on the engine loop
thread; admin commands are applied by the caller between two ``step()`` calls, never inside one.
The model executor is anything with ``execute_model(SchedulerOutput) -> ModelRunnerOutput``.
"""

from __future__ import annotations

import time
from array import array
from typing import Protocol

import msgspec
import numpy as np

from pagectl.engine.beam_search import BeamGroup, BeamSearchParams
from pagectl.engine.commands import (
    Abort,
    Command,
    CommandError,
    GetStatus,
    InspectBlock,
    InspectRequest,
    Pause,
    ResetPrefixCache,
    Resume,
    SetConfig,
    SetPrefixCaching,
)
from pagectl.engine.inspect import inspect_request
from pagectl.engine.kv.events import KVEvent, KVEventRecorder
from pagectl.engine.live_config import normalize_name
from pagectl.engine.outputs import (
    EngineCoreOutput,
    EngineRequest,
    ModelRunnerOutput,
    SchedulerOutput,
)
from pagectl.engine.request import Request, RequestStatus
from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.scheduler import Scheduler
from pagectl.engine.status import status_view
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
        structured_outputs=None,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.model_info = model_info or ModelInfo(max_model_len=scheduler.config.max_model_len)
        # Optional callable(list[int]) -> str. Kept for callers in the same process; the
        # admin channel never calls it (InspectBlock returns ids; clients detokenize).
        self.tokenizer_decode = tokenizer_decode
        self.start_time = time.time()
        # Set by the daemon: "draining" during shutdown, "dead" after a fatal error.
        self.state_override: str | None = None
        self._snapshot_seq = 0
        self._tables = _BlockTables()
        self.max_model_len = scheduler.config.max_model_len
        # A ``StructuredOutputManager`` (None: the model has no tokenizer, so constrained
        # requests are refused).
        self.structured_outputs = structured_outputs

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
        constraint = sampling_params.structured_outputs
        if constraint is not None and self.structured_outputs is None:
            raise ValueError("structured_outputs needs the model's tokenizer, and it has none")
        req = Request(
            request_id,
            list(prompt_token_ids),
            sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            priority=priority,
            cache_salt=cache_salt,
        )
        if constraint is not None:
            # Compiles on the manager's thread (or hits its cache); the scheduler holds the
            # request back until the grammar is ready.
            req.grammar = self.structured_outputs.submit(constraint)
        return req

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

    def add_beam_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: BeamSearchParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """Start a beam search (``beam_search``): its W results come as sequences 0..W-1 of
        ``request_id``, each in one output, once the search ends."""
        w = params.beam_width
        sp = SamplingParams(
            temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos
        )
        try:
            req = self.make_request(
                request_id, prompt_token_ids, sp, priority=priority, cache_salt=cache_salt
            )
            # Each beam's row carries its 2W most likely next tokens (raw log-softmax).
            req.sampling_params = SamplingParams(
                temperature=0.0,
                max_tokens=params.max_tokens,
                ignore_eos=params.ignore_eos,
                logprobs=2 * w,
            )
            self.scheduler.add_beam_request(req, params)
        except ValueError as e:
            self.scheduler.counters.rejected += 1
            self.scheduler.add_event("rejected", f"rejected {request_id}: {e}", request=request_id)
            raise

    def add_engine_request(self, er: EngineRequest) -> None:
        if er.beam_search is not None:
            self.add_beam_request(
                er.request_id,
                er.prompt_token_ids,
                BeamSearchParams(**er.beam_search),
                priority=er.priority,
                cache_salt=er.cache_salt,
            )
            return
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
            if sched.only_compiling:
                # Nothing to run until a grammar is ready: wait briefly instead of spinning.
                self.structured_outputs.wait_any([r.grammar for r in sched.compiling], 0.002)
            return sched.take_pending_outputs()
        t0 = time.perf_counter()
        ro = self.executor.execute_model(so)
        return sched.update_from_output(so, ro, time.perf_counter() - t0)

    # -- admin --------------------------------------------------------------------------

    def apply_command(self, cmd: Command, client: str = "") -> dict:
        """Apply one admin command. Returns a result dict; raises ``CommandError``."""
        sched = self.scheduler
        if isinstance(cmd, SetConfig):
            name = normalize_name(cmd.name)
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
        if isinstance(cmd, InspectRequest):
            return inspect_request(sched, cmd)
        raise CommandError("unknown_command", f"unknown command {type(cmd).__name__}")

    def engine_state(self) -> str:
        if self.state_override:
            return self.state_override
        return "paused" if self.scheduler.paused else "running"

    def status(self) -> dict:
        """The ``status`` command's map: a view of a fresh snapshot (status.py)."""
        return status_view(self.snapshot())

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
        return {
            "block_id": block_id,
            "ref_cnt": b.ref_cnt,
            "state": _block_state(b.ref_cnt, b.block_hash is not None),
            "hash": b.block_hash.hex() if b.block_hash else None,
            "owners": owners,
            "fill": fill,
            # Ids only: detokenizing is the client's job (the console, ctl), never the
            # engine thread's.
            "token_ids": tokens or [],
        }

    # -- telemetry ----------------------------------------------------------------------

    def _live_requests(self) -> list[Request]:
        return list(self.scheduler.running) + list(self.scheduler.waiting)

    def snapshot(self) -> TelemetrySnapshot:
        """Build a telemetry snapshot: copies, never the engine's own objects, so it reads
        the same however long it is kept. Cost: O(blocks) memory copy + O(requests) rows,
        the per-block work in numpy."""
        sched = self.scheduler
        pool = sched.kv.pool
        now = time.time()
        mono = time.monotonic()
        live = self._live_requests()
        beams = sched.beam_groups
        tables = self._tables.encode(live)
        shared, empty_slots = _table_stats(
            pool.ref_bytes,
            tables,
            [r.num_computed_tokens for r in sched.running],
            pool.block_size,
        )
        rows = [
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
                num_shared,
                r.num_preemptions,
                max(0.0, mono - r.arrival_time),
                table,
                r.admitted,
                r.seq_id,
                *(_beam_facts(beams, r) if beams else _NOT_A_BEAM),
            )
            for r, table, num_shared in zip(live, tables, shared)
        ]
        c = sched.counters
        counters = msgspec.structs.replace(
            c,
            preemptions_by_reason=dict(c.preemptions_by_reason),
            finished_by_reason=dict(c.finished_by_reason),
            evictions=pool.num_evictions,
        )
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
            num_used_token_slots=pool.num_used_blocks * pool.block_size - empty_slots,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            requests=rows,
            counters=counters,
            steps=list(sched.step_stats)[-64:],
            events=list(sched.events)[-64:],
        )


class _BlockTables:
    """Each live sequence's block table as uint32 bytes, kept from one snapshot to the next.

    A table changes in place only by appends and by copy-on-write of its last block
    (kv/manager.py), and is replaced by a new list when the sequence loses its blocks; so a
    copy made from the same list object is brought up to date by re-reading its last entry
    and appending what is new, and any other change shows as a different list or a shorter
    one.
    """

    def __init__(self) -> None:
        # Request -> (the block_ids list copied, its copy).
        self._copies: dict[Request, tuple[list[int], array]] = {}

    def encode(self, live: list[Request]) -> list[bytes]:
        old = self._copies
        new: dict[Request, tuple[list[int], array]] = {}
        out = []
        for r in live:
            ids = r.block_ids
            entry = old.get(r)
            if entry is not None and entry[0] is ids:
                copy = entry[1]
                n = len(copy)
                if n > len(ids):
                    copy = array("I", ids)
                elif n:
                    copy[n - 1] = ids[n - 1]
                    if n < len(ids):
                        copy.extend(ids[n:])
                elif ids:
                    copy.extend(ids)
            else:
                copy = array("I", ids)
            new[r] = (ids, copy)
            out.append(copy.tobytes())
        self._copies = new
        return out


def _table_stats(
    ref_bytes: bytearray, tables: list[bytes], computed: list[int], block_size: int
) -> tuple[list[int], int]:
    """Per block table (uint32 block ids), how many of its blocks another table holds too
    (refcount > 1); and the empty token slots in the partial last blocks of the first
    ``len(computed)`` tables (the running sequences, ``computed`` their computed tokens),
    a last block shared by several counted once with its smallest gap. Numpy throughout:
    one gather over all tables' ids, one sum per table."""
    if not tables:
        return [], 0
    ref = np.frombuffer(ref_bytes, dtype=np.uint8)
    ids = np.frombuffer(b"".join(tables), dtype=np.uint32)
    lengths = np.fromiter((len(t) >> 2 for t in tables), dtype=np.int64, count=len(tables))
    ends = np.cumsum(lengths)
    # hits[k]: shared blocks among the first k ids of all tables together.
    hits = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(ref[ids] > 1, out=hits[1:])
    shared = (hits[ends] - hits[ends - lengths]).tolist()
    n = len(computed)
    nb, end = lengths[:n], ends[:n]
    have = nb > 0
    filled = np.asarray(computed, dtype=np.int64)[have] - (nb[have] - 1) * block_size
    gap = block_size - np.maximum(filled, 0)
    partial = filled < block_size
    last = ids[end[have] - 1][partial]
    gap = gap[partial]
    if len(last) == 0:
        return shared, 0
    # The smallest gap per block: sort by (block, gap), keep each block's first.
    order = np.lexsort((gap, last))
    last, gap = last[order], gap[order]
    first = np.ones(len(last), dtype=bool)
    first[1:] = last[1:] != last[:-1]
    return shared, int(gap[first].sum())


_NOT_A_BEAM = (0, 0.0)


def _beam_facts(groups: dict[str, BeamGroup], r: Request) -> tuple[int, float]:
    """(beam width, cumulative logprob) of a beam; (0, 0.0) for any other sequence."""
    group = groups.get(r.request_id)
    if group is None:
        return _NOT_A_BEAM
    return group.width, group.cum.get(r.seq_id, 0.0)


def _block_state(ref_cnt: int, hashed: bool) -> str:
    if ref_cnt == 0:
        return "cached" if hashed else "free"
    return "shared" if ref_cnt > 1 else "in_use"
