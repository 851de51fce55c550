"""The measurements ``gpu_check.py`` runs: each takes an engine (``pagectl.LLM``) or a device
and returns a dict of figures, so the script only orders them and writes the report."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pagectl.bench.synthetic import SYNTHETIC_MODELS

# Qwen3-0.6B's shape (pagectl's second standard size, with the context this script needs) and
# Qwen3-8B's; random weights (seed 0).
QWEN3_06B = {
    k: v
    for k, v in SYNTHETIC_MODELS["qwen3-0.6b"].items()
    if k not in ("model_type", "architectures")
}
QWEN3_06B["max_position_embeddings"] = 4096
QWEN3_8B = dict(
    QWEN3_06B,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
SMOKE = dict(QWEN3_06B, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
SMOKE.update(num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512)


def build_random_model(out_dir: Path, shape: dict, device: str, dtype: torch.dtype) -> Path:
    """A Qwen3 checkpoint with random weights (transformers' init, seed 0), built once."""
    if (out_dir / "config.json").is_file() and any(out_dir.glob("*.safetensors")):
        return out_dir
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(Qwen3Config(**shape)).to(dtype)
    model.save_pretrained(out_dir)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out_dir


def correctness_prompts(n: int, vocab: int, block_size: int = 256) -> list[list[int]]:
    """Prompt lengths on and around block boundaries (256 and 16), seeded."""
    g = torch.Generator().manual_seed(1)
    lengths = [1, 15, 17, block_size - 1, block_size, block_size + 1, 600, 1000][:n]
    return [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]


def hf_scores(hf: Any, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each position that predicted ``tokens[j]``: [n, vocab]."""
    ids = torch.tensor([prompt + tokens[:-1]], device=hf.device)
    with torch.inference_mode():
        logits = hf(input_ids=ids).logits[0, len(prompt) - 1 :]
    return logits.float().log_softmax(-1)


def check_against_hf(
    llm: Any,
    hf: Any,
    prompts: list[list[int]],
    new_tokens: int,
    logprob_tol: float,
    tie_tol: float | None = None,
) -> dict[str, Any]:
    """Greedy + logprobs through ``llm``; every chosen token scored by transformers.

    Logprob-close: each token's logprob within ``logprob_tol`` of transformers'. With
    ``tie_tol`` (the float32 check), also token for token: transformers' argmax must be our
    token wherever its top choice beats ours by more than ``tie_tol`` nats (a tie within
    rounding is not a divergence). The first position that fails is reported.
    """
    from pagectl import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    worst = 0.0
    agree = total = 0
    first = None
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        tokens = list(out.outputs[0].token_ids)
        ours = [lp.logprob for lp in out.outputs[0].logprobs]
        ref = hf_scores(hf, prompt, tokens)
        for j, tok in enumerate(tokens):
            theirs = float(ref[j, tok])
            diff = abs(ours[j] - theirs)
            worst = max(worst, diff)
            top = int(ref[j].argmax())
            agree += top == tok
            total += 1
            margin = float(ref[j, top]) - theirs
            bad = diff > logprob_tol or (tie_tol is not None and margin > tie_tol)
            if bad and first is None:
                first = dict(
                    prompt=i,
                    prompt_len=len(prompt),
                    position=j,
                    token=tok,
                    logprob=ours[j],
                    hf_logprob=theirs,
                    hf_argmax=top,
                    hf_argmax_logprob=float(ref[j, top]),
                )
    return dict(
        passed=first is None,
        max_abs_logprob_diff=worst,
        tokens=total,
        hf_argmax_agreement=agree / max(total, 1),
        first_divergence=first,
    )


def nano_vllm_throughput(
    llm: Any, num_requests: int, lo: int, hi: int, vocab: int, temperature: float
) -> dict[str, Any]:
    """nano-vllm's bench.py workload: lengths uniform in [lo, hi], ignore_eos."""
    from pagectl import SamplingParams
    from pagectl.bench.workload import WorkloadSpec, random_workload, total_prompt_tokens

    spec = WorkloadSpec(num_requests, lo, hi, lo, hi, vocab_size=min(vocab, 10001), seed=0)
    work = random_workload(spec, low_token_id=0)
    params = [
        SamplingParams(temperature=temperature, max_tokens=r.output_len, ignore_eos=True)
        for r in work
    ]
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in work], params)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    prompt_tokens = total_prompt_tokens(work)
    return dict(
        requests=len(work),
        prompt_tokens=prompt_tokens,
        output_tokens=out_tokens,
        wrong_lengths=sum(
            len(o.outputs[0].token_ids) != r.output_len for o, r in zip(outs, work, strict=True)
        ),
        time_s=elapsed,
        output_tok_s=out_tokens / elapsed,
        total_tok_s=(out_tokens + prompt_tokens) / elapsed,
    )


def decode_rate(
    llm: Any, batch: int, prompt_len: int, new_tokens: int, vocab: int
) -> dict[str, Any]:
    """Decode tokens/s at a fixed batch: ``batch`` prompts of ``prompt_len`` run for 1 token
    and then for ``new_tokens``; the difference is ``new_tokens - 1`` pure decode steps."""
    from pagectl import SamplingParams

    g = torch.Generator().manual_seed(batch)
    prompts = [
        {"prompt_token_ids": torch.randint(1, vocab, (prompt_len,), generator=g).tolist()}
        for _ in range(batch)
    ]

    def timed(n: int) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp)
        return time.perf_counter() - t0

    # Prefix caching would make the second run's prefill free: distinct ids per run.
    timed(2)  # warm-up
    for p in prompts:
        p["prompt_token_ids"] = [(t + 7) % vocab or 1 for t in p["prompt_token_ids"]]
    t_one = timed(1)
    for p in prompts:
        p["prompt_token_ids"] = [(t + 7) % vocab or 1 for t in p["prompt_token_ids"]]
    t_all = timed(new_tokens)
    decode_s = max(t_all - t_one, 1e-9)
    return dict(
        batch=batch,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        decode_s=decode_s,
        decode_tok_s=batch * (new_tokens - 1) / decode_s,
        step_ms=1000 * decode_s / (new_tokens - 1),
    )


def kv_write_timing(device: str, num_tokens: int, kv_heads: int, head_dim: int) -> dict:
    """The triton K/V write kernel against the torch ``index_copy_`` pair, one layer, bf16:
    microseconds per write (CUDA events, 50 iterations after a warm-up)."""
    from pagectl.engine.attention.backend import AttentionBackend
    from pagectl.engine.attention.triton_paged import TritonPagedAttention

    dev = torch.device(device)
    dtype = torch.bfloat16
    num_blocks, bs = 4096, 16
    cache = torch.zeros(2, num_blocks + 1, bs, kv_heads, head_dim, dtype=dtype, device=dev)
    k = torch.randn(num_tokens, kv_heads, head_dim, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    slots = torch.randperm(num_blocks * bs, device=dev)[:num_tokens]
    triton_backend = TritonPagedAttention(dev, kv_heads, kv_heads, head_dim, dtype)
    torch_backend = AttentionBackend(dev)
    result: dict[str, Any] = dict(tokens=num_tokens, kv_heads=kv_heads, head_dim=head_dim)
    for name, backend in (("triton_us", triton_backend), ("index_copy_us", torch_backend)):
        backend.write_kv(k, v, cache, slots)
        torch.cuda.synchronize(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            backend.write_kv(k, v, cache, slots)
        end.record()
        torch.cuda.synchronize(dev)
        result[name] = 1000 * start.elapsed_time(end) / 50
    flat = cache.view(2, -1, kv_heads, head_dim)
    result["triton_exact"] = bool(torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v))
    return result
