"""``pagectl daemon``: serve a model over an OpenAI-compatible HTTP API, with the admin
channel that ``pagectl top`` and ``pagectl ctl`` attach to. Flags follow vLLM's names where
the meaning is the same."""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

from pagectl.engine.args import EngineArgs, add_cli_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as `vllm serve MODEL` takes it (same as --model)",
    )
    # The engine's flags (model, KV cache and scheduler), then the daemon's own.
    add_cli_arguments(p, skip=("served_model_name",))
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names the API accepts; the first is the one it reports (default: the model's)",
    )
    # None tells "not given" apart, so that giving it on CPU can be warned about.
    p.set_defaults(gpu_memory_utilization=None)

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default loopback)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY`; visible to local users in the process "
        "list, prefer --api-key-file or $PAGECTL_API_KEY",
    )
    s.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="read the API key from the first line of PATH (default: $PAGECTL_API_KEY, "
        "else no key)",
    )
    s.add_argument(
        "--auth-allow",
        action="append",
        default=None,
        metavar="PATH",
        help="path reachable without the API key (repeatable; default /health, /metrics)",
    )
    s.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="CORS: origins allowed to call the API from a browser (* for any; default none)",
    )
    s.add_argument(
        "--max-num-queued-requests",
        type=int,
        default=None,
        help="requests queued for the engine beyond which new ones get 503 + Retry-After",
    )
    s.add_argument(
        "--max-request-body-size",
        type=int,
        default=8 * 1024 * 1024,
        help="largest request body in bytes (413 beyond; default 8 MiB)",
    )
    s.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=2 * 1024 * 1024,
        help="largest text prompt (UTF-8 bytes, a request's prompts or messages together), "
        "refused with 400 before tokenization (default 2 MiB)",
    )
    s.add_argument(
        "--http-header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection gets to send a complete request head (default 10)",
    )
    s.add_argument(
        "--http-body-timeout",
        type=float,
        default=60.0,
        help="seconds to receive a request body, 408 past it (default 60)",
    )
    s.add_argument(
        "--http-keepalive-timeout",
        type=float,
        default=15.0,
        help="seconds an idle keep-alive connection stays open (default 15)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="most open HTTP connections; past it the oldest idle one is closed (default: "
        "half the open-file limit, at most 4096)",
    )
    s.add_argument(
        "--health-stall-timeout",
        type=float,
        default=30.0,
        help="/health answers 503 when the engine has sent nothing for this many seconds "
        "(default 30; 0: off; keep it above the longest step)",
    )
    s.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM (default 30)",
    )

    o = p.add_argument_group("structured outputs, tools, chat templates, reasoning")
    o.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_STRING",
        help="chat template (a file or the template text) instead of the tokenizer's",
    )
    o.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="let a request bring its own chat_template (it runs sandboxed either way)",
    )
    o.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='allow tool_choice "auto" (needs --tool-call-parser)',
    )
    o.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="how tool calls look in this model's output: hermes, llama3_json, mistral",
    )
    o.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="put <think> text in reasoning_content: qwen3, deepseek_r1",
    )

    a = p.add_argument_group("admin channel")
    a.add_argument(
        "--runtime-dir",
        default=None,
        help="where the runtime file, token and sockets go (default: "
        "$PAGECTL_RUNTIME_DIR, $XDG_RUNTIME_DIR/pagectl or ~/.cache/pagectl/run)",
    )
    a.add_argument(
        "--admin-telemetry-endpoint",
        default=None,
        help="telemetry PUB endpoint (ipc:// or loopback tcp://; default ipc in runtime dir)",
    )
    a.add_argument(
        "--admin-control-endpoint",
        default=None,
        help="control ROUTER endpoint (ipc:// or loopback tcp://; default ipc in runtime dir)",
    )
    a.add_argument(
        "--telemetry-public",
        action="store_true",
        help="ask no token of telemetry subscribers on an endpoint other local users can "
        "reach (loopback tcp:// or abstract ipc://@); by default they must present it",
    )
    a.add_argument(
        "--telemetry-hz", type=float, default=10.0, help="snapshots per second (default 10)"
    )
    a.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help='publish KV-cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", '
        '"replay_endpoint": "tcp://127.0.0.1:5558"}\' (docs/KV_EVENTS.md)',
    )
    a.add_argument(
        "--kv-events-allow-remote",
        action="store_true",
        help="let --kv-events-config bind or connect off loopback",
    )
    d = p.add_argument_group("data parallel (docs/DATA_PARALLEL.md)")
    d.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        metavar="N",
        help="engine processes behind the API server, each with its own KV cache, scheduler "
        "and model replica (each of --tensor-parallel-size ranks)",
    )
    d.add_argument(
        "--data-parallel-size-local",
        "-dpl",
        type=int,
        default=None,
        metavar="N",
        help="engines on this node (one node only: equal to --data-parallel-size)",
    )
    d.add_argument(
        "--dp-cpu-threads",
        type=int,
        default=None,
        metavar="T",
        help="CPU: torch threads per engine, split over its TP ranks (default: the cores "
        "split evenly between the engines)",
    )
    d.add_argument(
        "--dp-routing",
        choices=("prefix", "load", "round_robin"),
        default=None,
        help="how a request picks its engine: prefix (the engine holding the longest cached "
        "prefix, per its KV events, within --dp-max-skew; the default), load (the least "
        "loaded), round_robin",
    )
    d.add_argument(
        "--dp-max-skew",
        type=int,
        default=None,
        metavar="R",
        help="prefix routing sends a request to a busier engine only while its load exceeds "
        "the least loaded one's by at most R requests (default 4)",
    )
    d.add_argument(
        "--exit-on-engine-death",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="exit 1 (after draining the others) when any engine dies; default: serve on "
        "with the survivors, /health reports degraded, exit 1 when the last dies",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning"),
        help="the API server's log level (debug: every data-parallel routing decision's inputs)",
    )
    p.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)


def _chat_settings(args: argparse.Namespace):
    """The chat options, checked (ValueError names the flag)."""
    from pagectl.server.chat import ChatSettings
    from pagectl.server.chat_template import load_template
    from pagectl.server.reasoning import PARSERS as REASONING_PARSERS
    from pagectl.server.tools.parsers import PARSERS as TOOL_PARSERS

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    if args.tool_call_parser and args.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser must be one of {', '.join(sorted(TOOL_PARSERS))}, "
            f"got {args.tool_call_parser!r}"
        )
    if args.reasoning_parser and args.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, "
            f"got {args.reasoning_parser!r}"
        )
    return ChatSettings(
        chat_template=load_template(args.chat_template),
        trust_request_chat_template=args.trust_request_chat_template,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )


def _port_busy(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now (checked before the engine loads), or None."""
    import socket

    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return None  # the server reports an unusable host itself
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return e.strerror or str(e)
    return None


def run(args: argparse.Namespace) -> int:
    from pagectl.control.runtime import loopback_only
    from pagectl.daemon.lifecycle import DaemonOptions
    from pagectl.daemon.lifecycle import run as run_daemon
    from pagectl.server.connections import ConnectionLimits
    from pagectl.server.state import DEFAULT_AUTH_ALLOW, ServerSettings

    def fail(msg: str) -> int:
        print(f"pagectl daemon: {msg}", file=sys.stderr)
        return 2

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            return fail(f"the model is given twice: {args.model_tag} and --model {args.model}")
        args.model = args.model_tag
    names = args.served_model_name or []
    if args.gpu_memory_utilization is not None and args.device == "cpu":
        print(
            "pagectl daemon: warning: --gpu-memory-utilization has no effect on CPU "
            "(size the KV cache with --kv-cache-memory or --num-kv-blocks)",
            file=sys.stderr,
        )
    busy = _port_busy(args.host, args.port)
    if busy:
        return fail(f"cannot listen on {args.host}:{args.port}: {busy}")
    try:
        engine_args = EngineArgs.from_cli(
            args,
            served_model_name=names[0] if names else None,
            gpu_memory_utilization=args.gpu_memory_utilization or 0.9,
        )
        chat = _chat_settings(args)
        for ep in (args.admin_telemetry_endpoint, args.admin_control_endpoint):
            if ep:
                loopback_only(ep)
        kv_events = None
        if args.kv_events_config is not None:
            from pagectl.engine_process.kv_events import parse_kv_events_config

            kv_cfg = parse_kv_events_config(
                args.kv_events_config, allow_remote=args.kv_events_allow_remote
            )
            kv_events = msgspec.to_builtins(kv_cfg) if kv_cfg.active else None
    except ValueError as e:
        return fail(str(e))
    if args.max_num_queued_requests is not None and args.max_num_queued_requests < 0:
        return fail("--max-num-queued-requests must be >= 0")
    if args.max_connections is not None and args.max_connections < 1:
        return fail("--max-connections must be >= 1")
    for flag in ("http_header_timeout", "http_body_timeout", "http_keepalive_timeout"):
        if getattr(args, flag) < 0:
            return fail(f"--{flag.replace('_', '-')} must be >= 0 (0: no timeout)")
    if args.telemetry_hz <= 0 or args.telemetry_hz > 100:
        return fail("--telemetry-hz must be in (0, 100]")
    dp_error = _check_data_parallel(args)
    if dp_error:
        return fail(dp_error)
    # Where the tokenizer will come from, so the API server can load it while the engine
    # builds (None model: the built-in one, pagectl/assets/pycoder as in engine/builder.py).
    builtin = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "pycoder")
    hint = args.tokenizer or args.model or builtin
    if args.api_key and args.api_key_file:
        return fail("give --api-key or --api-key-file, not both")
    api_key = args.api_key
    if api_key:
        print(
            "pagectl daemon: warning: --api-key is visible to every local user in the "
            "process list; use --api-key-file or $PAGECTL_API_KEY",
            file=sys.stderr,
        )
    elif args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                api_key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            return fail(f"cannot read --api-key-file: {e}")
        if not api_key:
            return fail(f"--api-key-file {args.api_key_file} holds no key")
    api_key = api_key or os.environ.get("PAGECTL_API_KEY") or None
    settings = ServerSettings(
        served_model_name=names[0] if names else None,
        served_model_aliases=tuple(names[1:]),
        allowed_origins=tuple(args.allowed_origins or ()),
        api_keys=[api_key] if api_key else [],
        auth_allow=tuple(args.auth_allow) if args.auth_allow is not None else DEFAULT_AUTH_ALLOW,
        max_num_queued_requests=args.max_num_queued_requests,
        max_body_size=args.max_request_body_size,
        max_prompt_bytes=args.max_prompt_bytes,
        health_stall_timeout=args.health_stall_timeout,
        connection_limits=ConnectionLimits(
            header_timeout=args.http_header_timeout,
            body_timeout=args.http_body_timeout,
            keepalive_timeout=args.http_keepalive_timeout,
            max_connections=args.max_connections,
        ),
        tokenizer_hint=hint if hint and os.path.isdir(hint) else None,
        chat=chat,
    )
    opts = DaemonOptions(
        engine_args=engine_args,
        server=settings,
        host=args.host,
        port=args.port,
        runtime_dir=args.runtime_dir,
        telemetry_endpoint=args.admin_telemetry_endpoint,
        control_endpoint=args.admin_control_endpoint,
        engine_factory=args.engine_factory,
        drain_timeout=args.drain_timeout,
        telemetry_hz=args.telemetry_hz,
        telemetry_public=args.telemetry_public,
        kv_events_config=kv_events,
        data_parallel_size=args.data_parallel_size,
        dp_cpu_threads=args.dp_cpu_threads,
        dp_routing=args.dp_routing or "prefix",
        dp_max_skew=4 if args.dp_max_skew is None else args.dp_max_skew,
        exit_on_engine_death=args.exit_on_engine_death,
        log_level=args.log_level,
    )
    return run_daemon(opts)


def _check_data_parallel(args: argparse.Namespace) -> str | None:
    """What is wrong with the data-parallel flags, or None."""
    n = args.data_parallel_size
    if n < 1:
        return "--data-parallel-size must be >= 1"
    local = args.data_parallel_size_local
    if local is not None and local != n:
        return (
            f"--data-parallel-size-local {local} differs from --data-parallel-size {n}: "
            "data parallelism across nodes is not supported (one node runs every engine)"
        )
    if n == 1:
        for flag in ("dp_cpu_threads", "dp_routing", "dp_max_skew"):
            if getattr(args, flag) is not None:
                name = "--" + flag.replace("_", "-")
                return f"{name} needs --data-parallel-size > 1"
        return None
    if args.dp_cpu_threads is not None:
        if args.dp_cpu_threads < 1:
            return "--dp-cpu-threads must be >= 1"
        if args.num_threads is not None:
            return "give --dp-cpu-threads (per engine) or --num-threads (per rank), not both"
        if args.device.startswith("cuda"):
            return "--dp-cpu-threads applies to CPU engines only"
    if args.dp_max_skew is not None and args.dp_max_skew < 0:
        return "--dp-max-skew must be >= 0"
    return None
