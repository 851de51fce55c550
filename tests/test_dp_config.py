"""What a data-parallel daemon gives each engine (``daemon/dp.py``) and its flag checks."""

from __future__ import annotations

import argparse

import pytest

from pagectl.cli.daemon import _check_data_parallel, add_arguments
from pagectl.daemon.dp import engine_args_for_rank, kv_events_for_rank, rank_endpoint
from pagectl.engine.args import EngineArgs


def test_rank_endpoints_follow_vllms_offsets():
    assert rank_endpoint("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert rank_endpoint("tcp://127.0.0.1:5557", 3) == "tcp://127.0.0.1:5560"
    assert rank_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert rank_endpoint("tcp://127.0.0.1:0", 1) == "tcp://127.0.0.1:0"  # the OS picks
    assert rank_endpoint("ipc:///run/p/control.sock", 1) == "ipc:///run/p/control_dp1.sock"
    assert rank_endpoint("ipc:///run/p/control.sock", 0) == "ipc:///run/p/control.sock"
    with pytest.raises(ValueError):
        rank_endpoint("inproc://x", 1)


def test_threads_split_the_cores_and_tp_splits_an_engines_share(monkeypatch):
    monkeypatch.setattr("pagectl.daemon.dp.available_cores", lambda: 16)
    a = EngineArgs(device="cpu")
    assert engine_args_for_rank(a, 1, 2, cpu_threads=None, cuda=False).num_threads == 8
    tp = EngineArgs(device="cpu", tensor_parallel_size=2)
    assert engine_args_for_rank(tp, 0, 2, cpu_threads=None, cuda=False).num_threads == 4
    assert engine_args_for_rank(a, 0, 2, cpu_threads=3, cuda=False).num_threads == 3
    given = EngineArgs(device="cpu", num_threads=5)  # per rank, kept
    assert engine_args_for_rank(given, 1, 2, cpu_threads=None, cuda=False).num_threads == 5
    gpu = EngineArgs(device="cuda:1", tensor_parallel_size=2)
    assert engine_args_for_rank(gpu, 1, 2, cpu_threads=None, cuda=True).device == "cuda:3"


def test_kv_events_per_rank():
    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:5557",
           "replay_endpoint": "tcp://127.0.0.1:6000"}  # fmt: skip
    own, follow = kv_events_for_rank(cfg, 1, ("ipc:///p/kv.sock", "ipc:///p/r.sock"))
    assert own is not None and own["endpoint"] == "tcp://127.0.0.1:5558"
    assert follow == ("tcp://127.0.0.1:5558", "tcp://127.0.0.1:6001")
    assert cfg["endpoint"] == "tcp://127.0.0.1:5557"  # not changed in place
    own, follow = kv_events_for_rank(None, 1, ("ipc:///p/kv.sock", "ipc:///p/r.sock"))
    assert own is not None and own["endpoint"] == "ipc:///p/kv.sock"
    assert follow == ("ipc:///p/kv.sock", "ipc:///p/r.sock")
    assert kv_events_for_rank(None, 1, None) == (None, None)
    remote = {"enable_kv_cache_events": True, "endpoint": "tcp://10.0.0.9:5557"}
    with pytest.raises(ValueError, match="--dp-routing load"):
        kv_events_for_rank(remote, 0, ("ipc:///p/kv.sock", None))  # type: ignore[arg-type]
    assert kv_events_for_rank(remote, 0, None)[1] is None  # load routing needs no events


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["-dp", "2"], None),
        (["--data-parallel-size", "2", "--data-parallel-size-local", "2"], None),
        (["-dp", "0"], "must be >= 1"),
        (["-dp", "2", "-dpl", "1"], "across nodes is not supported"),
        (["--dp-routing", "load"], "needs --data-parallel-size > 1"),
        (["--dp-cpu-threads", "2"], "needs --data-parallel-size > 1"),
        (["-dp", "2", "--dp-cpu-threads", "0"], "must be >= 1"),
        (["-dp", "2", "--dp-cpu-threads", "2", "--num-threads", "1"], "not both"),
        (["-dp", "2", "--dp-cpu-threads", "2", "--device", "cuda"], "CPU engines only"),
        (["-dp", "2", "--dp-max-skew", "-1"], "must be >= 0"),
    ],
)
def test_flag_checks(argv, error):
    p = argparse.ArgumentParser()
    add_arguments(p)
    msg = _check_data_parallel(p.parse_args(argv))
    assert (msg is None) if error is None else (error in (msg or "")), msg


class _StubEngine:
    """What DPEngineClient uses of an EngineClient, recorded."""

    def __init__(self) -> None:
        self._routes: dict = {}
        self.stats = None
        self.dead: str | None = None
        self.on_dead: list = []
        self.calls: list[tuple[str, list[str]]] = []

    @property
    def num_unstarted(self) -> int:
        return len(self._routes)

    def submit(self, request, queue) -> None:
        from pagectl.engine_process.client import EngineDeadError

        if self.dead:
            raise EngineDeadError(self.dead)
        self._routes[request.request_id] = queue

    def abort(self, ids: list[str]) -> None:
        self.calls.append(("abort", ids))
        for i in ids:
            self._routes.pop(i, None)

    def release(self, ids: list[str]) -> None:
        self.calls.append(("release", ids))
        for i in ids:
            self._routes.pop(i, None)

    def die(self, reason: str) -> None:
        self.dead = reason
        for cb in self.on_dead:
            cb(reason)


def _request(rid: str, tokens: list[int]):
    from pagectl.engine.outputs import EngineRequest
    from pagectl.engine.sampling_params import SamplingParams

    return EngineRequest(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams())


def test_dispatcher_owns_each_request_and_survives_one_engine():
    from pagectl.engine_process.client import EngineDeadError
    from pagectl.engine_process.dp_client import DPEngineClient
    from pagectl.routing.policy import RoutingPolicy

    a, b = _StubEngine(), _StubEngine()
    dp = DPEngineClient([a, b], RoutingPolicy("round_robin"))  # type: ignore[list-item]
    died: list = []
    dp.on_engine_dead.append(lambda i, r: died.append(i))
    dp.on_dead.append(lambda r: died.append("all"))
    for rid in ("r0", "r1", "r2"):
        dp.submit(_request(rid, [1, 2, 3]), None)  # type: ignore[arg-type]
    assert set(a._routes) == {"r0", "r2"} and set(b._routes) == {"r1"}
    assert dp.num_unstarted == 3  # --max-num-queued-requests counts across engines
    dp.abort(["r1", "r2"])
    assert a.calls == [("abort", ["r2"])] and b.calls == [("abort", ["r1"])]
    dp.abort(["r1"])  # released: nothing more goes out
    assert b.calls == [("abort", ["r1"])]
    b.die("killed")
    assert died == [1] and dp.dead is None
    for rid in ("r3", "r4"):
        dp.submit(_request(rid, [4]), None)  # type: ignore[arg-type]
    assert {"r3", "r4"} <= set(a._routes)
    a.die("killed too")
    assert died == [1, 0, "all"] and dp.dead is not None
    with pytest.raises(EngineDeadError):
        dp.submit(_request("r5", [4]), None)  # type: ignore[arg-type]


def test_prefix_choice_comes_from_the_engines_kv_events():
    from pagectl.engine.kv.hashing import hash_request_blocks
    from pagectl.engine_process.dp_client import DPEngineClient
    from pagectl.routing.policy import RoutingPolicy

    a, b = _StubEngine(), _StubEngine()
    dp = DPEngineClient([a, b], RoutingPolicy("prefix"))  # type: ignore[list-item]
    dp._block_size = 4
    tokens = list(range(10, 22))
    # Engine 1 reported the request's first two blocks stored (as its BlockStored would).
    dp.policy.index.stored("1", hash_request_blocks(tokens, 4, [])[:2])
    assert [dp.choose(_request(f"p{i}", tokens)) for i in range(3)] == [1, 1, 1]
    assert dp.decisions == {(1, "prefix"): 3}
    b.die("gone")  # its index is forgotten with it
    assert dp.choose(_request("p9", tokens)) == 0
