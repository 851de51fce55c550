"""HTTP connection limits: header, body and idle timeouts, the connection cap, parser errors.

Under ``ulimit -n 256``, 300 silent or slowloris connections once held the server down for
as long as they stayed open. The in-process tests drive ``GuardedAppRunner`` over real
sockets; the last one runs a daemon with RLIMIT_NOFILE 256 against 300 idle connections.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from aiohttp import web
from test_api_errors import assert_openai_error
from test_engine_frames import fake_daemon

from pagectl.engine.args import EngineArgs
from pagectl.server.app import create_app
from pagectl.server.connections import ConnectionLimits, GuardedAppRunner
from pagectl.server.state import ServerSettings
from pagectl.testing.fake_engine import fake_engine
from pagectl.testing.in_process import InProcessEngine

_BODY = b'{"prompt": [5, 6, 7], "max_tokens": 2}'
REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)


async def _serve(limits: ConnectionLimits):
    engine = InProcessEngine(fake_engine(EngineArgs(num_kv_blocks=32)))
    app = create_app(ServerSettings(connection_limits=limits), engine)
    runner = GuardedAppRunner(app, limits, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


async def _read_all(reader: asyncio.StreamReader, timeout: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


async def _read_response(reader: asyncio.StreamReader, timeout: float) -> bytes:
    async with asyncio.timeout(timeout):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        return head + await reader.readexactly(length)


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body[body.index(b"{") : body.rindex(b"}") + 1])


@pytest.fixture
async def server():
    made = []

    async def make(**kw):
        runner, port = await _serve(ConnectionLimits(**kw))
        made.append(runner)
        return runner, port

    yield make
    for runner in made:
        await runner.cleanup()


async def _closed(reader: asyncio.StreamReader) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), 0.02) == b""
    except TimeoutError:
        return False


async def test_a_slowloris_is_closed_at_the_header_timeout(server):
    _, port = await server(header_timeout=0.5, keepalive_timeout=30)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    t0 = time.monotonic()
    head = b"POST /v1/completions HTTP/1.1\r\nX-Slow: " + b"a" * 100
    closed = False
    for i in range(len(head)):  # one byte every ~0.05 s: never a complete head
        try:
            writer.write(head[i : i + 1])
            await writer.drain()
        except ConnectionError:
            closed = True
        closed = closed or await _closed(reader)
        if closed:
            break
        await asyncio.sleep(0.03)
    assert closed and time.monotonic() - t0 < 2.5
    writer.close()


async def test_a_silent_connection_is_closed_and_a_served_one_stays_for_keepalive(server):
    _, port = await server(header_timeout=0.4, keepalive_timeout=0.8)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await _read_all(reader, 3.0) == b""  # silent: closed at the header timeout
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3.0)
    assert b" 200 " in head.split(b"\r\n")[0]
    t0 = time.monotonic()
    await _read_all(reader, 5.0)  # then idle: closed at the keep-alive timeout
    assert 0.3 < time.monotonic() - t0 < 3.0
    writer.close()


async def test_a_body_that_does_not_arrive_gets_408(server):
    _, port = await server(body_timeout=0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST[:-10])  # the head and part of the body, then nothing
    t0 = time.monotonic()
    status, body = _status_and_json(await _read_response(reader, 5.0))
    assert time.monotonic() - t0 < 2.0
    assert status == 408
    assert_openai_error(body)
    writer.close()


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 20000 + b"\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    ],
    ids=["bad-request-line", "header-too-long", "bad-content-length"],
)
async def test_parser_errors_come_in_the_openai_shape(server, raw):
    _, port = await server()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    status, body = _status_and_json(await _read_response(reader, 5.0))
    assert 400 <= status < 500
    assert_openai_error(body)
    writer.close()


async def test_past_the_cap_the_oldest_idle_connection_makes_room(server):
    runner, port = await server(max_connections=4, header_timeout=30)
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
    await asyncio.sleep(0.2)
    assert len(runner.registry.open) <= 4 and runner.registry.evicted >= 6
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(REQUEST)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3.0)
    assert b" 200 " in head.split(b"\r\n")[0]
    for _, w in [*idle, (reader, writer)]:
        w.close()


def test_300_idle_connections_under_ulimit_256_do_not_lock_a_fresh_client_out(
    tmp_path_factory,
):
    d = fake_daemon(tmp_path_factory, "--http-header-timeout", "5", nofile=256)
    d.start()
    socks = []
    try:
        for _ in range(300):
            s = socket.socket()
            s.settimeout(2)
            try:
                s.connect(("127.0.0.1", d.port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        assert len(socks) >= 250
        t0 = time.monotonic()
        import urllib.request

        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode()
        req = urllib.request.Request(
            d.base_url + "/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200
        # Served at once by the cap's eviction, well within the header timeout.
        assert time.monotonic() - t0 < 2.0
        assert d.proc.poll() is None
    finally:
        for s in socks:
            s.close()
        d.kill()
