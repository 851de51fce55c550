"""What an operator would otherwise use, on the same model, workload and threads.

- ``run_hf_continuous_batching``: transformers' own continuous batching on a paged cache,
  driven through its manager (``init_continuous_batching``) so that each request gets its own
  ``max_new_tokens`` (``generate_batch`` takes one length for all).
- ``run_hf_static_batches``: ``model.generate`` on left-padded batches of consecutive
  requests; a batch runs until its longest request is done, and only each request's own
  output length counts.
- ``forward_limit``: tokens/s of one bare forward (logits included) over a long sequence,
  the most a forward-bound engine could reach on this model and machine.

Every run is greedy unless a temperature is given, with EOS ignored.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from pagectl.bench.results import EngineResult, count_useful
from pagectl.bench.workload import BenchRequest


def load_hf_model(model: str, dtype: str = "float32", device: str = "cpu") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype) if dtype != "auto" else "auto"
    m: Any = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    return m.to(device).eval()


def paged_cache_blocks(workload: list[BenchRequest], page_size: int) -> int:
    """Pages of transformers' paged cache that hold every request at full length at once.

    With one spare page per request and two more; ``run_hf_continuous_batching`` and the
    ``transformers serve`` peer of ``pagectl bench serve`` size their cache alike.
    """
    return sum(-(-(r.prompt_len + r.output_len) // page_size) + 1 for r in workload) + 2


def _gen_config(temperature: float, **kw: Any) -> Any:
    from transformers import GenerationConfig

    if temperature > 0:
        return GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **kw)
    return GenerationConfig(do_sample=False, **kw)


def run_hf_continuous_batching(
    model: Any,
    workload: list[BenchRequest],
    *,
    temperature: float = 0.0,
    max_batch_tokens: int | None = None,
    page_size: int = 256,
    timeout_s: float = 3600.0,
) -> EngineResult:
    """Run ``workload`` through transformers' continuous batching manager.

    The paged cache is sized to hold every request at its full length at once (as pagectl's
    pool is in the same comparison), rather than from a share of the machine's memory.
    """
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    res = EngineResult("hf-cb", "transformers continuous batching", len(workload))
    num_blocks = paged_cache_blocks(workload, page_size)
    cb_config = ContinuousBatchingConfig(
        page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens
    )
    hints = WorkloadHints(
        max_prompt_length=max(r.prompt_len for r in workload),
        max_generated_length=max(r.output_len for r in workload),
        num_requests=len(workload),
    )
    # eos_token_id=-1: no EOS, every request generates exactly max_new_tokens.
    gen_config = _gen_config(temperature, eos_token_id=-1, pad_token_id=0)
    manager = model.init_continuous_batching(
        generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints
    )
    manager.start()
    try:
        # Warm-up: one short request, not timed (the cache is allocated by now too).
        _collect(
            manager,
            [manager.add_request([1, 2, 3, 4], max_new_tokens=2, eos_token_id=-1)],
            timeout_s,
        )
        t0 = time.perf_counter()
        ids = [
            manager.add_request(r.prompt_token_ids, max_new_tokens=r.output_len, eos_token_id=-1)
            for r in workload
        ]
        outs = _collect(manager, ids, timeout_s)
        res.elapsed_s = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=30)
        destroy = getattr(manager, "destroy", None)
        if destroy is not None:
            destroy()
    errors = [o.error for o in outs.values() if o.error]
    if len(outs) < len(ids) or errors:
        res.error = f"{len(ids) - len(outs)} missing, {len(errors)} failed: {errors[:1]}"
    tokens = [list(outs[i].generated_tokens) if i in outs else [] for i in ids]
    res.useful_output_tokens, res.num_length_mismatches = count_useful(
        tokens, [r.output_len for r in workload]
    )
    res.model_tokens = sum(r.prompt_len + r.output_len - 1 for r in workload)
    res.extra = {
        "page_size": page_size,
        "num_blocks": num_blocks,
        "max_batch_tokens": max_batch_tokens,
    }
    return res


def _collect(manager: Any, ids: list[str], timeout_s: float) -> dict[str, Any]:
    wanted = set(ids)
    outs: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(outs) < len(wanted) and time.monotonic() < deadline:
        r = manager.get_result(timeout=0.5)
        if r is None:
            if not manager.is_running():
                break
            continue
        if r.request_id in wanted and r.is_finished():
            outs[r.request_id] = r
    return outs


def run_hf_static_batches(
    model: Any,
    workload: list[BenchRequest],
    *,
    batch_size: int = 16,
    temperature: float = 0.0,
    pad_token_id: int = 0,
) -> EngineResult:
    """``model.generate`` on left-padded batches of ``batch_size`` consecutive requests."""
    import torch

    res = EngineResult(
        "hf-static", f"transformers generate, static batches of {batch_size}", len(workload)
    )
    device = next(model.parameters()).device

    def run_batch(batch: list[BenchRequest]) -> list[list[int]]:
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len :] = 1
        max_new = max(r.output_len for r in batch)
        # eos_token_id=None: EOS is ignored; every row runs to max_new tokens.
        cfg = _gen_config(
            temperature, max_new_tokens=max_new, eos_token_id=None, pad_token_id=pad_token_id
        )
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=cfg
            )
        new = out[:, width:].tolist()
        return [row[: r.output_len] for row, r in zip(new, batch, strict=True)]

    run_batch(workload[:1])  # warm-up, not timed
    outputs: list[list[int]] = []
    wasted = 0
    model_tokens = 0
    t0 = time.perf_counter()
    for start in range(0, len(workload), batch_size):
        batch = workload[start : start + batch_size]
        outputs.extend(run_batch(batch))
        longest = max(r.output_len for r in batch)
        wasted += sum(longest - r.output_len for r in batch)
        # Every row of the padded batch runs the prompt width, then longest - 1 decode steps.
        model_tokens += len(batch) * (max(r.prompt_len for r in batch) + longest - 1)
    res.elapsed_s = time.perf_counter() - t0
    res.useful_output_tokens, res.num_length_mismatches = count_useful(
        outputs, [r.output_len for r in workload]
    )
    res.wasted_tokens = wasted
    res.model_tokens = model_tokens
    res.extra = {"batch_size": batch_size}
    return res


def forward_limit(model: Any, seq_len: int = 512, repeats: int = 5) -> EngineResult:
    """Tokens/s of a bare forward (all positions' logits) over one ``seq_len``-token sequence.

    The fastest of ``repeats`` timed forwards after one warm-up: a limit is the best the
    machine does, and on a shared machine slower repeats measure the neighbours (the
    median is kept in ``extra``). The same forward with the LM head applied to the last
    position only (``logits_to_keep=1``) is timed too and kept in ``extra``: an engine
    computes logits only where it samples, so that rate is the stricter limit.
    """
    import torch

    g = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    ids = torch.randint(1, model.config.vocab_size, (1, seq_len), generator=g).to(device)

    def timed(**kw: Any) -> list[float]:
        out = []
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, **kw)
            for _ in range(repeats):
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=False, **kw)
                out.append(time.perf_counter() - t0)
        return out

    times = timed()
    try:
        last_times: list[float] | None = timed(logits_to_keep=1)
    except TypeError:  # a transformers without logits_to_keep
        last_times = None
    best = min(times)
    med = statistics.median(times)
    res = EngineResult("forward", f"forward limit ({seq_len}-token forward)", 0)
    res.elapsed_s = best
    res.tokens_per_s_override = seq_len / best
    res.extra = {
        "seq_len": seq_len,
        "repeats": repeats,
        "best_s": best,
        "median_s": med,
        "median_tokens_per_s": seq_len / med,
        "last_logits_best_s": min(last_times) if last_times else None,
        "last_logits_tokens_per_s": seq_len / min(last_times) if last_times else None,
    }
    return res
