"""The requests table's lines: sequences, grouped by request.

A request with several live sequences (n > 1 samples, or the beams of a beam search) is one
group line followed by its sequences as child lines; a beam search is a group even while it
has one beam. A group line stands for all its members: its row (``group_row``) aggregates
theirs, so the table's columns and sorting work on it as on one sequence, and its block ids
are the union of the members', so highlighting the group lights every member's blocks.

Pure data, no Textual: the table, the detail view and the tests read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from pagectl.engine.telemetry import RequestRow
from pagectl.tui.blockmodel import block_ids, seq_id

# Row keys of group lines: "group:<request id>" (a sequence's key is its seq id, which
# never starts with this: request ids come from the server as "cmpl-...", "chatcmpl-...",
# or from clients, and a clash would only mislabel a row, never lose one).
GROUP_PREFIX = "group:"

_STATE_RANK = {"running": 0, "preempted": 1, "waiting": 2}


@dataclass(frozen=True)
class Line:
    """One line of the requests table."""

    # The table's row key: a seq id, or GROUP_PREFIX + request id.
    key: str
    # The sequence, or the group's aggregate (``group_row``).
    row: RequestRow
    # The sequences the line stands for: the row itself, or the group's members.
    members: tuple[RequestRow, ...]
    # "seq" (a request with one sequence), "group", or "child" (a member under its group).
    kind: str
    # The text of the id column.
    label: str

    @property
    def is_group(self) -> bool:
        return self.kind == "group"


def group_row(members: Sequence[RequestRow]) -> RequestRow:
    """One row standing for a group: running if any member runs (else preempted, else
    waiting); output and computed tokens of the furthest member; blocks as the distinct
    blocks the members hold, and "shared" as those held by two or more of them; preemptions
    summed; the oldest age; the union of the block tables (in block id order)."""
    first = members[0]
    tables = [block_ids(r) for r in members if r.num_blocks]
    if tables:
        ids, counts = np.unique(np.concatenate(tables), return_counts=True)
    else:
        ids = counts = np.zeros(0, dtype=np.uint32)
    state = min((r.state for r in members), key=lambda s: _STATE_RANK.get(s, 9))
    return msgspec.structs.replace(
        first,
        index=0,
        state=state,
        priority=min(r.priority for r in members),
        num_output_tokens=max(r.num_output_tokens for r in members),
        num_computed_tokens=max(r.num_computed_tokens for r in members),
        num_cached_tokens=max(r.num_cached_tokens for r in members),
        num_blocks=len(ids),
        num_shared_blocks=int((counts > 1).sum()),
        num_preemptions=sum(r.num_preemptions for r in members),
        age_s=max(r.age_s for r in members),
        block_ids=ids.astype("<u4").tobytes(),
        admitted=any(r.admitted for r in members),
        seq_id=first.request_id,
        cum_logprob=max(r.cum_logprob for r in members),
    )


def group_label(row: RequestRow, num_members: int) -> str:
    """A group line's id text: the request id and what its members are ("W=4": a beam
    search of width 4; "n=3": three samples). Short: the table is 80 columns wide too."""
    what = f"W={row.beam_width}" if row.beam_width else f"n={num_members}"
    return f"{row.request_id} {what}"


def child_label(row: RequestRow, last: bool) -> str:
    """A member's id text under its group: a tree glyph and its seq id's suffix ("#2",
    "#b5"; "#0" for the sequence named as the request), with a beam's cumulative logprob."""
    suffix = seq_id(row)[len(row.request_id) :] or "#0"
    text = f"{'└' if last else '├'} {suffix}"
    if row.beam_width:
        text += f" {row.cum_logprob:.2f}"
    return text


def lines(
    rows: Sequence[RequestRow],
    sort: Callable[[RequestRow], Any] | None = None,
    reverse: bool = False,
) -> list[Line]:
    """The table's lines: each request (a lone sequence, or a group followed by its members)
    in the daemon's service order (a group where its first member is), or sorted by ``sort``
    (groups by their aggregate row, members by their own rows within the group)."""
    by_request: dict[str, list[RequestRow]] = {}
    for r in rows:
        by_request.setdefault(r.request_id, []).append(r)
    units: list[tuple[RequestRow, list[RequestRow] | None]] = []
    for members in by_request.values():
        if len(members) > 1 or members[0].beam_width:
            units.append((group_row(members), members))
        else:
            units.append((members[0], None))
    if sort is not None:
        units.sort(key=lambda u: sort(u[0]), reverse=reverse)
    elif reverse:
        units.reverse()
    out: list[Line] = []
    for row, group in units:
        if group is None:
            out.append(Line(seq_id(row), row, (row,), "seq", seq_id(row)))
            continue
        members = group
        out.append(
            Line(
                GROUP_PREFIX + row.request_id,
                row,
                tuple(members),
                "group",
                group_label(row, len(members)),
            )
        )
        if sort is not None:
            kids = sorted(members, key=sort, reverse=reverse)
        elif row.beam_width:
            kids = sorted(members, key=lambda m: -m.cum_logprob)  # best beam first
        else:
            kids = members
        for i, m in enumerate(kids):
            out.append(Line(seq_id(m), m, (m,), "child", child_label(m, i == len(kids) - 1)))
    return out
