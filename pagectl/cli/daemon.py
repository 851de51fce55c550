"""``pagectl daemon``: serve a model over an OpenAI-compatible HTTP API, with the admin
channel that ``pagectl top`` and ``pagectl ctl`` attach to. Flags follow vLLM's names where
the meaning is the same."""

from __future__ import annotations

import argparse
import os
import sys

import msgspec

from pagectl.engine.args import ATTENTION_BACKENDS, DTYPES, GENERATION_CONFIG_MODES


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=None,
        help="Hugging Face model directory or hub id (default: the built-in model)",
    )
    m.add_argument(
        "--tokenizer", default=None, help="tokenizer directory or id (default: the model's)"
    )
    m.add_argument(
        "--served-model-name",
        default=None,
        help="name the API reports and accepts (default: the model's)",
    )
    m.add_argument("--dtype", choices=DTYPES, default="auto")
    m.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    m.add_argument(
        "--tp",
        "--tensor-parallel-size",
        dest="tensor_parallel_size",
        type=int,
        default=1,
        help="tensor-parallel ranks (default 1)",
    )
    m.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
    m.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    m.add_argument("--num-threads", type=int, default=None, help="CPU threads for torch")
    m.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto (default): flash-attn on CUDA when usable, else the compiled CPU kernel, "
        "else torch",
    )
    m.add_argument(
        "--generation-config",
        choices=GENERATION_CONFIG_MODES,
        default="auto",
        help="auto (default): a request's unset sampling fields take the model's "
        "generation_config.json values; none: the engine's own defaults",
    )

    c = p.add_argument_group("KV cache and scheduler")
    c.add_argument("--block-size", type=int, default=16, help="token slots per KV block")
    size = c.add_mutually_exclusive_group()
    size.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks")
    size.add_argument("--kv-cache-memory", default=None, help="KV memory budget, e.g. 4GiB")
    size.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="CUDA: fraction of GPU memory for weights + KV (default 0.9)",
    )
    c.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step (live; default 2048 CPU / 8192 CUDA)",
    )
    c.add_argument(
        "--max-num-seqs",
        type=int,
        default=256,
        help="most sequences running at once (live, up to this start-up value)",
    )
    c.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output")
    c.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefix caching (live; default on)",
    )
    c.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="most prompt tokens one request prefills per step (live; 0: no cap)",
    )
    c.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default loopback)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` (default: $PAGECTL_API_KEY, else none)",
    )
    s.add_argument(
        "--auth-allow",
        action="append",
        default=None,
        metavar="PATH",
        help="path reachable without the API key (repeatable; default /health, /metrics)",
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
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM (default 30)",
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
    p.add_argument("--engine-factory", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from pagectl.cli.generate import engine_kwargs
    from pagectl.control.runtime import loopback_only
    from pagectl.daemon.lifecycle import DaemonOptions
    from pagectl.daemon.lifecycle import run as run_daemon
    from pagectl.engine.args import EngineArgs
    from pagectl.server.state import DEFAULT_AUTH_ALLOW, ServerSettings

    def fail(msg: str) -> int:
        print(f"pagectl daemon: {msg}", file=sys.stderr)
        return 2

    try:
        # The flags ``pagectl generate`` shares, then the daemon's own.
        engine_args = EngineArgs(
            **engine_kwargs(args),
            served_model_name=args.served_model_name,
            gpu_memory_utilization=args.gpu_memory_utilization or 0.9,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            scheduling_policy=args.scheduling_policy,
        )
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
    if args.telemetry_hz <= 0 or args.telemetry_hz > 100:
        return fail("--telemetry-hz must be in (0, 100]")
    # Where the tokenizer will come from, so the API server can load it while the engine
    # builds (None model: the built-in one, pagectl/assets/pycoder as in engine/builder.py).
    builtin = os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", "pycoder")
    hint = args.tokenizer or args.model or builtin
    api_key = args.api_key or os.environ.get("PAGECTL_API_KEY") or None
    settings = ServerSettings(
        served_model_name=args.served_model_name,
        api_keys=[api_key] if api_key else [],
        auth_allow=tuple(args.auth_allow) if args.auth_allow is not None else DEFAULT_AUTH_ALLOW,
        max_num_queued_requests=args.max_num_queued_requests,
        max_body_size=args.max_request_body_size,
        tokenizer_hint=hint if hint and os.path.isdir(hint) else None,
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
        kv_events_config=kv_events,
    )
    return run_daemon(opts)
