"""``pagectl generate``: print a continuation of a prompt, offline, without a server."""

from __future__ import annotations

import argparse
import sys

from pagectl.engine.args import ATTENTION_BACKENDS, GENERATION_CONFIG_MODES, QUANTIZATIONS


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Model and engine flags shared by ``generate`` and ``bench``."""
    p.add_argument(
        "--model", default=None, help="model directory or hub id (default: the built-in model)"
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer directory or hub id (default: the model's)"
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="weight-only quantization made at load time (CPU): int8 per output channel, int4 "
        "in groups of 128 (default: as the checkpoint; AWQ/GPTQ load as int4)",
    )
    p.add_argument(
        "--tp", "--tensor-parallel-size", dest="tensor_parallel_size", type=int, default=1
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None, help="KV pool size, e.g. 2GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefix caching",
    )
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto (default): flash-attn on CUDA when usable, else the compiled CPU kernel, "
        "else torch",
    )
    p.add_argument(
        "--generation-config",
        choices=GENERATION_CONFIG_MODES,
        default="auto",
        help="auto (default): unset sampling flags take the model's generation_config.json "
        "values; none: the engine's own defaults",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "prompt", nargs="?", default=None, help="the prompt ('-' or omitted: read stdin)"
    )
    add_engine_arguments(p)
    g = p.add_argument_group(
        "sampling (a flag left out takes the model's generation_config.json value, else the "
        "default shown)"
    )
    g.add_argument("--max-tokens", type=int, default=None, help="default 64")
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 = greedy (default, as transformers' generate without do_sample)",
    )
    g.add_argument("--top-p", type=float, default=None, help="default 1.0")
    g.add_argument("--top-k", type=int, default=None, help="default 0 (off)")
    g.add_argument("--min-p", type=float, default=None, help="default 0.0")
    g.add_argument("--presence-penalty", type=float, default=None, help="default 0.0")
    g.add_argument("--frequency-penalty", type=float, default=None, help="default 0.0")
    g.add_argument("--repetition-penalty", type=float, default=None, help="default 1.0")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("-n", type=int, default=1, help="number of samples")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user message through the chat template",
    )
    p.add_argument("--echo", action="store_true", help="print the prompt before the continuation")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        model=args.model,
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        num_threads=args.num_threads,
        attention_backend=args.attention_backend,
        generation_config=args.generation_config,
    )


# Sampling flags that fall back to the model's defaults when left out.
_DEFAULTED = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def run(args: argparse.Namespace) -> int:
    from pagectl.engine.llm import LLM
    from pagectl.engine.sampling_params import SamplingParams

    prompt = args.prompt
    if prompt is None or prompt == "-":
        prompt = sys.stdin.read()
    given = {k: getattr(args, k) for k in _DEFAULTED if getattr(args, k) is not None}
    try:  # bad flags fail before the model loads
        SamplingParams(n=args.n, max_tokens=args.max_tokens, min_tokens=args.min_tokens, **given)
        llm = LLM(**engine_kwargs(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"pagectl generate: {e}", file=sys.stderr)
        return 2
    with llm:
        defaults = llm.engine.sampling_defaults
        kw: dict = {"temperature": 0.0}
        kw.update({k: v for k, v in defaults.items() if k in _DEFAULTED})
        kw.update(given)
        max_tokens = args.max_tokens if args.max_tokens is not None else defaults.get("max_tokens")
        try:
            sp = SamplingParams(
                n=args.n,
                max_tokens=max_tokens if max_tokens is not None else 64,
                min_tokens=args.min_tokens,
                seed=args.sampling_seed,
                stop=args.stop,
                ignore_eos=args.ignore_eos,
                **kw,
            )
            if args.chat:
                outs = llm.chat([{"role": "user", "content": prompt}], sp)
            else:
                outs = llm.generate(prompt, sp)
        except ValueError as e:
            print(f"pagectl generate: {e}", file=sys.stderr)
            return 2
    for out in outs[0].outputs:
        if len(outs[0].outputs) > 1:
            print(f"--- sample {out.index} ({out.finish_reason}) ---")
        text = out.text if llm.tokenizer is not None else " ".join(map(str, out.token_ids))
        sys.stdout.write((prompt if args.echo else "") + text + "\n")
    return 0
