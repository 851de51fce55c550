"""``pagectl ctl``: scripted control of a running daemon over the admin channel.

Exit status: 0 done; 1 the daemon refused the command (the reason is printed); 2 usage
error, or several daemons and none chosen (the list is printed); 3 no daemon found, no
control token, or no answer in time.

The daemon is chosen with ``--url``, ``--port`` or ``--pid`` (``pagectl.cli.target``); with
several running and none chosen, ``ctl`` refuses and lists them: it never guesses.
"""

from __future__ import annotations

import argparse
import json
import sys

from pagectl.cli.target import add_target_arguments, selector
from pagectl.engine.live_config import LIVE_SETTINGS
from pagectl.tui.fmt import size

EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    p.add_argument(
        "--control-endpoint", default=None, help="control endpoint (instead of the runtime file)"
    )
    p.add_argument(
        "--token-file", default=None, help="control token file (with --control-endpoint)"
    )
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer")
    p.add_argument(
        "--engine",
        type=int,
        default=None,
        metavar="I",
        help="a data-parallel daemon: send the command to engine I only (default: to every "
        "engine; `watch` follows engine 0)",
    )
    sub = p.add_subparsers(dest="ctl_command", metavar="COMMAND", required=True)
    from pagectl.cli.ls import add_ls_options

    add_ls_options(sub.add_parser("ls", help="list the running daemons (same as `pagectl ls`)"))
    wt = sub.add_parser(
        "watch", help="a line a second: running, waiting, KV%%, tok/s, hit rate, preemptions"
    )
    wt.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds per line")
    wt.add_argument("--count", type=int, default=0, metavar="N", help="stop after N lines")
    lg = sub.add_parser("log", help="the audit trail: every control command, who, old -> new")
    lg.add_argument("--json", action="store_true", help="the records as JSON lines")
    lg.add_argument("-n", type=int, default=0, metavar="N", help="only the last N records")
    st = sub.add_parser("status", help="config, KV usage, counters, requests")
    st.add_argument("--json", action="store_true", help="the full status as JSON")
    st.add_argument(
        "--window",
        type=float,
        default=None,
        metavar="S",
        help="watch the telemetry for S seconds and print the verdicts (what to change) it "
        "gives; 0 skips them (default 3, and 0 with --json)",
    )
    s = sub.add_parser("set", help="change a live setting, e.g. `set max-num-batched-tokens 4096`")
    s.add_argument("key", help=", ".join(setting.flag for setting in LIVE_SETTINGS.values()))
    s.add_argument("value")
    s.add_argument(
        "--drain",
        action="store_true",
        help="lowering max-num-seqs never preempts (running requests finish, admission "
        "waits); with --drain, wait until fewer than the new cap run, printing the count",
    )
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="give up waiting for the drain after S seconds (exit 3; the cap stays)",
    )
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


def _memory_profile(mp: dict | None) -> str:
    if not mp:
        return ""
    return (
        f", GPU {mp['gpu_memory_utilization']:.0%} of {size(int(mp['total_bytes']))}: "
        f"{size(int(mp['used_after_load_bytes']))} in use after loading, "
        f"{size(int(mp['peak_activation_bytes']))} peak activation, "
        f"{size(int(mp['kv_budget_bytes']))} for KV"
    )


def format_status(s: dict) -> str:
    kv, c, cfg = s["kv"], s["counters"], s["config"]
    q, h = c["prefix_queries"], c["prefix_hits"]
    lines = [
        f"engine    {s['engine_state']}  model {s['model']} ({s['device']}, {s['dtype']}, "
        f"tp {s['tp_size']}, KV {size(s.get('kv_bytes_per_rank', 0))} per rank)  "
        f"uptime {s['uptime_s']:.0f}s",
        f"execution attention {s.get('attention_backend') or '?'}, KV cache "
        f"{s.get('kv_cache_dtype') or '?'}, CUDA graphs "
        + (f"up to batch {s['cuda_graph_max_batch']}" if s.get("cuda_graph_max_batch") else "off")
        + _memory_profile(s.get("memory_profile")),
        "config    "
        + "  ".join(f"{k}={_onoff(cfg[k])}" for k in (*LIVE_SETTINGS, "paused") if k in cfg),
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
            f"spec      {cfg['speculative_method']}"
            + (f" ({cfg['speculative_model']})" if cfg.get("speculative_model") else "")
            + " num_speculative_tokens="
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
            rid = r.get("seq_id") or r["request_id"] + (f"#{r['index']}" if r["index"] else "")
            if r.get("beam_width"):
                rid += f" (beam {r['beam_width']})"
            lines.append(
                f"  {rid:<40} {r['state']:<9} {r['num_prompt_tokens']:>6} "
                f"{r['num_output_tokens']:>5} {r['num_cached_tokens']:>6} "
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
    from pagectl.control.client import AdminClient, AdminError
    from pagectl.control.runtime import RuntimeNotFound, read_token
    from pagectl.control.selection import AmbiguousRuntime, select_runtime

    def err(msg: str, code: int) -> int:
        print(f"pagectl ctl: {msg}", file=sys.stderr)
        return code

    if args.ctl_command == "ls":
        from pagectl.cli import ls

        return ls.run(args)
    if args.control_endpoint and args.ctl_command in ("log", "watch"):
        return err(
            f"`{args.ctl_command}` reads the daemon's runtime file: choose the daemon with "
            "--url/--port/--pid",
            EXIT_USAGE,
        )
    info = None
    targets: list[tuple[int | None, str, str | None]]
    if args.control_endpoint:
        if args.engine is not None:
            msg = "--engine chooses among the runtime file's engines: drop --control-endpoint"
            return err(msg, EXIT_USAGE)
        targets = [(None, args.control_endpoint, None)]
        token = read_token(args.token_file) if args.token_file else None
        token_src = args.token_file
    else:
        try:
            info = select_runtime(args.runtime_dir, selector(args))
        except AmbiguousRuntime as e:
            return err(str(e), EXIT_USAGE)
        except RuntimeNotFound as e:
            return err(str(e), EXIT_UNREACHABLE)
        try:
            targets = engine_targets(info, args.engine)
        except ValueError as e:
            return err(str(e), EXIT_USAGE)
        if args.ctl_command == "log":
            return _print_log(info, args)
        if args.ctl_command == "watch":
            from pagectl.cli.snapshot_out import watch

            telemetry = targets[0][2]
            assert telemetry is not None
            return watch(telemetry, args.interval, args.count, args.timeout, _sub_token(info))
        token, token_src = read_token(info.token_file), info.token_file
    if token is None:
        return err(
            f"cannot read the control token ({token_src or 'no --token-file'})", EXIT_UNREACHABLE
        )
    if len(targets) == 1:
        return _one(args, info, targets[0], token, AdminClient, AdminError, err)
    return _each(args, info, targets, token, AdminClient, AdminError, err)


def engine_targets(info, engine: int | None) -> list[tuple[int | None, str, str | None]]:
    """(engine index or None, control endpoint, telemetry endpoint) of each engine the
    command goes to: ``engine`` only, or every engine of a data-parallel daemon."""
    if not info.engines:
        if engine not in (None, 0):
            raise ValueError(f"--engine {engine}: this daemon runs one engine (0)")
        return [(None, info.control_endpoint, info.telemetry_endpoint)]
    rows = [(e.index, e.control_endpoint, e.telemetry_endpoint) for e in info.engines]
    if engine is None:
        return rows
    for row in rows:
        if row[0] == engine:
            return [row]
    raise ValueError(f"--engine {engine}: this daemon runs engines 0..{len(rows) - 1}")


def _one(args, info, target, token, AdminClient, AdminError, err) -> int:
    """The command to one engine, its answer printed as without data parallelism."""
    from pagectl.control.client import default_client_name

    _, endpoint, telemetry = target
    with AdminClient(endpoint, token, client_name=default_client_name("ctl")) as client:
        try:
            result = client.command(_command(args), timeout=args.timeout)
        except AdminError as e:
            if e.kind == "timeout":
                return err(e.message, EXIT_UNREACHABLE)
            return err(f"refused ({e.kind}): {e.message}", EXIT_REFUSED)
        name = args.ctl_command
        if name == "status":
            secs = args.window if args.window is not None else (0.0 if args.json else 3.0)
            found = _verdicts(telemetry, secs, _sub_token(info)) if telemetry and secs > 0 else None
            if args.json:
                if found is not None:
                    result["verdicts"] = [
                        {"rule": v.rule, "knob": v.knob, "message": v.message} for v in found
                    ]
                print(json.dumps(result, indent=2, sort_keys=True))
                return 0
            print(format_status(result))
            if found is not None:
                print(format_verdicts(found, secs))
            return 0
        if name == "inspect-block" and info is not None and info.tokenizer_path:
            result["text"] = _detokenize(info.tokenizer_path, result.get("token_ids") or [])
        print(_format_result(name, result), flush=True)
        if name == "set" and args.drain and result.get("name") == "max_num_seqs":
            return _wait_for_drain(client, int(result["new"]), args)
    return 0


def _each(args, info, targets, token, AdminClient, AdminError, err) -> int:
    """The command to every engine of a data-parallel daemon, in rank order: each answer
    under an ``engine I`` heading (``status --json``: ``{"engines": [...]}``). Exit 0 when
    every engine did it, except ``abort``: 0 when the engine holding the request did."""
    from pagectl.control.client import default_client_name

    name = args.ctl_command
    codes, rows = [], []
    for index, endpoint, telemetry in targets:
        if not (args.json and name == "status"):
            print(f"engine {index}", flush=True)
        if name != "status" or not args.json:
            target = (index, endpoint, telemetry)
            codes.append(_one(args, info, target, token, AdminClient, AdminError, err))
            continue
        with AdminClient(endpoint, token, client_name=default_client_name("ctl")) as client:
            try:
                rows.append(
                    {"engine": index, **client.command(_command(args), timeout=args.timeout)}
                )
                codes.append(0)
            except AdminError as e:
                codes.append(EXIT_UNREACHABLE if e.kind == "timeout" else EXIT_REFUSED)
                err(f"engine {index}: refused ({e.kind}): {e.message}", 0)
    if rows or (args.json and name == "status"):
        print(json.dumps({"engines": rows}, indent=2, sort_keys=True))
    if name == "abort":
        return 0 if 0 in codes else max(codes)
    return max(codes)


def _detokenize(path: str, ids: list[int]) -> str | None:
    """The block's text with the model's tokenizer, here (the engine answers with ids)."""
    from pagectl.tui.detokenize import Detokenizer

    return Detokenizer(lambda: path).decode(ids) if ids else ""


def _sub_token(info) -> str | None:
    """The token the daemon's telemetry asks of subscribers (None: it asks none)."""
    from pagectl.control.telemetry_auth import subscriber_token

    return subscriber_token(info.telemetry_endpoint, info.token_file, info.telemetry_auth)


def _verdicts(endpoint: str, seconds: float, token: str | None = None) -> list:
    """The verdict rules over ``seconds`` of the daemon's telemetry."""
    import time

    from pagectl.control.client import TelemetrySubscriber
    from pagectl.control.verdicts import slim, verdicts

    history: list = []
    deadline = time.monotonic() + seconds
    with TelemetrySubscriber(endpoint, token=token) as sub:
        while (left := deadline - time.monotonic()) > 0:
            snap = sub.recv(timeout=left)
            if snap is not None and (not history or snap.time - history[-1].time >= 0.5):
                history.append(slim(snap))
    return verdicts(history)


def format_verdicts(found: list, seconds: float) -> str:
    if not found:
        return f"verdicts  none over the last {seconds:g}s"
    return "\n".join(f"{'verdicts' if i == 0 else '':<9} {v.message}" for i, v in enumerate(found))


def format_audit(rec) -> str:
    """One line of the audit trail for people."""
    import time

    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.time))
    who = rec.client or "?"
    if rec.credentials != "none":
        who += f" uid={rec.uid} pid={rec.pid} ({rec.credentials})"
    cmd = dict(rec.command)
    what = str(cmd.pop("cmd", "?"))
    if rec.name is not None:
        what += f" {rec.name}: {_onoff(rec.old)} -> {_onoff(rec.new)}"
    elif cmd:
        what += " " + " ".join(f"{k}={_onoff(v)}" for k, v in cmd.items())
    outcome = "ok" if rec.outcome == "ok" else f"REFUSED {rec.outcome}: {rec.message}"
    return f"{when}  {who}  {what}  {outcome}"


def _print_log(info, args: argparse.Namespace) -> int:
    from pagectl.control.audit import read_audit

    if not info.audit_file:
        print("pagectl ctl: this daemon keeps no audit file", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        records = read_audit(info.audit_file)
    except FileNotFoundError:
        records = []  # no command yet
    except OSError as e:
        print(f"pagectl ctl: cannot read {info.audit_file}: {e.strerror}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.n > 0:
        records = records[-args.n :]
    import msgspec

    for rec in records:
        print(msgspec.json.encode(rec).decode() if args.json else format_audit(rec))
    return 0


def _wait_for_drain(client, cap: int, args: argparse.Namespace) -> int:
    """Poll the status until at most ``cap`` sequences run; a line per change of the count."""
    import time

    from pagectl.control.client import AdminError
    from pagectl.engine.commands import GetStatus

    deadline = time.monotonic() + args.drain_timeout
    last = None
    while True:
        try:
            running = int(client.command(GetStatus(), timeout=args.timeout)["num_running"])
        except AdminError as e:
            print(f"pagectl ctl: {e.kind}: {e.message}", file=sys.stderr)
            return EXIT_UNREACHABLE
        if running <= cap:
            print(f"drained: {running} running (cap {cap})")
            return 0
        if running != last:
            print(f"draining to {cap} (now {running})", flush=True)
            last = running
        if time.monotonic() >= deadline:
            print(
                f"pagectl ctl: still {running} running after {args.drain_timeout:g}s "
                f"(the cap {cap} stays)",
                file=sys.stderr,
            )
            return EXIT_UNREACHABLE
        time.sleep(0.2)
