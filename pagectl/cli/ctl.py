"""``pagectl ctl``: scripted control of a running daemon over the admin channel.

Exit status: 0 done; 1 the daemon refused the command (the reason is printed); 2 usage
error; 3 no daemon found, no control token, or no answer in time.
"""

from __future__ import annotations

import argparse
import json
import sys

from pagectl.tui.fmt import size

EXIT_REFUSED = 1
EXIT_UNREACHABLE = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--runtime-dir",
        default=None,
        help="runtime directory of the daemon (default: $PAGECTL_RUNTIME_DIR, "
        "$XDG_RUNTIME_DIR/pagectl or ~/.cache/pagectl/run)",
    )
    p.add_argument(
        "--control-endpoint", default=None, help="control endpoint (instead of the runtime file)"
    )
    p.add_argument(
        "--token-file", default=None, help="control token file (with --control-endpoint)"
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    sub = p.add_subparsers(dest="ctl_command", metavar="COMMAND", required=True)
    st = sub.add_parser("status", help="config, KV usage, counters, requests")
    st.add_argument("--json", action="store_true", help="the full status as JSON")
    s = sub.add_parser("set", help="change a live setting, e.g. `set max-num-batched-tokens 4096`")
    s.add_argument(
        "key",
        help="max-num-batched-tokens, max-num-seqs, long-prefill-token-threshold, "
        "enable-prefix-caching",
    )
    s.add_argument("value")
    pc = sub.add_parser("prefix-cache", help="turn prefix caching on or off")
    pc.add_argument("state", choices=("on", "off"))
    sub.add_parser("reset-prefix-cache", help="forget every cached prefix")
    sub.add_parser("pause", help="stop admitting waiting requests (running ones go on)")
    sub.add_parser("resume", help="admit waiting requests again")
    ab = sub.add_parser("abort", help="abort a request (all its samples)")
    ab.add_argument("request_id")
    ib = sub.add_parser("inspect-block", help="one KV block: refcount, owners, fill, tokens")
    ib.add_argument("block_id", type=int)


def _command(args: argparse.Namespace):
    from pagectl.engine import commands as c

    name = args.ctl_command
    if name == "status":
        return c.GetStatus()
    if name == "set":
        return c.SetConfig(args.key, args.value)
    if name == "prefix-cache":
        return c.SetPrefixCaching(args.state == "on")
    if name == "reset-prefix-cache":
        return c.ResetPrefixCache()
    if name == "pause":
        return c.Pause()
    if name == "resume":
        return c.Resume()
    if name == "abort":
        return c.Abort(args.request_id)
    return c.InspectBlock(args.block_id)


def _onoff(v: object) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else str(v)


def format_status(s: dict) -> str:
    kv, c, cfg = s["kv"], s["counters"], s["config"]
    q, h = c["prefix_queries"], c["prefix_hits"]
    lines = [
        f"engine    {s['engine_state']}  model {s['model']} ({s['device']}, {s['dtype']}, "
        f"tp {s['tp_size']}, KV {size(s.get('kv_bytes_per_rank', 0))} per rank)  "
        f"uptime {s['uptime_s']:.0f}s",
        "config    "
        + "  ".join(
            f"{k}={_onoff(cfg[k])}"
            for k in (
                "max_num_batched_tokens",
                "max_num_seqs",
                "long_prefill_token_threshold",
                "enable_prefix_caching",
                "paused",
            )
            if k in cfg
        ),
        f"kv        {kv['num_used_blocks']}/{kv['num_blocks']} blocks in use "
        f"({kv['usage_perc']:.1%}), token slots {kv['token_usage_perc']:.1%}, "
        f"cached {kv['num_cached_free_blocks']}, free {kv['num_free_blocks']}, "
        f"block size {kv['block_size']}",
        f"counters  prefix hits {h}/{q} tokens ({(h / q if q else 0):.1%}), preemptions "
        f"{c['preemptions']}, prompt {c['prompt_tokens']}, generated {c['generation_tokens']}, "
        f"steps {c['steps']}, rejected {c['rejected']}",
        f"requests  running {s['num_running']}, waiting {s['num_waiting']}",
    ]
    if cfg.get("speculative_method", "none") != "none":
        drafts = c.get("spec_decode_num_drafts", 0)
        proposed = c.get("spec_decode_num_draft_tokens", 0)
        accepted = c.get("spec_decode_num_accepted_tokens", 0)
        lines.insert(
            2,
            f"spec      {cfg['speculative_method']} num_speculative_tokens="
            f"{cfg.get('num_speculative_tokens')}  acceptance "
            f"{(accepted / proposed if proposed else 0):.1%}, mean accepted length "
            f"{(1 + accepted / drafts if drafts else 0):.2f}",
        )
    reqs = s.get("requests") or []
    if reqs:
        lines.append(
            f"  {'REQUEST':<40} {'STATE':<9} {'PROMPT':>6} {'OUT':>5} {'CACHED':>6} "
            f"{'BLOCKS':>6} {'PREEMPT':>7}"
        )
        for r in reqs:
            rid = r["request_id"] + (f"#{r['index']}" if r["index"] else "")
            lines.append(
                f"  {rid:<40} {r['state']:<9} {r['num_prompt_tokens']:>6} "
                f"{r['num_output_tokens']:>5} {max(r['num_cached_tokens'], 0):>6} "
                f"{r['num_blocks']:>6} {r['num_preemptions']:>7}"
            )
    return "\n".join(lines)


def _format_result(name: str, result: dict) -> str:
    if name == "set" or name == "prefix-cache":
        return f"{result['name']}: {_onoff(result['old'])} -> {_onoff(result['new'])}"
    if name == "reset-prefix-cache":
        return f"prefix cache reset: {result['released_blocks']} cached blocks released"
    if name in ("pause", "resume"):
        was = "paused" if result.get("was_paused") else "running"
        now = "paused" if result.get("paused") else "running"
        return f"admission: {was} -> {now}"
    if name == "abort":
        return f"aborted {result['aborted']}"
    return json.dumps(result, indent=2)


def run(args: argparse.Namespace) -> int:
    from pagectl.admin.client import AdminClient, AdminError, default_client_name
    from pagectl.admin.runtime import RuntimeNotFound, find_runtime, read_token

    def err(msg: str, code: int) -> int:
        print(f"pagectl ctl: {msg}", file=sys.stderr)
        return code

    if args.control_endpoint:
        endpoint = args.control_endpoint
        token = read_token(args.token_file) if args.token_file else None
        token_src = args.token_file
    else:
        try:
            info = find_runtime(args.runtime_dir)
        except RuntimeNotFound as e:
            return err(str(e), EXIT_UNREACHABLE)
        endpoint, token, token_src = (
            info.control_endpoint,
            read_token(info.token_file),
            info.token_file,
        )
    if token is None:
        return err(
            f"cannot read the control token ({token_src or 'no --token-file'})", EXIT_UNREACHABLE
        )
    with AdminClient(endpoint, token, client_name=default_client_name("ctl")) as client:
        try:
            result = client.command(_command(args), timeout=args.timeout)
        except AdminError as e:
            if e.kind == "timeout":
                return err(e.message, EXIT_UNREACHABLE)
            return err(f"refused ({e.kind}): {e.message}", EXIT_REFUSED)
    name = args.ctl_command
    if name == "status":
        print(json.dumps(result, indent=2, sort_keys=True) if args.json else format_status(result))
    else:
        print(_format_result(name, result))
    return 0
