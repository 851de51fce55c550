"""Tensor parallelism on CPU (gloo), end to end.

Greedy output at TP=2 and TP=3 must equal TP=1 and transformers token for token, for Qwen3,
Qwen2 and Llama tiny models: a batch of prompts of different lengths, with chunked prefill,
prefix-cache hits, preemption and copy-on-write block copies (which travel in the per-step
broadcast), KV heads split and replicated. Then the faults: an impossible split fails before
any process starts; a rank that dies during start-up is reported at once; a killed worker
fails the next step, and the daemon exits non-zero leaving no process behind. Also the
multi-node rendezvous, with two "nodes" on this machine.

One spawned TP group serves several engines (``build_engine(args, tp_workers=...)``); a
process holds one group at a time, so ``groups.get`` ends the previous one when the size
changes.
"""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import openai
import psutil
import pytest
import requests
from engine_cases import CHUNK7_BS4, DEFAULT, build_tiny_engine, preempt_bs4
from tiny_models import engine_greedy, lazy_reference_models, random_prompts

from pagectl.engine.args import EngineArgs
from pagectl.engine.distributed.step_wire import OP_STEP, pack_step, unpack_step
from pagectl.engine.distributed.workers import TPWorkerError, TPWorkers
from pagectl.engine.runner.input_batch import StepArrays
from pagectl.engine.sampling_params import SamplingParams
from pagectl.testing.daemon_process import DaemonProcess, free_port

pytestmark = pytest.mark.slow

VOCAB = 384
MAX_NEW = 8


# The last two share a 20-token prefix: prefix-cache hits once the first is computed.
PROMPTS = random_prompts(11, VOCAB, [1, 4, 15, 16, 17, 37], 20, [9, 30])
MODELS = {
    # name: (architecture, config overrides)
    "qwen3": ("qwen3", None),  # 4 heads, 2 KV heads: one KV head per rank at TP=2
    "qwen2": ("qwen2", None),  # 4 heads, 1 KV head: replicated on both ranks at TP=2
    "llama": ("llama", None),  # 4 heads, 4 KV heads
    # 6 heads, 3 KV heads: TP=3 splits both; TP=2 is impossible.
    "llama_6h3kv": (
        "llama",
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192),
    ),
    # 6 heads, 1 KV head: replicated on three ranks.
    "qwen2_6h1kv": (
        "qwen2",
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=1, intermediate_size=192),
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (model dir, transformers' greedy continuations of PROMPTS), built lazily."""
    return lazy_reference_models(tmp_path_factory, MODELS, PROMPTS, MAX_NEW, VOCAB)


class Groups:
    """At most one live TP group in this process: asking for another size ends the current
    one first (torch.distributed allows one group per process)."""

    def __init__(self) -> None:
        self.live: TPWorkers | None = None

    def get(self, size: int) -> TPWorkers:
        w = self.live
        if w is None or w.size != size or w.failure is not None:
            self.close()
            self.live = w = TPWorkers.start(size, "cpu")
        return w

    def close(self) -> None:
        if self.live is not None:
            procs = list(self.live.procs.values())
            self.live.shutdown()
            self.live = None
            # Told to stop, healthy workers leave on their own, with status 0.
            assert [p.exitcode for p in procs] == [0] * len(procs)


@pytest.fixture(scope="module")
def groups():
    g = Groups()
    yield g
    g.close()


def _engine(path, tp: int = 1, workers: TPWorkers | None = None, **kw):
    kw.setdefault("num_kv_blocks", 128)
    return build_tiny_engine(path, tp=tp, workers=workers, **kw)


def _children_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# -- the per-step message ---------------------------------------------------------------


def test_step_wire_round_trip():
    r = np.arange
    arrays = StepArrays(
        token_ids=r(5) + 100,
        positions=r(5),
        slot_mapping=r(5) + 40,
        query_start_loc=np.array([0, 1, 5]),
        seq_lens=np.array([9, 4]),
        block_tables=np.array([[3, 7, 8], [2, 8, 8]]),
        logits_rows=np.array([0, 4]),
        num_decodes=1,
        token_seq_lens=np.array([9, 4, 4, 4, 4]),
    )
    header, payload = pack_step(arrays, [(1, 6), (2, 9)])
    assert header[0] == OP_STEP and payload.dtype == np.int64
    got, copies = unpack_step(header, payload)
    assert copies == [(1, 6), (2, 9)]
    for name in ("token_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
        assert np.array_equal(getattr(got, name), getattr(arrays, name)), name
    assert np.array_equal(got.block_tables, arrays.block_tables)
    assert np.array_equal(got.logits_rows, arrays.logits_rows)
    assert np.array_equal(got.token_seq_lens, arrays.token_seq_lens)
    assert got.num_decodes == 1
    # A step with block copies only (no sequence scheduled).
    header, payload = pack_step(None, [(4, 5)])
    assert unpack_step(header, payload) == (None, [(4, 5)])


# -- greedy output against TP=1 and transformers ----------------------------------------

CONFIGS = {
    "default": DEFAULT,
    "chunk7_bs4": CHUNK7_BS4,
    # 22 blocks of 4 cannot hold every request.
    "preempt_bs4": preempt_bs4(22),
}
CASES = [
    ("qwen3", 2, "default"),
    ("qwen3", 2, "chunk7_bs4"),
    ("qwen3", 2, "preempt_bs4"),
    ("qwen2", 2, "default"),
    ("qwen2", 2, "chunk7_bs4"),
    ("llama", 2, "default"),
    ("llama_6h3kv", 3, "default"),
    ("llama_6h3kv", 3, "chunk7_bs4"),
    ("qwen2_6h1kv", 3, "default"),
]


@pytest.mark.parametrize("model_name,tp,config", CASES)
def test_greedy_matches_tp1_and_transformers(models, groups, model_name, tp, config):
    path, reference = models(model_name)
    single = _engine(path, **CONFIGS[config])
    expect = engine_greedy(single.core, PROMPTS, MAX_NEW)
    single.shutdown()
    built = _engine(path, tp, groups.get(tp), **CONFIGS[config])
    try:
        out = engine_greedy(built.core, PROMPTS, MAX_NEW)
        assert out["tokens"] == expect["tokens"]
        for i, (ours, ref) in enumerate(zip(out["tokens"], reference, strict=True)):
            assert ours == ref, f"prompt {i} (length {len(PROMPTS[i])})"
        assert out["num_cached_tokens"] == expect["num_cached_tokens"]
        if config.startswith("preempt"):
            assert built.core.scheduler.counters.preemptions > 0
        if config == "chunk7_bs4":
            assert out["num_cached_tokens"][-1] == 20
        assert built.core.scheduler.kv.pool.num_used_blocks == 0
        info = built.core.model_info
        assert info.tp_size == tp
        # KV memory per rank: this rank's KV heads only (split, or one replicated head).
        mcfg = built.core.executor.model_config
        kv_heads = max(1, mcfg.num_key_value_heads // tp)
        assert built.core.executor.model.attention_layers[0].num_kv_heads == kv_heads
        bs = CONFIGS[config]["block_size"]
        per_block = 2 * mcfg.num_hidden_layers * bs * kv_heads * mcfg.head_dim * 4
        assert info.kv_bytes_per_block == per_block
        assert (
            info.kv_bytes_per_rank == info.kv_bytes_per_block * built.core.scheduler.kv.num_blocks
        )
    finally:
        built.shutdown()


def test_copy_on_write_blocks_are_copied_on_every_rank(models, groups):
    path, reference = models("qwen3")
    built = _engine(path, 2, groups.get(2), block_size=4)
    try:
        runner = built.core.executor
        copies: list[tuple[int, int]] = []
        send = runner.tp_driver.send_step
        runner.tp_driver.send_step = lambda arrays, pairs: (
            copies.extend(pairs),
            send(arrays, pairs),
        )[1]
        prompt = PROMPTS[3]  # 16 tokens: the fork point (15 computed) is inside a block
        sp = SamplingParams(n=2, temperature=0.0, ignore_eos=True, max_tokens=MAX_NEW)
        built.core.add_request("n2", prompt, sp)
        tokens: dict[int, list[int]] = {0: [], 1: []}
        while built.core.has_unfinished():
            for o in built.core.step():
                tokens[o.index].extend(o.new_token_ids)
        assert copies, "the children's first writes into the shared block must copy it"
        # A copy missed by rank 1 would corrupt its half of the KV heads, and the tokens.
        assert tokens[0] == reference[3] and tokens[1] == reference[3]
    finally:
        built.shutdown()


# -- start-up faults --------------------------------------------------------------------


def test_impossible_split_fails_before_any_process_starts(models, groups):
    groups.close()
    path, _ = models("llama_6h3kv")
    before = _children_pids()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\).*tensor-parallel size \(2\)"):
        _engine(path, 2)
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\).*tensor-parallel size \(4\)"):
        _engine(path, 4)
    assert time.monotonic() - t0 < 5
    assert _children_pids() <= before


def test_a_rank_failing_at_start_up_is_reported_at_once(models, groups, tmp_path):
    # A worker interpreter that fails before it joins the group (here: a sitecustomize that
    # ends every worker process at start-up). Rank 0 must say so within seconds, not wait
    # out a timeout.
    groups.close()
    path, _ = models("qwen3")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "if 'pagectl.engine.distributed.worker' in sys.orig_argv:\n"
        "    raise SystemExit('this worker may not start')\n"
    )
    script = tmp_path / "failing_worker.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from pagectl import LLM
            LLM(model={str(path)!r}, dtype="float32", tensor_parallel_size=2, num_kv_blocks=8)
            """
        )
    )
    pythonpath = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PAGECTL_TP_STARTUP_TIMEOUT_S": "300", "PYTHONPATH": pythonpath}
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode != 0
    assert time.monotonic() - t0 < 60
    assert "TPWorkerError: tensor-parallel rank 1 (pid" in r.stderr
    assert "before joining the group" in r.stderr and "this worker may not start" in r.stderr


def test_a_script_without_a_main_guard_runs_tensor_parallel(models, groups, tmp_path):
    # Workers are fresh interpreters: nothing re-imports the script, so vLLM-style scripts
    # run as they are.
    groups.close()
    path, _ = models("qwen3")
    code = (
        f"from pagectl import LLM, SamplingParams; llm = LLM(model={str(path)!r}, "
        "tensor_parallel_size=2); "
        'print(repr(llm.generate("x")[0].outputs[0].text))'
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = r.stdout.splitlines()
    assert isinstance(ast.literal_eval(line), str)  # the sampled text (sampling: no reference)


# -- LLM: shutdown, and a worker killed while idle --------------------------------------


KILLED_WORKER_SCRIPT = """
import os, signal, sys, time
from pagectl import LLM, SamplingParams
from pagectl.engine.distributed.workers import TPWorkerError

if __name__ == "__main__":
    path, prompt = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    llm = LLM(model=path, dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
    (proc,) = llm.engine.tp_workers.procs.values()
    print("worker", proc.pid, flush=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    t0 = time.monotonic()
    try:
        llm.generate({"prompt_token_ids": prompt}, greedy)
        print("no error", flush=True)
    except TPWorkerError as e:
        print(f"raised after {time.monotonic() - t0:.1f}s: {e}", flush=True)
    finally:
        llm.shutdown()
"""


def test_llm_shutdown_ends_workers_and_a_killed_worker_fails_the_next_step(
    models, groups, tmp_path
):
    from pagectl import LLM

    groups.close()
    path, reference = models("qwen3")
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_NEW)
    with LLM(model=str(path), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64) as llm:
        (proc,) = llm.engine.tp_workers.procs.values()
        out = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]], greedy)
        assert [o.outputs[0].token_ids for o in out] == reference[:3]
    assert proc.exitcode == 0  # shut down politely

    # A killed worker: the next step fails with the rank's fate, or, when the step is stuck
    # in a collective the dead peer never answers, the watchdog ends the process with status
    # 1. The second outcome ends the whole process, so this runs in a child.
    script = tmp_path / "killed_worker.py"
    script.write_text(KILLED_WORKER_SCRIPT)
    res = subprocess.run(
        [sys.executable, str(script), str(path), ",".join(map(str, PROMPTS[2]))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    pid = int(res.stdout.split("worker ", 1)[1].split()[0])
    fate = rf"tensor-parallel rank 1 \(pid {pid}\) was killed by signal 9"
    if res.returncode == 0:
        m = re.search(r"raised after ([0-9.]+)s: (.*)", res.stdout)
        assert m, res.stdout + res.stderr
        assert re.search(fate, m.group(2)) and float(m.group(1)) < 5
    else:
        assert res.returncode == 1, res.stdout + res.stderr
        assert re.search(fate, res.stderr) and "stuck in a collective" in res.stderr
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


def test_engine_loop_dies_when_a_worker_died_while_idle():
    """The daemon's engine loop asks the executor for its health every turn, so a worker
    death is reported (EngineDead, exit status 1) even when no request is running."""
    import zmq

    from pagectl.engine_process import wire
    from pagectl.engine_process.loop import EngineLoop
    from pagectl.testing.fake_engine import fake_engine

    core = fake_engine(EngineArgs(num_kv_blocks=8)).core

    def check_health() -> None:
        raise TPWorkerError("tensor-parallel rank 1 (pid 7) was killed by signal 9")

    core.executor.check_health = check_health
    ctx = zmq.Context()
    pull, push, inp = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        pull.bind("inproc://out")
        push.connect("inproc://out")
        inp.bind("inproc://in")
        loop = EngineLoop(
            core, input_sock=inp, output_sock=push, pub_sock=None, control_sock=None, token="t"
        )
        assert loop.run() == 1
        msgs = []
        while pull.poll(200):
            msgs.append(wire.decode_from_engine(pull.recv()))
        dead = [m for m in msgs if isinstance(m, wire.EngineDead)]
        assert dead and "rank 1 (pid 7) was killed by signal 9" in dead[0].message
        assert core.engine_state() == "dead"
    finally:
        for sock in (pull, push, inp):
            sock.close(linger=0)
        ctx.term()


# -- several nodes ----------------------------------------------------------------------


def test_two_nodes_meet_through_master_addr_and_port(models, groups, monkeypatch):
    groups.close()
    path, reference = models("qwen3")
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NNODES": "2"}
    node1 = subprocess.Popen(
        [sys.executable, "-m", "pagectl.engine.distributed.worker", "--tp", "2"],
        env={**os.environ, **env, "NODE_RANK": "1"},
    )
    try:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        built = _engine(path, 2)
        try:
            assert built.tp_workers.procs == {}  # rank 1 lives on the other "node"
            out = engine_greedy(built.core, PROMPTS, MAX_NEW)
            assert out["tokens"] == reference
        finally:
            built.shutdown()
        assert node1.wait(20) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


# -- the daemon -------------------------------------------------------------------------


def _start_daemon(models, groups, tmp_path_factory) -> DaemonProcess:
    groups.close()
    path, _ = models("qwen3")
    d = DaemonProcess(
        tmp_path_factory.mktemp("rt"),
        ["--model", str(path), "--served-model-name", "tiny", "--tp", "2"]
        + ["--num-kv-blocks", "64", "--dtype", "float32"],
    )
    return d.start()


@pytest.fixture(scope="module")
def daemon(models, groups, tmp_path_factory):
    d = _start_daemon(models, groups, tmp_path_factory)
    yield d
    d.kill()


def _workers_of(d: DaemonProcess) -> list[psutil.Process]:
    return [c for c in d.children() if "pagectl.engine.distributed.worker" in " ".join(c.cmdline())]


def test_daemon_tp2_serves_the_openai_api(daemon, models):
    from pagectl import LLM

    path, _ = models("qwen3")
    client = openai.OpenAI(base_url=daemon.base_url + "/v1", api_key="x", max_retries=0)
    prompt = "def add(a, b):"
    with LLM(model=str(path), dtype="float32", num_kv_blocks=64) as single:
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_NEW)
        ids = single.generate(prompt, sp)[0].outputs[0].token_ids
        expect = single.tokenizer.decode(ids)
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_NEW,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == expect
    stream = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_NEW,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(c.choices[0].text for c in stream) == expect
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2
    )
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 8
    st = json.loads(daemon.ctl("status", "--json").stdout)
    # qwen3 tiny: 2 layers, 1 of its 2 KV heads per rank, head_dim 32, float32, 16 slots.
    assert st["tp_size"] == 2
    assert st["kv_bytes_per_rank"] == 64 * (2 * 2 * 16 * 1 * 32 * 4)
    text = daemon.ctl("status").stdout
    assert "tp 2" in text
    assert len(_workers_of(daemon)) == 1


def test_daemon_sigterm_exits_zero_and_ends_its_workers(daemon):
    d = daemon
    everyone = d.children()
    assert _workers_of(d)
    os.kill(d.proc.pid, signal.SIGTERM)
    assert d.proc.wait(30) == 0
    _, alive = psutil.wait_procs(everyone, timeout=10)
    assert not alive, f"left behind: {alive}"


def test_daemon_exits_nonzero_when_a_worker_is_killed(models, groups, tmp_path_factory):
    d = _start_daemon(models, groups, tmp_path_factory)
    try:
        _kill_a_worker_mid_request(d)
    finally:
        d.kill()


def _kill_a_worker_mid_request(d: DaemonProcess) -> None:
    everyone = d.children()
    (worker,) = _workers_of(d)
    r = requests.post(
        d.base_url + "/v1/completions",
        json={"prompt": "doomed", "max_tokens": 400, "ignore_eos": True, "stream": True},
        stream=True,
        timeout=60,
    )
    lines = r.iter_lines()
    next(ln for ln in lines if ln.startswith(b"data: {"))
    worker.kill()
    rest = [ln for ln in lines if ln]
    errors = [json.loads(ln[6:]) for ln in rest if ln.startswith(b'data: {"error"')]
    assert errors and "rank 1" in errors[0]["error"]["message"]
    assert d.proc.wait(20) != 0
    _, alive = psutil.wait_procs(everyone, timeout=10)
    assert not alive, f"left behind: {alive}"
