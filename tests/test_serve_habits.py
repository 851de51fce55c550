"""`vllm serve` habits: positional MODEL, several served names, 4k-style lengths, a busy
port and unknown flags reported at once, CORS, GET /v1/models/{id}, zero preemption samples."""

from __future__ import annotations

import socket

import pytest

from pagectl.cli import main
from pagectl.engine.args import parse_length
from pagectl.server.state import ServerSettings


def test_lengths_like_vllm():
    assert parse_length("4096") == 4096
    assert parse_length("4k") == 4000
    assert parse_length("4K") == 4096
    assert parse_length("1M") == 1 << 20
    assert parse_length(7) == 7
    for bad in ("4x", "", "0.5"):
        with pytest.raises(ValueError):
            parse_length(bad)


def test_busy_port_and_unknown_flag_fail_before_the_engine(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["daemon", "some-model", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["daemon", "--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pagectl daemon" in err and "--no-such-flag" in err
    assert main(["daemon", "a", "--model", "b"]) == 2
    assert "given twice" in capsys.readouterr().err


async def test_several_names_model_retrieve_and_cors(make_client):
    settings = ServerSettings(
        served_model_name="main",
        served_model_aliases=("alias",),
        allowed_origins=("http://app.example",),
    )
    client, _ = await make_client(settings)
    ids = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
    assert ids == ["main", "alias"]
    card = await (await client.get("/v1/models/alias")).json()
    assert card["id"] == "alias" and card["object"] == "model"
    missing = await client.get("/v1/models/other")
    assert missing.status == 404
    r = await client.post(
        "/v1/completions", json={"model": "alias", "prompt": "hi", "max_tokens": 2}
    )
    assert r.status == 200 and (await r.json())["model"] == "main"
    pre = await client.options(
        "/v1/chat/completions",
        headers={
            "Origin": "http://app.example",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert pre.status == 204
    assert pre.headers["Access-Control-Allow-Origin"] == "http://app.example"
    assert "POST" in pre.headers["Access-Control-Allow-Methods"]
    r = await client.get("/v1/models", headers={"Origin": "http://app.example"})
    assert r.headers["Access-Control-Allow-Origin"] == "http://app.example"
    r = await client.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in r.headers


async def test_preemption_reasons_have_zero_samples_from_the_start(make_client):
    client, engine = await make_client()
    text = await (await client.get("/metrics")).text()
    assert 'pagectl:num_preemptions_total{engine="0",reason="kv_blocks"} 0.0' in text
