"""``pagectl route`` over two real daemons (the fake model behind a real EngineCore), each
publishing KV-cache events: prefix affinity, load spread, streaming through the proxy, a
backend lost mid-run."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import pytest

from pagectl.router.backends import Backend, BackendSpec, parse_backend
from pagectl.router.proxy import Router, create_router_app
from pagectl.routing.policy import RoutingPolicy
from pagectl.testing.daemon_process import DaemonProcess, free_port

pytestmark = pytest.mark.slow


def _daemon(tmp_path_factory, tok_dir, env: dict | None = None) -> tuple[DaemonProcess, str]:
    pub = free_port()
    cfg = {"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{pub}"}
    d = DaemonProcess(
        tmp_path_factory.mktemp("rt"),
        [
            "--model",
            str(tok_dir),
            "--engine-factory",
            "pagectl.testing.fake_engine:fake_engine",
            "--num-kv-blocks",
            "512",
            "--max-model-len",
            "2048",
            "--kv-events-config",
            json.dumps(cfg),
        ],
        env=env,
    )
    return d, f"{d.base_url},kv_events={cfg['endpoint']}"


def _start_all(ds: list[DaemonProcess]) -> None:
    errors: list[BaseException] = []

    def go(d: DaemonProcess) -> None:
        try:
            d.start()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(d,)) for d in ds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for d in ds:
            d.kill()
        raise errors[0]


@pytest.fixture(scope="module")
def backends(tmp_path_factory, tok_dir):
    pairs = [_daemon(tmp_path_factory, tok_dir) for _ in range(2)]
    _start_all([d for d, _ in pairs])
    yield pairs
    for d, _ in pairs:
        d.kill()


async def _router(aiohttp_client, specs: list[str], policy: str = "prefix"):
    router = Router(
        [Backend(parse_backend(s)) for s in specs],
        RoutingPolicy(policy, max_skew=4),
        health_interval=0.2,
    )
    client = await aiohttp_client(create_router_app(router))
    await asyncio.sleep(0.3)  # SUB sockets join
    return client, router


def _decisions(router: Router) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in router.metrics.decisions.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                out[s.labels["backend"]] = out.get(s.labels["backend"], 0) + s.value
    return out


SYSTEM = "".join(f"You are assistant number {i} of the fleet; be precise. " for i in range(12))


async def test_shared_prefix_lands_on_one_backend_with_hits(aiohttp_client, backends):
    client, router = await _router(aiohttp_client, [s for _, s in backends])
    cached = []
    for i in range(16):
        r = await client.post(
            "/v1/completions",
            json={"prompt": SYSTEM + f"Question {i}?", "max_tokens": 4, "temperature": 0},
        )
        assert r.status == 200, await r.text()
        body = await r.json()
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        await asyncio.sleep(0.05)  # the events of this prefill reach the router
    assert sum(c > 0 for c in cached) >= 14, cached
    counts = sorted(_decisions(router).values())
    assert counts[-1] >= 15, counts


async def test_messages_are_proxied_with_prefix_affinity(aiohttp_client, backends):
    client, router = await _router(aiohttp_client, [s for _, s in backends])
    for i in range(6):
        body = {
            "system": SYSTEM,
            "messages": [{"role": "user", "content": f"Question {i}?"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        r = await client.post("/v1/messages", json=body, headers={"x-api-key": "unused"})
        assert r.status == 200, await r.text()
        assert (await r.json())["type"] == "message"
        await asyncio.sleep(0.05)  # the events of this prefill reach the router
    counts = sorted(_decisions(router).values())
    assert counts[-1] >= 5, counts  # the shared system prompt keeps them on one daemon
    r = await client.post("/v1/messages", data=b"[1, 2")
    assert r.status == 400
    err = await r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"


async def test_unrelated_load_spreads(aiohttp_client, backends):
    client, router = await _router(aiohttp_client, [s for _, s in backends])
    rng = random.Random(7)
    sem = asyncio.Semaphore(4)

    async def one(i: int) -> None:
        words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"]) for _ in range(8))
        async with sem:
            r = await client.post(
                "/v1/completions", json={"prompt": f"{i} {words}", "max_tokens": 2}
            )
            assert r.status == 200

    await asyncio.gather(*(one(i) for i in range(64)))
    counts = _decisions(router)
    assert sum(counts.values()) == 64
    assert max(counts.values()) <= 0.6 * 64, counts


async def test_streaming_passes_through_unchanged(aiohttp_client, backends):
    import aiohttp

    client, router = await _router(aiohttp_client, [s for _, s in backends], "round_robin")
    body = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "stream": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    via_router = (await r.read()).decode()
    url = backends[0][0].base_url + "/v1/completions"
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as direct:
        direct_text = (await direct.read()).decode()

    def texts(sse: str) -> list[str]:
        out = []
        for line in sse.splitlines():
            if line.startswith("data: {"):
                out.append(json.loads(line[6:])["choices"][0]["text"])
        return out

    assert texts(via_router) == texts(direct_text) and len(texts(direct_text)) == 12
    assert via_router.rstrip().endswith("data: [DONE]")


async def test_backend_killed_mid_run(aiohttp_client, backends, tmp_path_factory, tok_dir):
    slow, slow_spec = _daemon(tmp_path_factory, tok_dir, env={"PAGECTL_FAKE_STEP_DELAY_S": "0.05"})
    await asyncio.to_thread(slow.start)
    try:
        client, router = await _router(aiohttp_client, [slow_spec, backends[0][1]], "round_robin")
        body = {"prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True}
        streams = [await client.post("/v1/completions", json=body) for _ in range(2)]
        # round robin: the first to the slow backend, the second to the survivor
        first = await streams[0].content.readline()
        assert first.startswith(b"data: ")
        slow.kill()
        killed = (await streams[0].read()).decode()
        assert '"error"' in killed and killed.rstrip().endswith("data: [DONE]")
        survivor = (await streams[1].read()).decode()
        assert '"error"' not in survivor and survivor.rstrip().endswith("data: [DONE]")
        # New requests go to the survivor (a refused connection is retried there).
        for _ in range(4):
            r = await client.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
            assert r.status == 200
        h = await (await client.get("/health")).json()
        assert h["status"] == "degraded"
        metrics = await (await client.get("/metrics")).text()
        assert "pagectl_router:stream_errors_total" in metrics
    finally:
        slow.kill()


def test_backend_spec_parsing():
    s = parse_backend("http://h:8000/,kv_events=tcp://h:5557,replay=tcp://h:5558,topic=kv")
    assert s == BackendSpec("http://h:8000", "tcp://h:5557", "tcp://h:5558", "kv")
    with pytest.raises(ValueError, match="unknown option"):
        parse_backend("http://h:8000,kv=tcp://h:1")
    with pytest.raises(ValueError, match="URL"):
        parse_backend("h:8000")
