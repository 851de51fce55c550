"""``pagectl generate``: print a continuation of a prompt, offline, without a server."""

from __future__ import annotations

import argparse
import sys

from pagectl.engine.args import EngineArgs, add_cli_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "prompt", nargs="?", default=None, help="the prompt ('-' or omitted: read stdin)"
    )
    add_cli_arguments(p)
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
        llm = LLM.from_engine_args(EngineArgs.from_cli(args))
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
