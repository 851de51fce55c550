"""``FleetSource``: one ``AdminSource`` over several members (the engines of a data-parallel
daemon, several daemons, a router's backends), each with its own source.

The console's panels show the **selected** member: ``next_frame`` hands out its frames only,
``send`` goes to it, and ``label`` / ``detail`` / ``can_control`` are its own. Every member's
telemetry is followed all the time by a task per member, which keeps its newest frame and a
minute of slim snapshots (one a second) for the fleet table and the skew verdict
(``pagectl.control.skew``). Selecting another member hands out that member's newest frame at
once, so the panels change without waiting for its next snapshot.

Threading: everything runs on the app's event loop; a large frame is decoded in a thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pagectl.control.fleet import MemberSpec, engine_endpoints
from pagectl.control.selection import Selector, select_runtime
from pagectl.control.skew import MemberStats, SkewVerdict, member_stats, skew_rule
from pagectl.control.verdicts import slim
from pagectl.engine.commands import Command, CommandError
from pagectl.engine.telemetry import TelemetrySnapshot, decode_snapshot, is_heartbeat
from pagectl.tui.source import AdminSource, Frame
from pagectl.tui.zmq_source import Endpoints

# Frames larger than this are decoded in a thread (a 1,000,000-block frame is 4.4 MB).
DECODE_IN_THREAD_BYTES = 256 * 1024
# States of a member in the fleet table (besides the engine's own state).
CONNECTING, LIVE, STALE, UNREACHABLE = "connecting", "live", "stale", "unreachable"


class MemberResolver:
    """A ``zmq_source.Resolver`` for one member: its daemon's runtime file, read again at
    every (re)connection (a restarted daemon has new endpoints and a new token)."""

    def __init__(self, runtime_dir: str | None, spec: MemberSpec) -> None:
        self.runtime_dir = runtime_dir
        self.spec = spec

    def __call__(self) -> Endpoints:
        info = select_runtime(self.runtime_dir, Selector(url=self.spec.http_url))
        telemetry, control = engine_endpoints(info, self.spec.engine)
        return Endpoints(
            telemetry, control, info.token_file, info.http_url, telemetry_auth=info.telemetry_auth
        )


@dataclass
class Member:
    """One member as the console follows it."""

    label: str
    # None: not attachable (``unreachable`` says why).
    source: AdminSource | None
    unreachable: str = ""
    # The newest snapshot frame (handed out when the member is selected) and when anything
    # (a snapshot or a heartbeat) last arrived.
    last_frame: Frame | None = None
    received_at: float | None = None
    # A minute of slim snapshots, one a second, oldest first.
    history: deque[TelemetrySnapshot] = field(default_factory=lambda: deque(maxlen=61))
    # Frames this member's telemetry could not be read from.
    bad_frames: int = 0


@dataclass(frozen=True)
class FleetRow:
    """One line of the fleet table."""

    index: int
    label: str
    # CONNECTING, LIVE, STALE or UNREACHABLE.
    link: str
    # Why there is nothing to show (the reason it is unreachable, the source's detail).
    detail: str
    # None until the member's first snapshot.
    stats: MemberStats | None


class FleetSource:
    """An ``AdminSource`` that shows one member of several at a time (see module)."""

    def __init__(
        self,
        members: Sequence[Member],
        *,
        clock: Callable[[], float] = time.time,
        stale_after: float = 3.0,
        poll_interval: float = 0.25,
    ) -> None:
        if not members:
            raise ValueError("a fleet needs at least one member")
        self.members = list(members)
        self.clock = clock
        self.stale_after = stale_after
        self.poll_interval = poll_interval
        self.selected = 0
        self._pending: Frame | None = None
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._started = False

    # -- the selected member, as an AdminSource -----------------------------------------

    @property
    def member(self) -> Member:
        return self.members[self.selected]

    @property
    def label(self) -> str:
        m = self.member
        where = m.source.label if m.source is not None else ""
        # A member's own URL is its label already; an engine's adds its daemon's URL.
        http = where.startswith(("http://", "https://"))
        shown = f"{m.label} · {where}" if http and m.label not in where else m.label
        return f"[{self.selected + 1}/{len(self.members)}] {shown}"

    @property
    def detail(self) -> str:
        m = self.member
        return m.unreachable if m.source is None else m.source.detail

    @property
    def can_control(self) -> bool:
        src = self.member.source
        return src is not None and src.can_control

    @property
    def read_only_reason(self) -> str:
        src = self.member.source
        return self.member.unreachable if src is None else src.read_only_reason

    async def start(self) -> None:
        """Start every member's source and follow it (once: the console calls this again
        when it restarts its telemetry worker after a switch)."""
        if self._started:
            return
        self._started = True
        for m in self.members:
            if m.source is None:
                continue
            try:
                await m.source.start()
            except Exception as e:  # one member that cannot start leaves the others running
                m.unreachable = f"cannot start: {e}"
                await m.source.close()
                m.source = None
                continue
            self._tasks.append(asyncio.create_task(self._follow(m)))

    async def next_frame(self, timeout: float) -> Frame | None:
        if self._pending is None:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return None
        frame, self._pending = self._pending, None
        return frame

    async def send(self, command: Command) -> dict:
        m = self.member
        if m.source is None:
            raise CommandError("unauthorized", f"read-only: {m.label} is {m.unreachable}")
        return await m.source.send(command)

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        for m in self.members:
            if m.source is not None:
                await m.source.close()

    # -- choosing -----------------------------------------------------------------------

    def select(self, index: int) -> None:
        """Show member ``index`` (modulo the fleet's size); its newest frame comes next."""
        self.selected = index % len(self.members)
        self._pending = self.member.last_frame
        if self._pending is not None:
            self._ready.set()

    # -- following every member ---------------------------------------------------------

    async def _follow(self, m: Member) -> None:
        assert m.source is not None
        while True:
            try:
                frame = await m.source.next_frame(self.poll_interval)
            except asyncio.CancelledError:
                raise
            except Exception:  # the source reconnects by itself; the row shows it stale
                await asyncio.sleep(1.0)
                continue
            if frame is not None:
                await self._take(m, frame)

    async def _take(self, m: Member, frame: Frame) -> None:
        m.received_at = frame.received_at
        if not is_heartbeat(frame.data):
            try:
                if len(frame.data) > DECODE_IN_THREAD_BYTES:
                    snap = await asyncio.to_thread(decode_snapshot, frame.data)
                else:
                    snap = decode_snapshot(frame.data)
            except Exception:
                m.bad_frames += 1
                return
            m.last_frame = frame
            h = m.history
            if h and (snap.start_time != h[-1].start_time or snap.time < h[-1].time):
                h.clear()  # the daemon restarted
            if not h or snap.time - h[-1].time >= 1.0:
                h.append(slim(snap))
        if m is self.member:
            self._pending = frame
            self._ready.set()

    # -- what the fleet table shows -------------------------------------------------------

    def link(self, m: Member, now: float) -> str:
        if m.source is None:
            return UNREACHABLE
        if m.received_at is None:
            return CONNECTING
        return STALE if now - m.received_at > self.stale_after else LIVE

    def rows(self, now: float | None = None) -> list[FleetRow]:
        now = self.clock() if now is None else now
        out = []
        for i, m in enumerate(self.members):
            link = self.link(m, now)
            detail = m.unreachable if m.source is None else m.source.detail
            out.append(FleetRow(i, m.label, link, detail, member_stats(m.label, m.history)))
        return out

    def verdict(self, now: float | None = None) -> SkewVerdict | None:
        """The skew verdict over the members whose telemetry is live."""
        now = self.clock() if now is None else now
        live = {m.label: m.history for m in self.members if self.link(m, now) == LIVE}
        return skew_rule(live)


def zmq_fleet(runtime_dir: str | None, specs: Sequence[MemberSpec], **kw) -> FleetSource:
    """A fleet of live daemons' admin channels, one ``ZmqSource`` per member."""
    from pagectl.tui.zmq_source import ZmqSource

    members = [
        Member(s.label, None, s.unreachable)
        if s.unreachable
        else Member(s.label, ZmqSource(MemberResolver(runtime_dir, s)))
        for s in specs
    ]
    return FleetSource(members, **kw)
