"""The model runner: executes one ``SchedulerOutput`` as one forward over the whole batch.

Per step: drop state of finished sequences, apply copy-on-write block copies, pack the batch
(``input_batch``), let the attention backend precompute its per-step state, run the forward
(a captured CUDA graph for small pure-decode batches on CUDA), compute logits only for the rows
that sample or score prompt tokens, sample, and return ``ModelRunnerOutput`` in the
scheduler's order.

With tensor parallelism every rank holds a ``ModelRunner`` over its shard. Rank 0 plans the
batch, broadcasts its arrays through ``tp_driver`` (``distributed.TPWorkers``) and samples;
ranks 1..N-1 only run ``run_arrays`` on what they receive. Everything between the broadcast
and the logits gather runs inside ``tp_driver.collective()``, so a fault there is reported as
the rank that caused it and the group is not used again.

With speculative method "draft_model", rank 0's runner holds the draft model's proposer
(``drafter``, ``spec_decode.draft_model``): it runs before the target's forward (the step's
rows and the proposals, on the draft's own KV pool) and after the sampling; the sampling of
a draft step is its rejection sampling.

Owned by the engine loop thread. ``timings`` accumulates wall time per phase (exact on CPU;
on CUDA set ``sync_timings`` to make it exact at the price of a sync per phase).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagectl.engine.attention import select_backend
from pagectl.engine.model_config import ModelConfig
from pagectl.engine.models.decoder import DecoderForCausalLM
from pagectl.engine.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from pagectl.engine.runner.input_batch import BatchBuilder, SamplingPlan, StepArrays, StepBatch
from pagectl.engine.runner.kv_cache import KVCachePool, kv_bytes_per_block
from pagectl.engine.runner.logits_ops import compute_prompt_logprobs
from pagectl.engine.runner.sampler import Sampler
from pagectl.engine.spec_decode.verify import SpecRow, num_accepted

if TYPE_CHECKING:
    from pagectl.engine.spec_decode.draft_model import DraftModelProposer

log = logging.getLogger(__name__)


@dataclass
class RunnerTimings:
    """Cumulative seconds per phase, and steps run."""

    steps: int = 0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    # The draft model's passes (speculative method "draft_model"), before and after.
    draft_s: float = 0.0

    def reset(self) -> None:
        self.steps = 0
        self.prepare_s = self.forward_s = self.sample_s = self.draft_s = 0.0


class ModelRunner:
    """Implements the engine core's ``ModelExecutor`` protocol on one device (TP rank 0), and
    the forward half of a step on the other ranks (``run_arrays``)."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        model_config: ModelConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        max_num_seqs: int = 256,
        kv_cache_dtype: torch.dtype | None = None,
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        seed: int = 0,
        tp_rank: int = 0,
        tp_driver: Any = None,
        samples: bool = True,
    ) -> None:
        """``samples=False``: a runner that only runs forwards (a draft model's, whose
        proposer samples by itself), so it builds no sampler."""
        self.model = model
        self.tp_rank = tp_rank
        # Rank 0 of a tensor-parallel group: broadcasts each step to the other ranks.
        self.tp_driver = tp_driver
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        attn = model.attention_layers[0]
        # The KV cache's dtype (default: the model's); attention computes in it.
        kv_dtype = kv_cache_dtype or dtype
        self.kv = KVCachePool(
            model_config.num_hidden_layers,
            num_blocks,
            block_size,
            attn.num_kv_heads,
            attn.head_dim,
            kv_dtype,
            device,
        )
        if device.type == "cpu":
            model.pack_for_cpu()
        kv_token_bytes = kv_bytes_per_block(1, 1, attn.num_kv_heads, attn.head_dim, kv_dtype)
        self.backend = select_backend(
            attention_backend,
            device,
            block_size,
            kv_dtype,
            kv_token_bytes,
            shape=(attn.num_heads, attn.num_kv_heads, attn.head_dim),
        )
        if tp_rank == 0:
            log.info(
                "attention backend %s (asked: %s) on %s, model %s, KV cache %s, block size %d",
                self.backend.name,
                attention_backend,
                device,
                str(dtype).removeprefix("torch."),
                str(kv_dtype).removeprefix("torch."),
                block_size,
            )
        model.bind_kv_cache(self.kv.layer_caches(), self.backend)
        model.rotary_emb.ensure_cache(max_model_len, device)
        rotary = model.rotary_emb
        self.batch_builder = BatchBuilder(
            block_size,
            self.kv.scratch_block,
            device,
            dynamic_rope_len=rotary.max_position_embeddings if rotary.is_dynamic else None,
        )
        # Speculative method "draft_model" (rank 0 only): the draft model's proposer
        # (``spec_decode.draft_model``), attached by the builder.
        self.drafter: DraftModelProposer | None = None
        # Only rank 0 samples.
        self.sampler = (
            Sampler(model_config.vocab_size, device=device, seed=seed)
            if tp_rank == 0 and samples
            else None
        )
        # seq_id -> leading prompt positions whose logprobs were already returned (so a
        # recompute after preemption does not report them twice).
        self._prompt_scored: dict[str, int] = {}
        self.timings = RunnerTimings()
        self.sync_timings = False
        self.cuda_graphs = None
        if device.type == "cuda" and not enforce_eager and self.backend.supports_cuda_graphs:
            from pagectl.engine.runner.cuda_graph import DecodeCudaGraphs

            self.cuda_graphs = DecodeCudaGraphs(self, max_batch_size=min(max_num_seqs, 512))
            self.cuda_graphs.capture()

    # -- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        sampler = self.sampler
        assert sampler is not None, "only tensor-parallel rank 0 runs execute_model"
        driver = self.tp_driver
        if so.finished_seq_ids:
            sampler.forget(so.finished_seq_ids)
            for seq_id in so.finished_seq_ids:
                self._prompt_scored.pop(seq_id, None)
        drafter = self.drafter
        t_draft = 0.0
        if drafter is not None:
            t = time.perf_counter()
            so = drafter.propose(so)
            t_draft = time.perf_counter() - t
        t0 = time.perf_counter()
        arrays = sampling = None
        if so.seqs:
            arrays, sampling = self.batch_builder.plan(so, self._prompt_scored)
        if driver is None:
            batch, logits, t1 = self.run_arrays(arrays, so.block_copies)
        else:
            with driver.collective():
                driver.send_step(arrays, so.block_copies)
                batch, logits, t1 = self.run_arrays(arrays, so.block_copies)
        if batch is None:
            return ModelRunnerOutput([])
        assert sampling is not None
        batch.sampling = sampling
        t2 = self._tick()
        out = self._sample(so, batch, logits, sampler)
        t3 = self._tick()
        if drafter is not None:
            drafter.finish(so, out)
            t_draft += self._tick() - t3
        tm = self.timings
        tm.draft_s += t_draft
        tm.steps += 1
        tm.prepare_s += t1 - t0
        tm.forward_s += t2 - t1
        tm.sample_s += t3 - t2
        return out

    def run_arrays(
        self, arrays: StepArrays | None, block_copies: list[tuple[int, int]]
    ) -> tuple[StepBatch | None, torch.Tensor | None, float]:
        """What every tensor-parallel rank runs for a step: the copy-on-write block copies,
        then (when there are sequences) the forward and the logits rows, gathered on rank 0.

        Returns the batch, the logits (None on other ranks, or when no row needs them) and
        the time the batch was ready.
        """
        self.kv.copy_blocks(block_copies)
        if arrays is None:
            return None, None, 0.0
        batch = self.batch_builder.from_arrays(arrays)
        self.backend.prepare(batch.meta)
        t1 = self._tick()
        hidden = self._forward(batch)
        logits = None
        if batch.logits_rows.numel():  # a step of mid-prompt chunks needs no logits
            logits = self.model.compute_logits(hidden.index_select(0, batch.logits_rows))
        return batch, logits, t1

    def check_health(self) -> None:
        """Raise if a tensor-parallel worker has failed (the engine loop calls this between
        steps, so a worker that dies while the engine is idle is noticed too)."""
        if self.tp_driver is not None:
            self.tp_driver.check_health()

    def release(self) -> None:
        """Drop the KV memory and CUDA graphs (the runner is unusable afterwards)."""
        for layer in self.model.attention_layers:
            layer.kv_cache = None
        self.kv.release()
        self.cuda_graphs = None
        if self.drafter is not None:
            self.drafter.release()
            self.drafter = None

    def _tick(self) -> float:
        if self.sync_timings and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_run(batch):
            return graphs.run(batch)
        return self.model(batch.input_ids, batch.positions, batch.meta)

    def _sample(
        self,
        so: SchedulerOutput,
        batch: StepBatch,
        logits: torch.Tensor | None,
        sampler: Sampler,
    ) -> ModelRunnerOutput:
        seqs = so.seqs
        sampled = [-1] * len(seqs)
        if logits is None:
            return ModelRunnerOutput(sampled)
        logprobs: list[TokenLogprobs | None] | None = None
        plan = batch.sampling
        p = plan.num_prompt_logprob_rows
        if plan.num_sample_rows:
            return self._sample_spec(so, plan, logits, sampler)
        if plan.sample_indices:
            result = sampler(logits[p:], [seqs[i] for i in plan.sample_indices])
            for i, tok in zip(plan.sample_indices, result.token_ids, strict=True):
                sampled[i] = tok
            if result.logprobs is not None:
                logprobs = [None] * len(seqs)
                for i, lp in zip(plan.sample_indices, result.logprobs, strict=True):
                    logprobs[i] = lp
        return ModelRunnerOutput(sampled, logprobs, self._prompt_logprobs(seqs, plan, logits))

    def _prompt_logprobs(
        self, seqs: list, plan: SamplingPlan, logits: torch.Tensor
    ) -> dict[str, list[TokenLogprobs]] | None:
        if not plan.prompt_logprobs:
            return None
        prompt_logprobs = {}
        for pl in plan.prompt_logprobs:
            n = len(pl.target_token_ids)
            rows = logits[pl.row_start : pl.row_start + n]
            targets = torch.tensor(pl.target_token_ids, dtype=torch.long, device=rows.device)
            seq_id = seqs[pl.seq_index].seq_id
            prompt_logprobs[seq_id] = compute_prompt_logprobs(rows, targets, pl.num_logprobs)
        return prompt_logprobs

    def _sample_spec(
        self, so: SchedulerOutput, plan: SamplingPlan, logits: torch.Tensor, sampler: Sampler
    ) -> ModelRunnerOutput:
        """Sample every verification row, then keep each sequence's accepted run
        (``spec_decode.verify``)."""
        seqs = so.seqs
        spec = so.spec_token_ids
        rows: list[Any] = []
        for i, c in zip(plan.sample_indices, plan.num_sample_rows, strict=True):
            req = seqs[i]
            rows.append(req)
            if c > 1:
                drafts = spec[i]
                rows.extend(SpecRow(req, drafts[:j]) for j in range(1, c))
        sample_logits = logits[plan.num_prompt_logprob_rows :]
        if self.drafter is not None:
            result = self.drafter.verify(sampler, sample_logits, rows, plan, so)
        else:
            result = sampler(sample_logits, rows)
        toks, lps = result.token_ids, result.logprobs
        sampled = [-1] * len(seqs)
        logprobs: list[TokenLogprobs | None] | None = None if lps is None else [None] * len(seqs)
        spec_out: list[list[int]] = [[] for _ in seqs]
        spec_lps: list[list[TokenLogprobs] | None] | None = None
        if lps is not None:
            spec_lps = [None] * len(seqs)
        r = 0
        for i, c in zip(plan.sample_indices, plan.num_sample_rows, strict=True):
            sampled[i] = toks[r]
            if lps is not None:
                logprobs[i] = lps[r]  # type: ignore[index]
            if c > 1:
                m = num_accepted(spec[i], toks[r : r + c - 1])
                spec_out[i] = toks[r : r + m + 1]
                if lps is not None and lps[r] is not None:
                    spec_lps[i] = lps[r : r + m + 1]  # type: ignore[index,assignment]
            r += c
        return ModelRunnerOutput(
            sampled,
            logprobs,
            self._prompt_logprobs(seqs, plan, logits),
            spec_output_token_ids=spec_out,
            spec_logprobs=spec_lps,
        )
