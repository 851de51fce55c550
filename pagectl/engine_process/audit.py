"""The audit trail of control commands: who, when, what, old -> new, outcome.

Every authorized command that can change the engine (``set``, ``prefix_cache``,
``reset_prefix_cache``, ``pause``, ``resume``, ``abort``) is appended as one JSON line to
``audit.jsonl`` in the daemon's runtime directory (mode 0600, opened O_APPEND for each
record, so a record is never interleaved and the file survives any console). Queries
(``status``, ``inspect_block``) are not recorded. Accepted commands also appear in the
telemetry event log, with the same "who".

Who: the client's name as it reports it, and a uid and pid. On an ``ipc://`` socket those
come from the kernel (SO_PEERCRED, which libzmq exposes as the frame's ``Peer-Address``
property "host:uid:gid:pid"): ``credentials == "peer"``. On ``tcp://`` there are none, and
the uid and pid are what the client says (``credentials == "reported"``, or "none").
"""

from __future__ import annotations

import os
import time
from typing import Any

import msgspec

from pagectl.control.audit import AuditRecord

# Commands that change the engine (the "cmd" tags); the others are queries.
AUDITED_COMMANDS = frozenset(
    {"set", "prefix_cache", "reset_prefix_cache", "pause", "resume", "abort"}
)


class Who(msgspec.Struct, frozen=True):
    """Who sent a control command."""

    # The client's own name (ControlRequest.client), e.g. "ctl@host:4242".
    client: str
    # The sending process's uid and pid (None: unknown).
    uid: int | None
    pid: int | None
    # "peer": uid/pid from the socket's peer credentials; "reported": from the request;
    # "none": neither.
    credentials: str

    def label(self) -> str:
        """One line for event messages: "ctl@host:4242 (uid 1000, pid 4242, peer)"."""
        name = self.client or "anonymous client"
        if self.credentials == "none":
            return name
        return f"{name} (uid {self.uid}, pid {self.pid}, {self.credentials})"


def peer_credentials(peer_address: str | None) -> tuple[int, int] | None:
    """(uid, pid) from libzmq's ``Peer-Address`` of an ipc connection ("host:uid:gid:pid")."""
    if not peer_address:
        return None
    parts = peer_address.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        return int(parts[1]), int(parts[3])
    except ValueError:
        return None


def who(client: str, peer_address: str | None, uid: int | None, pid: int | None) -> Who:
    creds = peer_credentials(peer_address)
    if creds is not None:
        return Who(client, creds[0], creds[1], "peer")
    if uid is not None or pid is not None:
        return Who(client, uid, pid, "reported")
    return Who(client, None, None, "none")


class AuditLog:
    """Appends ``AuditRecord`` lines to one file. Write errors are counted, never raised:
    a full disk must not stop the engine answering commands."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self.num_errors = 0

    def append(self, record: AuditRecord) -> None:
        line = msgspec.json.encode(record) + b"\n"
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError:
            self.num_errors += 1

    def record(
        self,
        sender: Who,
        command: Any,
        outcome: str,
        result: dict | None = None,
        message: str | None = None,
    ) -> AuditRecord:
        cmd = msgspec.to_builtins(command)
        rec = AuditRecord(
            time=time.time(),
            client=sender.client,
            uid=sender.uid,
            pid=sender.pid,
            credentials=sender.credentials,
            command=cmd if isinstance(cmd, dict) else {"cmd": str(cmd)},
            outcome=outcome,
            result=result if outcome == "ok" else None,
            message=message,
        )
        if result is not None and "old" in result:
            rec.name, rec.old, rec.new = result.get("name"), result["old"], result["new"]
        self.append(rec)
        return rec
