"""The scheduler: one token budget per step, no prefill/decode phases.

Each step hands the budget (``max_num_batched_tokens``) to running sequences first, in order,
then admits waiting ones while the budget, ``max_num_seqs`` and the KV pool allow. A sequence
asks for ``target_num_tokens - num_computed_tokens`` tokens: a whole (or chunked) prompt, or
one decode token. When the pool runs dry, the last running sequence (newest under FCFS,
lowest priority under the priority policy; ``running`` is kept in that order) is preempted by
recompute: it drops all its blocks and goes back to the front of the waiting queue. Nothing
is admitted in a step that preempted.

Owned by the engine loop thread; nothing here is thread-safe.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from collections import deque
from itertools import repeat

from pagectl.engine.beam_search import BeamGroup, BeamSearchParams
from pagectl.engine.config import CacheConfig, SchedulerConfig
from pagectl.engine.kv.manager import KVCacheManager
from pagectl.engine.live_config import LiveConfigMixin
from pagectl.engine.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagectl.engine.request import Request, RequestStatus
from pagectl.engine.spec_decode.config import SpeculativeConfig
from pagectl.engine.spec_decode.ngram import NgramProposer
from pagectl.engine.spec_decode.slots import DraftSlots
from pagectl.engine.telemetry import Counters, Event, StepStat
from pagectl.engine.waiting_queue import WaitingQueue

PREEMPT_KV_BLOCKS = "kv_blocks"


class Scheduler(LiveConfigMixin):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        step_history: int = 256,
        event_history: int = 256,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        self.config = scheduler_config
        # The start-up values, which bound the live ones (live_config.LIVE_SETTINGS).
        self.startup_config = dataclasses.replace(scheduler_config)
        self.spec_config = speculative_config
        # Live: most tokens proposed per sequence per step (0: speculation off). The
        # start-up value is its upper bound.
        self.num_spec_tokens = (
            speculative_config.num_speculative_tokens if speculative_config else 0
        )
        # The draft model's proposals are made by the runner: here it only reserves their
        # slots (``spec_decode.slots``).
        self.proposer: NgramProposer | DraftSlots | None = None
        if speculative_config is not None:
            self.proposer = (
                NgramProposer(
                    speculative_config.prompt_lookup_min, speculative_config.prompt_lookup_max
                )
                if speculative_config.method == "ngram"
                else DraftSlots()
            )
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(
            cache_config.num_kv_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
        self.waiting = WaitingQueue(scheduler_config.policy)
        # Constrained requests whose grammar is still compiling (status WAITING, not in
        # ``waiting``): moved to ``waiting`` by ``schedule()`` once ready, in arrival order.
        self.compiling: list[Request] = []
        # Running sequences in service order; the last one is the next preemption victim.
        self.running: list[Request] = []
        # request_id -> its live sequences (several after a fork).
        self.groups: dict[str, list[Request]] = {}
        self.paused = False
        self.counters = Counters(preemptions_by_reason={}, finished_by_reason={})
        self.step_stats: deque[StepStat] = deque(maxlen=step_history)
        self.events: deque[Event] = deque(maxlen=event_history)
        self._event_ids = itertools.count(1)
        self._step_ids = itertools.count(1)
        # Outputs produced outside a step (aborts, refusals), flushed with the next update.
        self._pending_outputs: list[EngineCoreOutput] = []
        # Sequences that left since the last schedule() (for the runner to drop state).
        self._finished_seq_ids: list[str] = []
        # Beam search: request_id -> its group, and seq_id -> group for every live beam.
        self.beam_groups: dict[str, BeamGroup] = {}
        self._beam_of: dict[str, BeamGroup] = {}

    # -- queries ------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.compiling)

    @property
    def only_compiling(self) -> bool:
        """Nothing can run until a grammar compile finishes."""
        return bool(self.compiling) and not self.running and len(self.waiting) == 0

    def has_pending_outputs(self) -> bool:
        return bool(self._pending_outputs)

    # -- requests -----------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        if req.request_id in self.groups:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.groups[req.request_id] = [req]
        if req.grammar is not None and req.grammar.matcher is None:
            self.compiling.append(req)
        else:
            self.waiting.push(req)

    def add_beam_request(self, req: Request, params: BeamSearchParams) -> None:
        """Start a beam search from ``req`` (its prompt; greedy with logprobs = 2W)."""
        if params.beam_width > self.startup_config.max_num_seqs:
            raise ValueError(
                f"beam_width {params.beam_width} exceeds max_num_seqs {self.startup_config.max_num_seqs}"
            )
        self.add_request(req)
        group = BeamGroup(
            req.request_id,
            params,
            req.num_prompt_tokens,
            min(params.max_tokens, req.max_num_tokens - req.num_prompt_tokens),
            [req],
        )
        group.cum[req.seq_id] = 0.0
        self.beam_groups[req.request_id] = group
        self._beam_of[req.seq_id] = group

    def abort_request(self, request_id: str) -> bool:
        """Finish every sequence of ``request_id`` with "abort", freeing its blocks."""
        seqs = self.groups.get(request_id)
        if not seqs:
            return False
        group = self.beam_groups.pop(request_id, None)
        if group is not None:
            for beam in group.beams:
                self._beam_of.pop(beam.seq_id, None)
        for req in list(seqs):
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def _finish(self, req: Request, status: RequestStatus, *, emit: bool = True) -> None:
        """Take ``req`` out of the engine. Outputs for it are queued unless ``emit`` is False."""
        prev = req.status
        req.status = status
        if prev == RequestStatus.RUNNING:
            self.running.remove(req)
        elif prev in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            if req.grammar is not None and req in self.compiling:
                self.compiling.remove(req)
            else:
                self.waiting.discard(req)
        self.kv.free(req)
        self._release(req)
        if emit:
            self._pending_outputs.append(self._output(req, []))

    def _release(self, req: Request) -> None:
        """Bookkeeping shared by every way a sequence leaves."""
        seqs = self.groups.get(req.request_id)
        if seqs is not None:
            seqs.remove(req)
            if not seqs:
                del self.groups[req.request_id]
        reason = req.finish_reason or "abort"
        fbr = self.counters.finished_by_reason
        fbr[reason] = fbr.get(reason, 0) + 1
        self._finished_seq_ids.append(req.seq_id)

    def _output(self, req: Request, new_token_ids: list[int], **kw) -> EngineCoreOutput:
        return EngineCoreOutput(
            req.request_id,
            req.index,
            new_token_ids,
            req.finish_reason,
            req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
            **kw,
        )

    # -- scheduling ---------------------------------------------------------------------

    def _promote_compiled(self) -> None:
        """Move requests whose grammar is ready into the waiting queue (or fail them)."""
        still: list[Request] = []
        c = self.counters
        for req in self.compiling:
            g = req.grammar
            if not g.ready:
                still.append(req)
                continue
            seconds = g.activate()
            if g.error is not None:
                req.error = f"structured_outputs: {g.error}"
                req.status = RequestStatus.FINISHED_ERROR
                self.kv.free(req)
                self._release(req)
                self._pending_outputs.append(self._output(req, []))
                continue
            if seconds is None:
                c.grammar_cache_hits += 1
            else:
                c.grammar_compiles += 1
                c.grammar_compile_seconds += seconds
            self.waiting.push(req)
        self.compiling = still

    def schedule(self) -> SchedulerOutput:
        if self.compiling:
            self._promote_compiled()
        cfg = self.config
        kv = self.kv
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        seqs: list[Request] = []
        counts: list[int] = []
        samples: list[bool] = []
        preempted: list[Request] = []
        running = self.running

        # Speculation: a decoding sequence may feed up to spec_k proposals after its last
        # token (their slots allocated like any token's, the budget counting them).
        spec_k = self.num_spec_tokens if self.proposer is not None else 0
        dbs = self.spec_config.disable_by_batch_size if self.spec_config else 0
        if dbs and len(running) >= dbs:
            spec_k = 0
        spec_at: dict[int, list[int]] = {}

        # 1. Running sequences first, in order; preempt from the back when blocks run out.
        bs = self.block_size
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            nc = req.num_computed_tokens
            ntok = len(req.all_token_ids)
            if req.pending_forks > 1:
                num_new = req.target_num_tokens - nc
                if num_new <= 0:
                    i += 1
                    continue
            else:
                num_new = ntok - nc
                if num_new <= 0:
                    i += 1  # a beam that has its next-token row and waits for its group
                    continue
                if num_new == 1 and spec_k and budget > 1 and req.seq_id not in self._beam_of:
                    drafts = self._propose(req, min(spec_k, budget - 1))
                    # Proposals never cause a preemption: without room they are dropped.
                    if drafts and kv.allocate_slots(req, 1 + len(drafts)):
                        spec_at[len(seqs)] = drafts
                        seqs.append(req)
                        counts.append(1 + len(drafts))
                        samples.append(True)
                        budget -= 1 + len(drafts)
                        i += 1
                        continue
                if num_new == 1 and nc % bs and req.blocks[-1].ref_cnt == 1:
                    # Steady decode: the slot is in the sequence's own last block.
                    seqs.append(req)
                    counts.append(1)
                    samples.append(True)
                    budget -= 1
                    i += 1
                    continue
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            scheduled = True
            while not kv.allocate_slots(req, num_new):
                if len(running) == 1:
                    # Alone and still short of blocks: the pool can never hold it.
                    self._finish_unfittable(req)
                    scheduled = False
                    break
                victim = running[-1]
                self._preempt(victim, PREEMPT_KV_BLOCKS)
                preempted.append(victim)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                continue  # running shrank; ``i`` now points past the end or at the next one
            seqs.append(req)
            counts.append(num_new)
            samples.append(nc + num_new == ntok)
            budget -= num_new
            i += 1

        # 2. Admit waiting sequences, unless this step preempted or admission is paused.
        if not preempted and not self.paused:
            self._admit(budget, seqs, counts, samples)
            if not seqs and self.beam_groups and running and len(self.waiting):
                # Every running sequence is a beam waiting for a beam that cannot be
                # admitted: make room (the group advances once that beam has its row).
                self._preempt(running[-1], PREEMPT_KV_BLOCKS)

        block_copies = kv.drain_copies()
        return SchedulerOutput(
            step_id=next(self._step_ids),
            seqs=seqs,
            num_scheduled_tokens=counts,
            sample=samples,
            total_num_scheduled_tokens=sum(counts),
            block_copies=block_copies,
            # Kept until a step runs: the runner learns of finished sequences only through
            # an executed step.
            finished_seq_ids=self._drain_finished_ids() if seqs or block_copies else [],
            spec_token_ids=[spec_at.get(j, []) for j in range(len(seqs))] if spec_at else [],
        )

    def _propose(self, req: Request, k: int) -> list[int]:
        """Up to ``k`` proposals for a decoding sequence, fewer near its end: the verified
        run plus the token sampled after it must fit ``max_num_tokens``."""
        k = min(k, req.max_num_tokens - len(req.all_token_ids) - 1)
        if k <= 0:
            return []
        assert self.proposer is not None
        if req.grammar is not None and isinstance(self.proposer, DraftSlots):
            # A draft model's proposals are drawn in the runner, after this check could
            # cut them at the grammar: constrained sequences decode without speculation there.
            return []
        drafts = self.proposer.propose(req.all_token_ids, k)
        if drafts and req.grammar is not None:
            # Constrained: cut at the first proposal the grammar rejects.
            drafts = drafts[: req.grammar.num_valid(drafts)]
        return drafts

    def _admit(
        self, budget: int, seqs: list[Request], counts: list[int], samples: list[bool]
    ) -> None:
        cfg = self.config
        kv = self.kv
        bs = self.block_size
        threshold = cfg.long_prefill_token_threshold
        running = self.running
        while budget > 0 and len(running) < cfg.max_num_seqs:
            req = self.waiting.peek()
            if req is None:
                break
            if (
                req.pending_forks > 1
                and running
                and len(running) + req.pending_forks > cfg.max_num_seqs
            ):
                break
            if kv.blocks_needed(max(req.target_num_tokens, 1)) > kv.num_blocks:
                self._finish_unfittable(req)  # can never fit, however empty the pool
                continue
            hits = kv.find_cached_prefix(req)
            num_hit = len(hits) * bs
            num_new = req.target_num_tokens - num_hit
            if threshold and num_new > threshold:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if not kv.allocate_slots(req, num_new, hits):
                break
            self.waiting.pop()
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = num_hit
                self.counters.prefix_queries += (
                    req.num_prompt_tokens if kv.enable_prefix_caching else 0
                )
                self.counters.prefix_hits += num_hit
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if self.config.policy == "priority":
                bisect.insort(running, req, key=lambda r: r.priority_key)
            else:
                running.append(req)
            if num_new > 0:
                seqs.append(req)
                counts.append(num_new)
                samples.append(num_hit + num_new == len(req.all_token_ids))
                budget -= num_new
            elif req.pending_forks > 1:
                self._fork(req)

    def _preempt(self, req: Request, reason: str) -> None:
        lost = req.num_computed_tokens
        if self.running[-1] is req:
            self.running.pop()
        else:
            self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.waiting.push_front(req)
        c = self.counters
        c.preemptions += 1
        c.preemptions_by_reason[reason] = c.preemptions_by_reason.get(reason, 0) + 1
        self.add_event(
            "preemption",
            f"preempted {req.seq_id} ({reason}): {lost} tokens to recompute",
            victim=req.seq_id,
            reason=reason,
            tokens_lost=lost,
            num_preemptions=req.num_preemptions,
        )

    def _finish_unfittable(self, req: Request) -> None:
        if req.num_output_tokens > 0:
            status = RequestStatus.FINISHED_LENGTH
            need = self.kv.blocks_needed(req.num_computed_tokens + 1)
        else:
            status = RequestStatus.FINISHED_ERROR
            need = self.kv.blocks_needed(req.target_num_tokens + 1)
            req.error = (
                f"request needs {need} KV blocks of {self.block_size} tokens "
                f"but the pool has {self.kv.num_blocks}"
            )
        self.add_event(
            "error" if status == RequestStatus.FINISHED_ERROR else "kv_capacity",
            f"{req.seq_id} cannot fit the KV pool ({need} blocks > {self.kv.num_blocks})",
            request=req.seq_id,
            blocks_needed=need,
        )
        group = self._beam_of.get(req.seq_id)
        if group is not None:
            # A beam search ends as a whole, with an error: its other beams leave silently.
            self.beam_groups.pop(group.request_id, None)
            if req.error is None:
                req.error = f"a beam cannot fit the KV pool ({need} blocks > {self.kv.num_blocks})"
            status = RequestStatus.FINISHED_ERROR
            for beam in list(self.groups.get(req.request_id, ())):
                self._beam_of.pop(beam.seq_id, None)
                if beam is not req:
                    self._finish(beam, status, emit=False)
            self._beam_of.pop(req.seq_id, None)
        self._finish(req, status)

    def _fork(self, parent: Request) -> None:
        """Split an n > 1 parent into n sequences sharing its blocks (copy-on-write later)."""
        n = parent.pending_forks
        parent.pending_forks = 1
        group = self.groups[parent.request_id]
        pos = self.running.index(parent) + 1
        for i in range(1, n):
            child = parent.fork(i)
            self.kv.fork(parent, child)
            group.append(child)
            self.running.insert(pos, child)
            pos += 1

    # -- results ------------------------------------------------------------------------

    def update_from_output(
        self, so: SchedulerOutput, ro: ModelRunnerOutput, step_duration: float = 0.0
    ) -> list[EngineCoreOutput]:
        """Advance the scheduled sequences by what the step computed and sampled."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        kv = self.kv
        bs = self.block_size
        caching = kv.enable_prefix_caching
        sampled = ro.sampled_token_ids
        logprobs = ro.logprobs
        prompt_lps = ro.prompt_logprobs
        running_status = RequestStatus.RUNNING
        num_prompt = 0
        num_generated = 0
        recomputed = 0
        finished: list[Request] = []
        lps = logprobs if logprobs is not None else repeat(None)
        spec_in = so.spec_token_ids
        spec_out = ro.spec_output_token_ids
        beam_of = self._beam_of
        ready_groups: list[BeamGroup] = []
        for j, (req, n, sample, tok, lp) in enumerate(
            zip(so.seqs, so.num_scheduled_tokens, so.sample, sampled, lps)
        ):
            if req.status is not running_status:
                continue  # finished while the step ran (e.g. aborted)
            if spec_in and spec_in[j]:
                gained = spec_out[j] if spec_out is not None else [tok]
                spec_lps = ro.spec_logprobs[j] if ro.spec_logprobs is not None else None
                num_new_tokens = self._update_spec(req, spec_in[j], gained, spec_lps, outputs)
                num_generated += num_new_tokens
                if req.status is not running_status:
                    finished.append(req)
                continue
            before = req.num_computed_tokens
            after = before + n
            req.num_computed_tokens = after
            if before < req.num_prompt_tokens:
                num_prompt += min(after, req.num_prompt_tokens) - before
            if req.num_preemptions:
                last = len(req.all_token_ids) - 1
                if before < last:
                    recomputed += min(after, last) - before
            if caching and after // bs > req.num_registered_blocks:
                kv.cache_full_blocks(req)
            if not sample:
                if req.pending_forks > 1 and after >= req.target_num_tokens:
                    self._fork(req)
                if prompt_lps and req.seq_id in prompt_lps:
                    outputs.append(self._output(req, [], prompt_logprobs=prompt_lps[req.seq_id]))
                continue
            if beam_of:
                group = beam_of.get(req.seq_id)
                if group is not None:
                    assert lp is not None, "a beam samples with logprobs = 2W"
                    group.pending[req.seq_id] = lp
                    if group.ready():
                        ready_groups.append(group)
                    continue
            tokens = req.all_token_ids
            tokens.append(tok)
            num_generated += 1
            ntok = len(tokens)
            finish_reason = None
            g = req.grammar
            if g is not None and not g.accept(tok):
                # Never for a token drawn under the grammar's mask; fail, do not corrupt.
                req.status = RequestStatus.FINISHED_ERROR
                req.error = f"structured_outputs: token {tok} does not fit the grammar"
                finished.append(req)
                outputs.append(self._output(req, [tok]))
                continue
            if tok in req.stop_ids and ntok >= req.min_num_tokens:
                req.status = RequestStatus.FINISHED_STOPPED
                if tok in req.sampling_params.stop_token_ids:
                    req.stop_reason = tok
                finished.append(req)
                finish_reason = "stop"
            elif g is not None and g.terminated:
                # The grammar is complete (its stop token accepted, e.g. with ignore_eos).
                req.status = RequestStatus.FINISHED_STOPPED
                finished.append(req)
                finish_reason = "stop"
            elif ntok >= req.max_num_tokens:
                req.status = RequestStatus.FINISHED_LENGTH
                finished.append(req)
                finish_reason = "length"
            if lp is not None or (prompt_lps and req.seq_id in prompt_lps):
                outputs.append(
                    self._output(
                        req,
                        [tok],
                        new_logprobs=[lp] if lp is not None else None,
                        prompt_logprobs=prompt_lps.get(req.seq_id) if prompt_lps else None,
                    )
                )
            else:
                outputs.append(
                    EngineCoreOutput(
                        req.request_id,
                        req.index,
                        [tok],
                        finish_reason,
                        req.stop_reason,
                        None,
                        None,
                        req.num_prompt_tokens,
                        req.num_cached_tokens,
                    )
                )
        if finished:
            self.running = [r for r in self.running if r.status is running_status]
            for req in finished:
                kv.free(req)
                self._release(req)
        for group in ready_groups:
            num_generated += self._beam_step(group, outputs)
        c = self.counters
        c.prompt_tokens += num_prompt
        c.generation_tokens += num_generated
        c.recomputed_tokens += recomputed
        if so.seqs:
            c.steps += 1
            c.scheduled_tokens += so.total_num_scheduled_tokens
            self.step_stats.append(
                StepStat(
                    so.step_id,
                    time.time(),
                    step_duration,
                    so.total_num_scheduled_tokens,
                    self.config.max_num_batched_tokens,
                    len(so.seqs),
                    num_prompt,
                    num_generated,
                )
            )
        return outputs

    def _update_spec(
        self,
        req: Request,
        proposals: list[int],
        gained: list[int],
        gained_logprobs: list | None,
        outputs: list[EngineCoreOutput],
    ) -> int:
        """Advance a sequence that verified ``proposals`` and gained ``gained`` (its accepted
        proposals, then one sampled token). Returns how many tokens it gained (fewer than
        ``gained`` when it finished inside the run).

        Its computed tokens become the last token plus the accepted proposals; blocks holding
        only rejected slots go back to the pool; only then are full blocks offered to the
        prefix cache, so no hash ever covers a rejected token. A stop token or the length
        limit inside the run cuts it there.
        """
        c = self.counters
        m = len(gained) - 1
        c.spec_decode_num_drafts += 1
        c.spec_decode_num_draft_tokens += len(proposals)
        c.spec_decode_num_accepted_tokens += m
        per_pos = c.spec_decode_num_accepted_tokens_per_pos
        if len(per_pos) < len(proposals):
            per_pos.extend([0] * (len(proposals) - len(per_pos)))
        for p in range(m):
            per_pos[p] += 1
        tokens = req.all_token_ids
        stop_ids = req.stop_ids
        new: list[int] = []
        status = None
        g = req.grammar
        for t in gained:
            tokens.append(t)
            new.append(t)
            if g is not None and not g.accept(t):
                # Never: proposals were checked and samples drawn under the grammar's mask.
                status = RequestStatus.FINISHED_ERROR
                req.error = f"structured_outputs: token {t} does not fit the grammar"
                break
            if t in stop_ids and len(tokens) >= req.min_num_tokens:
                status = RequestStatus.FINISHED_STOPPED
                if t in req.sampling_params.stop_token_ids:
                    req.stop_reason = t
                break
            if g is not None and g.terminated:
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
                break
            if len(tokens) >= req.max_num_tokens:
                status = RequestStatus.FINISHED_LENGTH
                break
        # The last token before the step, and each accepted proposal, are now computed.
        req.num_computed_tokens += len(new)
        kv = self.kv
        kv.release_slots_beyond(req, req.num_computed_tokens)
        if kv.enable_prefix_caching and req.num_computed_tokens // self.block_size > (
            req.num_registered_blocks
        ):
            kv.cache_full_blocks(req)
        if status is not None:
            req.status = status
        outputs.append(
            self._output(
                req,
                new,
                new_logprobs=gained_logprobs[: len(new)] if gained_logprobs else None,
            )
        )
        return len(new)

    # -- beam search --------------------------------------------------------------------

    def _beam_step(self, group: BeamGroup, outputs: list[EngineCoreOutput]) -> int:
        """Advance a group whose beams all have their next-token rows (``BeamGroup.step``):
        extend, fork and free beams, or end the search. Returns tokens appended."""
        used = 0
        for beam in group.beams:
            used += len(beam.blocks)
        group.peak_blocks = max(group.peak_blocks, used)
        conts = group.step()
        new_beams: list[Request] = []
        appended = 0
        for beam, cs in conts:
            if not cs:
                self._drop_beam(beam)
                continue
            # Forks first: they copy the beam's tokens before it grows.
            for tok, cum in cs[1:]:
                child = self._fork_beam(beam, group)
                child.all_token_ids.append(tok)
                group.cum[child.seq_id] = cum
                new_beams.append(child)
            tok, cum = cs[0]
            beam.all_token_ids.append(tok)
            group.cum[beam.seq_id] = cum
            new_beams.append(beam)
            appended += len(cs)
        new_beams.sort(key=lambda b: -group.cum[b.seq_id])
        group.beams = new_beams
        if group.done:
            self._finish_beam_group(group, outputs)
        return appended

    def _fork_beam(self, parent: Request, group: BeamGroup) -> Request:
        """A new beam sharing every block of ``parent`` (same tokens so far)."""
        child = Request.__new__(Request)
        for slot in Request.__slots__:
            setattr(child, slot, getattr(parent, slot))
        child.seq_id = f"{parent.request_id}#b{group.next_child}"
        group.next_child += 1
        child.all_token_ids = list(parent.all_token_ids)
        child.blocks = []
        child.block_ids = []
        child.block_hashes = []
        self.kv.fork(parent, child)
        self.groups[parent.request_id].append(child)
        self._beam_of[child.seq_id] = group
        if parent.status == RequestStatus.RUNNING:
            self.running.insert(self.running.index(parent) + 1, child)
        else:  # the parent lost its blocks to a preemption: the child recomputes too
            self.waiting.push_front(child)
        return child

    def _drop_beam(self, beam: Request) -> None:
        """Free a beam that no candidate continues (its blocks go back at once)."""
        prev = beam.status
        beam.status = RequestStatus.FINISHED_STOPPED
        if prev == RequestStatus.RUNNING:
            self.running.remove(beam)
        elif prev in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.discard(beam)
        self.kv.free(beam)
        seqs = self.groups.get(beam.request_id)
        if seqs is not None and beam in seqs:
            seqs.remove(beam)
        self._beam_of.pop(beam.seq_id, None)
        self._finished_seq_ids.append(beam.seq_id)

    def _finish_beam_group(self, group: BeamGroup, outputs: list[EngineCoreOutput]) -> None:
        """Emit the finished hypotheses, best first, as sequences 0..W-1 of the request."""
        for beam in list(group.beams):
            self._drop_beam(beam)
        group.beams = []
        rid = group.request_id
        self.groups.pop(rid, None)
        self.beam_groups.pop(rid, None)
        fbr = self.counters.finished_by_reason
        for j, res in enumerate(group.results()):
            fbr[res.finish_reason] = fbr.get(res.finish_reason, 0) + 1
            outputs.append(
                EngineCoreOutput(
                    rid,
                    j,
                    res.token_ids,
                    res.finish_reason,
                    num_prompt_tokens=group.num_prompt_tokens,
                    cumulative_logprob=res.cum_logprob,
                )
            )

    def finish_by_stop_string(self, request_id: str, index: int, stop: str) -> None:
        """Finish one sequence whose text hit a stop string (found by the detokenizer)."""
        for req in list(self.groups.get(request_id, ())):
            if req.index == index:
                req.stop_reason = stop
                self._finish(req, RequestStatus.FINISHED_STOPPED, emit=False)

    def _drain_finished_ids(self) -> list[str]:
        ids = self._finished_seq_ids
        self._finished_seq_ids = []
        return ids

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        outputs = self._pending_outputs
        self._pending_outputs = []
        return outputs

    # -- live configuration -------------------------------------------------------------

    def add_event(self, kind: str, message: str, **data) -> Event:
        ev = Event(next(self._event_ids), time.time(), kind, message, data)
        self.events.append(ev)
        return ev
