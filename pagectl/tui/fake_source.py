"""An in-memory ``AdminSource`` for tests and demos: frames are pushed, commands recorded.

It answers commands the way the daemon does, from the last snapshot pushed (``set`` returns
``{"name", "old", "new"}``, ``inspect_block`` reads the block tables), unless a ``responder``
is given.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec

from pagectl.engine.commands import (
    Abort,
    Command,
    CommandError,
    GetStatus,
    InspectBlock,
    InspectRequest,
    Pause,
    ResetPrefixCache,
    Resume,
    SetConfig,
    SetPrefixCaching,
)
from pagectl.engine.inspect import clip
from pagectl.engine.telemetry import TelemetrySnapshot, decode_snapshot, encode_snapshot
from pagectl.tui.blockmodel import owners_in_range, seq_id
from pagectl.tui.source import Frame


class FakeSource:
    """Frames come from ``push``; every command sent lands in ``sent``."""

    def __init__(
        self,
        *,
        can_control: bool = True,
        read_only_reason: str = "no control token",
        clock: Callable[[], float] = time.time,
        responder: Callable[[Command], dict] | None = None,
        label: str = "fake://console",
    ) -> None:
        self.label = label
        self.detail = ""
        self._can_control = can_control
        self._read_only_reason = "" if can_control else read_only_reason
        self.clock = clock
        self.responder = responder
        self.sent: list[Command] = []
        self.started = False
        self.closed = False
        self._queue: asyncio.Queue[Frame] | None = None
        self._pending: list[Frame] = []
        self.last: TelemetrySnapshot | None = None

    @property
    def can_control(self) -> bool:
        return self._can_control

    @property
    def read_only_reason(self) -> str:
        return self._read_only_reason

    def push(self, snapshot: TelemetrySnapshot | bytes, received_at: float | None = None) -> None:
        """Queue one frame; ``received_at`` defaults to the source's clock."""
        data = snapshot if isinstance(snapshot, bytes) else encode_snapshot(snapshot)
        self.last = decode_snapshot(data)
        frame = Frame(data, self.clock() if received_at is None else received_at)
        if self._queue is None:
            self._pending.append(frame)
        else:
            self._queue.put_nowait(frame)

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        for frame in self._pending:
            self._queue.put_nowait(frame)
        self._pending.clear()
        self.started = True

    async def next_frame(self, timeout: float) -> Frame | None:
        assert self._queue is not None, "start() first"
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    async def send(self, command: Command) -> dict:
        if not self._can_control:
            raise CommandError("unauthorized", f"read-only: {self._read_only_reason}")
        self.sent.append(command)
        if self.responder is not None:
            return self.responder(command)
        return self._answer(command)

    async def close(self) -> None:
        self.closed = True

    # -- a daemon-like answer from the last snapshot -------------------------------------

    def _answer(self, cmd: Command) -> dict:
        snap = self.last
        config = dict(snap.config) if snap is not None else {}
        if isinstance(cmd, SetConfig):
            name = cmd.name.replace("-", "_")
            if name not in config:
                raise CommandError("unknown_setting", f"unknown setting {name!r}")
            old = config[name]
            if snap is not None:
                snap.config[name] = cmd.value
            return {"name": name, "old": old, "new": cmd.value}
        if isinstance(cmd, SetPrefixCaching):
            old = config.get("enable_prefix_caching", True)
            if snap is not None:
                snap.config["enable_prefix_caching"] = cmd.enabled
            return {"name": "enable_prefix_caching", "old": old, "new": cmd.enabled}
        if isinstance(cmd, ResetPrefixCache):
            return {"released_blocks": snap.num_cached_free_blocks if snap else 0}
        if isinstance(cmd, (Pause, Resume)):
            return {"paused": isinstance(cmd, Pause), "was_paused": bool(config.get("paused"))}
        if isinstance(cmd, Abort):
            if snap is None or not any(r.request_id == cmd.request_id for r in snap.requests):
                raise CommandError("not_found", f"no live request with id {cmd.request_id!r}")
            return {"aborted": cmd.request_id}
        if isinstance(cmd, InspectBlock):
            return self._inspect(cmd.block_id)
        if isinstance(cmd, InspectRequest):
            return self._inspect_request(cmd)
        if isinstance(cmd, GetStatus):
            return msgspec.to_builtins(snap) if snap is not None else {}
        raise CommandError("unknown_command", f"unknown command {type(cmd).__name__}")

    def _inspect(self, block_id: int) -> dict:
        snap = self.last
        if snap is None or not 0 <= block_id < snap.blocks.num_blocks:
            raise CommandError("not_found", f"block {block_id} does not exist")
        bs = snap.blocks.block_size
        ref = snap.blocks.ref_counts[block_id]
        hashed = bool(snap.blocks.hashed[block_id])
        owners = owners_in_range(snap.requests, block_id, block_id)
        fill = max([bs if hashed else 0, *(o.fill(bs) for o in owners)])
        tokens = [(block_id * 7 + i) % 1000 for i in range(fill)]
        state = (
            ("cached" if hashed else "free") if ref == 0 else ("shared" if ref > 1 else "in_use")
        )
        return {
            "block_id": block_id,
            "ref_cnt": ref,
            "state": state,
            "hash": f"{block_id:08x}" * 8 if hashed else None,
            "owners": [o.seq_id for o in owners],
            "fill": fill,
            "token_ids": tokens,
            "text": " ".join(f"t{t}" for t in tokens) if tokens else None,
        }

    def _inspect_request(self, cmd: InspectRequest) -> dict:
        """The engine's reply shape (engine/inspect.py) over made-up ids: prompt token i is
        ``(i * 7) % 1000``, output token j of sample k is ``500 + (j * 3 + k) % 500``."""
        snap = self.last
        rows = [r for r in (snap.requests if snap else []) if r.request_id == cmd.request_id]
        if not rows:
            raise CommandError("not_found", f"no live request with id {cmd.request_id!r}")
        total = len(rows)
        if cmd.seq_id:
            rows = [r for r in rows if seq_id(r) == cmd.seq_id]
            if not rows:
                raise CommandError("not_found", f"no live sequence {cmd.seq_id!r}")
        limit = cmd.max_tokens
        first = rows[0]
        return {
            "request_id": cmd.request_id,
            "num_sequences": total,
            "beam_width": first.beam_width,
            "num_prompt_tokens": first.num_prompt_tokens,
            "prompt": clip([(i * 7) % 1000 for i in range(first.num_prompt_tokens)], limit),
            "sequences": [
                {
                    "seq_id": seq_id(r),
                    "index": r.index,
                    "state": r.state,
                    "num_output_tokens": r.num_output_tokens,
                    "num_computed_tokens": r.num_computed_tokens,
                    "num_cached_tokens": r.num_cached_tokens,
                    "num_blocks": r.num_blocks,
                    "num_preemptions": r.num_preemptions,
                    "cum_logprob": r.cum_logprob if r.beam_width else None,
                    "output": clip(
                        [500 + (j * 3 + k) % 500 for j in range(r.num_output_tokens)], limit
                    ),
                }
                for k, r in enumerate(rows)
            ],
        }
