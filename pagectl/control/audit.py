"""The audit file's record format (``audit.jsonl`` in a daemon's runtime directory), and
its reader for ``pagectl ctl log``. The engine process writes it
(``pagectl.engine_process.audit``); clients only read it.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec


class AuditRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One line of ``audit.jsonl``."""

    # time.time() when the command was applied (or refused).
    time: float
    # Who sent it (see ``Who``).
    client: str
    uid: int | None = None
    pid: int | None = None
    credentials: str
    # The command as sent: its "cmd" tag and fields, e.g. {"cmd": "set", "name": ..., ...}.
    command: dict[str, Any]
    # "ok", or the refusal's error kind ("invalid_value", "not_found", ...).
    outcome: str
    # For set / prefix_cache: the setting and its value before and after.
    name: str | None = None
    old: Any = None
    new: Any = None
    # The command's result (ok) or the refusal's message.
    result: dict[str, Any] | None = None
    message: str | None = None


def read_audit(path: str | os.PathLike) -> list[AuditRecord]:
    """Every readable record in an audit file, oldest first (a torn last line is skipped)."""
    out: list[AuditRecord] = []
    with open(path, "rb") as f:
        for line in f:
            try:
                out.append(msgspec.json.decode(line, type=AuditRecord))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
    return out
