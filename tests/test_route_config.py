"""``pagectl route --config FILE``: every flag as a TOML key, flags over the file, bad files
refused naming the key; the router's timeouts and ``GET /router/backends`` against small
aiohttp backends standing in for daemons."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from pagectl.cli import build_parser
from pagectl.router.backends import Backend, BackendSpec, parse_backend
from pagectl.router.config import KEYS, ConfigError, RouteSettings, read_config, settings_from
from pagectl.router.proxy import Router, create_router_app
from pagectl.routing.policy import RoutingPolicy

FULL = """
host = "127.0.0.2"
port = 9090
routing = "load"
max-skew = 2
health_interval = 0.5
health_timeout = 3
connect_timeout = 1.5
request_timeout = 120
log_level = "debug"
backends = [
    "http://127.0.0.1:8000,kv_events=tcp://127.0.0.1:5557",
    { url = "http://127.0.0.1:8001", kv_events = "tcp://127.0.0.1:5567", replay = "tcp://127.0.0.1:5568", topic = "kv" },
]
"""


def route_args(*argv: str):
    return build_parser(["route", *argv]).parse_args(["route", *argv])


def write(tmp_path, text: str) -> str:
    path = tmp_path / "router.toml"
    path.write_text(text)
    return str(path)


def test_every_flag_has_a_key_and_the_file_sets_them_all(tmp_path):
    s = settings_from(route_args("--config", write(tmp_path, FULL)))
    assert s == RouteSettings(
        backends=[
            BackendSpec("http://127.0.0.1:8000", "tcp://127.0.0.1:5557"),
            BackendSpec(
                "http://127.0.0.1:8001", "tcp://127.0.0.1:5567", "tcp://127.0.0.1:5568", "kv"
            ),
        ],
        host="127.0.0.2",
        port=9090,
        routing="load",
        max_skew=2,
        health_interval=0.5,
        health_timeout=3.0,
        connect_timeout=1.5,
        request_timeout=120.0,
        log_level="debug",
    )
    # Every flag of pagectl route (but --config itself) is a key of the file.
    p = build_parser(["route"])._subparsers._group_actions[0].choices["route"]  # type: ignore[union-attr]
    flags = {a.dest for a in p._actions if a.dest not in ("help", "config", "_module")}
    assert flags - {"backend"} | {"backends"} == set(KEYS)


def test_flags_override_the_file_and_backend_replaces_its_list(tmp_path):
    path = write(tmp_path, FULL)
    s = settings_from(
        route_args("--config", path, "--max-skew", "7", "--port", "8181", "--request-timeout", "0")
    )
    assert (s.max_skew, s.port, s.request_timeout, s.routing) == (7, 8181, None, "load")
    assert len(s.backends) == 2
    s = settings_from(route_args("--config", path, "--backend", "http://127.0.0.1:9000"))
    assert s.backends == [BackendSpec("http://127.0.0.1:9000")]
    # No file: the built-in defaults, and the flags.
    s = settings_from(route_args("--backend", "http://127.0.0.1:9000", "--routing", "round_robin"))
    assert (s.routing, s.max_skew, s.health_interval, s.connect_timeout) == (
        "round_robin",
        4,
        1.0,
        5.0,
    )
    assert s.health_timeout is None and s.request_timeout is None and s.host == "127.0.0.1"


@pytest.mark.parametrize(
    "text, message",
    [
        ('max_skw = 3\nbackends = ["http://a:1"]', "unknown key 'max_skw'"),
        ('max_skew = "3"', "max_skew must be an integer"),
        ("max_skew = -1", "max_skew must be >= 0, not -1"),
        ("health_interval = 0", "health_interval must be > 0, not 0"),
        ("request_timeout = -5", "request_timeout must be >= 0 (0: none), not -5"),
        ("port = 70000", "port must be between 1 and 65535, not 70000"),
        ("port = true", "port must be an integer"),
        ('routing = "fastest"', "routing must be one of prefix, load, round_robin, not 'fastest'"),
        ('log_level = "trace"', "log_level must be one of debug, info, warning"),
        ("backends = []", "backends must be a non-empty list"),
        ('backends = ["ftp://x"]', "backends[0]: --backend 'ftp://x': the first item must be"),
        (
            'backends = [{ url = "http://a:1", kv_event = "tcp://x" }]',
            "backends[0]: unknown key 'kv_event'",
        ),
        ('backends = [{ kv_events = "tcp://x" }]', "backends[0] has no url"),
        ("backends = [3]", "backends[0] must be a URL string or a table"),
        ("max_skew = 1\nmax-skew = 2", "max_skew is set twice"),
        ("routing = ", "is not valid TOML"),
    ],
)
def test_bad_files_are_refused_naming_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        read_config(path)
    assert path in str(e.value) and message in str(e.value)


def test_the_command_refuses_a_bad_file_and_no_backend(tmp_path, capsys):
    from pagectl.cli import main

    assert main(["route", "--config", write(tmp_path, "max_skew = -2")]) == 2
    assert "router.toml: max_skew must be >= 0" in capsys.readouterr().err
    assert main(["route", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert main(["route"]) == 2
    assert "no backend: give --backend" in capsys.readouterr().err
    assert main(["route", "--backend", "http://127.0.0.1:1", "--health-interval", "0"]) == 2
    assert "--health-interval: health_interval must be > 0" in capsys.readouterr().err


# -- the router's timeouts and its backend listing ------------------------------------------


def fake_daemon(delay: float = 0.0) -> web.Application:
    """/health, /metrics and a completions endpoint that answers after ``delay`` s."""
    app = web.Application()

    async def health(request):
        return web.json_response({"status": "ok"})

    async def metrics(request):
        text = (
            "pagectl:num_requests_running 2\npagectl:num_requests_waiting 1\n"
            "pagectl:kv_cache_usage_perc 0.25\n"
            'pagectl:cache_config_info{block_size="16"} 1\n'
        )
        return web.Response(text=text)

    async def completions(request):
        await asyncio.sleep(delay)
        return web.json_response({"choices": [{"text": "ok"}]})

    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/completions", completions)
    return app


async def test_router_backends_lists_each_backend_and_a_slow_one_times_out(
    aiohttp_server, aiohttp_client
):
    slow = await aiohttp_server(fake_daemon(delay=5.0))
    url = f"http://127.0.0.1:{slow.port}"
    router = Router(
        [Backend(parse_backend(url)), Backend(BackendSpec("http://127.0.0.1:9"))],
        RoutingPolicy("load", max_skew=3),
        health_interval=0.2,
        health_timeout=0.5,
        connect_timeout=0.5,
        request_timeout=0.5,
    )
    client = await aiohttp_client(create_router_app(router))
    r = await client.get("/router/backends")
    assert r.status == 200
    body = await r.json()
    assert (body["routing"], body["max_skew"]) == ("load", 3)
    first, down = body["backends"]
    assert first["url"] == url and first["alive"] is True and first["num_requests"] == 3
    assert first["kv_usage"] == 0.25 and first["block_size"] == 16
    assert down == {**down, "url": "http://127.0.0.1:9", "alive": False}

    # Past --request-timeout: a 504 naming the backend, no retry, and the backend stays up.
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status == 504
    err = (await r.json())["error"]
    assert url in err["message"] and "request timeout (0.5 s)" in err["message"]
    assert router.backends[0].load.alive and router.backends[0].load.inflight == 0
