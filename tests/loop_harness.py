"""The real engine loop (``EngineLoop``) on a thread over ipc sockets, with a fake model: a
daemon's admin channel without a subprocess, for liveness and stress tests."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import zmq

from pagectl.engine.args import EngineArgs
from pagectl.engine.outputs import EngineRequest
from pagectl.engine_process import wire
from pagectl.engine_process.audit import AuditLog
from pagectl.engine_process.loop import EngineLoop
from pagectl.testing.fake_engine import FakeExecutor, fake_engine
from pagectl.tui.zmq_source import Endpoints

TOKEN = "loop-harness-token"


class LoopThread:
    """``EngineLoop`` over a fake-model ``EngineCore`` on a thread.

    ``submit`` sends requests the way the API server does; ``finished`` counts the sequences
    that finished. ``endpoints`` is what a console attaches to.
    """

    def __init__(self, tmp: Path, step_delay_s: float = 0.0, **engine_kw) -> None:
        kw = {"num_kv_blocks": 96, "max_model_len": 512, "max_num_seqs": 32}
        kw.update(engine_kw)
        self.built = fake_engine(EngineArgs(model=None, **kw))
        self.core = self.built.core
        self.core.executor = FakeExecutor(self.built.vocab_size, step_delay_s)
        self.ctx = zmq.Context()
        ep = {name: f"ipc://{tmp}/{name}.sock" for name in ("in", "out", "tel", "ctl")}
        token_file = tmp / "control.token"
        token_file.write_text(TOKEN)
        token_file.chmod(0o600)
        self.endpoints = Endpoints(ep["tel"], ep["ctl"], str(token_file), "http://loop.test")
        self.to_engine = self._sock(zmq.PUSH, bind=ep["in"])
        self.from_engine = self._sock(zmq.PULL, bind=ep["out"])
        inp = self._sock(zmq.PULL, connect=ep["in"])
        out = self._sock(zmq.PUSH, connect=ep["out"])
        out.setsockopt(zmq.SNDTIMEO, 500)
        pub = self._sock(zmq.PUB, bind=ep["tel"])
        pub.setsockopt(zmq.SNDHWM, 4)
        router = self._sock(zmq.ROUTER, bind=ep["ctl"])
        self.audit_file = tmp / "audit.jsonl"
        self.loop = EngineLoop(
            self.core,
            input_sock=inp,
            output_sock=out,
            pub_sock=pub,
            control_sock=router,
            token=TOKEN,
            telemetry_interval=0.1,
            audit=AuditLog(self.audit_file),
        )
        self._ids = itertools.count()
        self.finished = 0
        self.submitted = 0
        self._thread = threading.Thread(target=self.loop.run, name="engine-loop", daemon=True)

    def _sock(self, kind: int, *, bind: str | None = None, connect: str | None = None):
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if bind:
            s.bind(bind)
        if connect:
            s.connect(connect)
        return s

    def start(self) -> LoopThread:
        self._thread.start()
        return self

    def submit(self, prompt: list[int], max_tokens: int) -> str:
        rid = f"r{next(self._ids)}"
        req = EngineRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params={"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0},
        )
        self.to_engine.send(wire.encode(wire.SubmitRequest(req)))
        self.submitted += 1
        return rid

    def drain_outputs(self) -> None:
        """Read what the engine sent; count finished sequences."""
        while True:
            try:
                frame = self.from_engine.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = wire.decode_from_engine(frame)
            if isinstance(msg, wire.OutputBatch):
                self.finished += sum(1 for o in msg.outputs if o.finish_reason is not None)
            elif isinstance(msg, wire.RequestFailed):
                self.finished += 1

    def keep_streams(self, streams: int, prompt_len: int, max_tokens: int) -> None:
        """Top the load up to ``streams`` requests in flight."""
        self.drain_outputs()
        k = self.submitted
        while self.submitted - self.finished < streams:
            k += 1
            self.submit([3 + (k * 13 + j) % 300 for j in range(prompt_len)], max_tokens)

    def stop(self) -> None:
        self.loop.stop_event.set()
        deadline = time.monotonic() + 10
        while self._thread.is_alive() and time.monotonic() < deadline:
            self.drain_outputs()
            self._thread.join(0.05)
        self.ctx.destroy(linger=0)
