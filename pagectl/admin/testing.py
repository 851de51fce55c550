"""Test support for the daemon (no pytest imports; usable by any test suite).

- ``fake_engine``: an engine factory (``--engine-factory pagectl.admin.testing:fake_engine``)
  with a deterministic fake model, for fault injection without torch. Environment knobs:
  ``PAGECTL_FAKE_STEP_DELAY_S`` (sleep per step), ``PAGECTL_FAKE_CRASH_AFTER_STEPS``.
- ``InProcessEngine``: the ``EngineClient`` interface over an in-process ``EngineCore``,
  for aiohttp_client tests of the HTTP layer.
- ``DaemonProcess``: start a real ``pagectl daemon`` subprocess and wait until it serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagectl.admin import wire
from pagectl.admin.engine_client import EngineDeadError, OutputRouter, RequestRejected
from pagectl.admin.engine_loop import engine_stats
from pagectl.admin.engine_proc import engine_ready
from pagectl.admin.protocol import RuntimeInfo
from pagectl.engine.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs

# -- a fake model -------------------------------------------------------------------------


class FakeExecutor:
    """Deterministic 'model': the next token depends on the last tokens and the sample index.

    Tokens are drawn from [3, vocab_size) so special tokens (0-2 in the tiny tokenizer) are
    never produced. Logprobs are fixed fake values when asked for.
    """

    def __init__(self, vocab_size: int, step_delay_s: float = 0.0, crash_after_steps: int = 0):
        self.vocab_size = vocab_size
        self.step_delay_s = step_delay_s
        self.crash_after_steps = crash_after_steps
        self.steps = 0

    def next_token(self, req: Any) -> int:
        toks = req.all_token_ids
        return (sum(toks[-3:]) * 31 + len(toks) * 7 + req.index * 13) % (self.vocab_size - 3) + 3

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        if self.crash_after_steps and self.steps >= self.crash_after_steps:
            raise RuntimeError(f"injected failure at step {self.steps}")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if so.spec_token_ids:
            return self._verify(so)
        sampled = []
        lps: list[TokenLogprobs | None] = []
        for req, sample in zip(so.seqs, so.sample, strict=False):
            tok = self.next_token(req) if sample else -1
            sampled.append(tok)
            k = req.sampling_params.logprobs
            if sample and k is not None:
                lps.append(self._logprobs(tok, k))
            else:
                lps.append(None)
        return ModelRunnerOutput(sampled, lps if any(lp is not None for lp in lps) else None)

    def _verify(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """A speculative step: each proposal is checked against the fake model's token there."""
        sampled: list[int] = []
        gained_all: list[list[int]] = []
        spec_lps: list[list[TokenLogprobs] | None] = []
        for req, sample, drafts in zip(so.seqs, so.sample, so.spec_token_ids, strict=True):
            k = req.sampling_params.logprobs
            if not sample:
                sampled.append(-1)
                gained_all.append([])
                spec_lps.append(None)
                continue
            view = _TokensView(req)
            gained: list[int] = []
            for d in [*drafts, None]:
                t = self.next_token(view)
                gained.append(t)
                if d is None or t != d:
                    break
                view.all_token_ids.append(d)
            sampled.append(gained[0])
            gained_all.append(gained if drafts else [])
            spec_lps.append(None if k is None else [self._logprobs(t, k) for t in gained])
        lps = [x[0] if x else None for x in spec_lps]
        return ModelRunnerOutput(
            sampled,
            lps if any(lp is not None for lp in lps) else None,
            spec_output_token_ids=gained_all,
            spec_logprobs=spec_lps if any(x is not None for x in spec_lps) else None,
        )

    def _logprobs(self, tok: int, k: int) -> TokenLogprobs:
        top = [(tok, -0.25)] + [((tok + j) % self.vocab_size, -1.0 - j) for j in range(1, k)]
        return TokenLogprobs(-0.25, 1, top[:k])


class _TokensView:
    """A sequence's tokens (a copy) and sample index, as ``FakeExecutor.next_token`` reads."""

    def __init__(self, req: Any) -> None:
        self.all_token_ids = list(req.all_token_ids)
        self.index = req.index


@dataclass
class FakeBuiltEngine:
    """Same fields as ``pagectl.engine.builder.BuiltEngine``."""

    core: Any
    tokenizer: Any
    model_name: str
    model_path: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def shutdown(self) -> None:
        pass


def fake_engine(args: Any) -> FakeBuiltEngine:
    """Engine factory: a real Scheduler + EngineCore over ``FakeExecutor``.

    ``args.model`` may be a directory holding a Hugging Face tokenizer (its vocabulary size
    is used); otherwise the vocabulary is 384 tokens and there is no tokenizer.
    """
    from pagectl.engine.config import CacheConfig, SchedulerConfig
    from pagectl.engine.core import EngineCore
    from pagectl.engine.scheduler import Scheduler
    from pagectl.engine.spec_decode.config import SpeculativeConfig
    from pagectl.engine.telemetry import ModelInfo
    from pagectl.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model) if args.model else None
    vocab = len(tokenizer) if tokenizer is not None else 384
    max_len = args.max_model_len or 256
    budget = args.max_num_batched_tokens or 256
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
        ),
        CacheConfig(args.block_size, args.num_kv_blocks or 256, args.enable_prefix_caching),
        speculative_config=SpeculativeConfig.parse(args.speculative_config),
    )
    name = args.served_model_name or "fake-model"
    executor = FakeExecutor(
        vocab,
        float(os.environ.get("PAGECTL_FAKE_STEP_DELAY_S", "0") or 0),
        int(os.environ.get("PAGECTL_FAKE_CRASH_AFTER_STEPS", "0") or 0),
    )
    core = EngineCore(
        sched,
        executor,
        vocab_size=vocab,
        eos_token_ids=(0,),
        model_info=ModelInfo(model=name, dtype="float32", device="cpu", max_model_len=max_len),
        tokenizer_decode=tokenizer.decode if tokenizer is not None else None,
    )
    return FakeBuiltEngine(core, tokenizer, name, str(args.model or ""), vocab, max_len, [0])


# -- the EngineClient interface, in process -----------------------------------------------


class InProcessEngine(OutputRouter):
    """Runs an EngineCore on the event loop (one step per loop turn); same methods as
    ``EngineClient`` (and the same output routing), for HTTP tests without processes or
    sockets."""

    def __init__(self, built: Any) -> None:
        super().__init__()
        self.built = built
        self.core = built.core
        self.stats: wire.EngineStats | None = None
        self.dead: str | None = None
        self.ready: wire.EngineReady | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.aborted: list[str] = []

    def _update_stats(self) -> None:
        self.stats = engine_stats(self.core.snapshot())

    async def start(self) -> wire.EngineReady:
        self.ready = engine_ready(self.built)
        self._update_stats()
        self._task = asyncio.create_task(self._run())
        return self.ready

    async def _run(self) -> None:
        core = self.core
        while True:
            if not core.has_unfinished():
                self._update_stats()
                self._wake.clear()
                await self._wake.wait()
            for out in core.step():
                self._deliver(out.request_id, out)
            self._update_stats()
            await asyncio.sleep(0)

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def submit(self, request: Any, queue: asyncio.Queue) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._add_route(request.request_id, queue)
        try:
            self.core.add_engine_request(request)
        except Exception as e:  # as the engine process does
            self._deliver(request.request_id, RequestRejected(str(e)))
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        self.release(request_ids)
        for rid in request_ids:
            self.aborted.append(rid)
            self.core.abort_request(rid)
        self._wake.set()

    def abort_all(self) -> None:
        for rid in list(self._routes):
            self.core.abort_request(rid)
        self._wake.set()

    def finish_stop_string(self, request_id: str, index: int, stop: str) -> None:
        self.core.scheduler.finish_by_stop_string(request_id, index, stop)

    def set_draining(self, draining: bool = True) -> None:
        self.core.state_override = "draining" if draining else None

    def kill(self, reason: str = "killed by the test") -> None:
        """Behave as if the engine process died."""
        self.dead = reason
        self._fail_all(EngineDeadError(reason))


# -- a real daemon subprocess -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """``pagectl daemon`` as a subprocess on a free port with its own runtime dir.

    Args:
        runtime_dir: the runtime directory to use (a test's tmp dir).
        args: extra daemon arguments (``--model DIR`` ...).
        env: extra environment variables.
    """

    def __init__(self, runtime_dir: str | os.PathLike, args: list[str], env: dict | None = None):
        self.runtime_dir = Path(runtime_dir)
        self.port = free_port()
        self.args = args
        self.env = {**os.environ, "PAGECTL_RUNTIME_DIR": str(self.runtime_dir), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.info: RuntimeInfo | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> DaemonProcess:
        from pagectl.admin.runtime import find_runtime

        cmd = [
            sys.executable,
            "-m",
            "pagectl",
            "daemon",
            "--port",
            str(self.port),
            "--runtime-dir",
            str(self.runtime_dir),
            *self.args,
        ]
        self.proc = subprocess.Popen(cmd, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with status {self.proc.returncode} during start")
            with contextlib.suppress(OSError):
                info = find_runtime(self.runtime_dir)
                if info.pid == self.proc.pid and self.health() == 200:
                    self.info = info
                    return self
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"daemon did not come up within {timeout}s")

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def children(self) -> list[Any]:
        import psutil

        assert self.proc is not None
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def ctl(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``pagectl ctl --runtime-dir DIR ARGV...`` and capture its output."""
        return subprocess.run(
            [sys.executable, "-m", "pagectl", "ctl", "--runtime-dir", str(self.runtime_dir), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
        )

    def kill(self) -> None:
        """Kill the daemon and every process it started (for fixture teardown)."""
        if self.proc is None:
            return
        kids = self.children()
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for k in kids:
            with contextlib.suppress(Exception):
                k.kill()
