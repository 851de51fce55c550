"""Details of the selected map cell: one block (with the daemon's ``inspect_block``) or a range."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from rich.text import Text
from textual.widgets import Static

from pagectl.engine.telemetry import RequestRow
from pagectl.tui import fmt
from pagectl.tui.blockmodel import (
    NUM_STATES,
    STATE_LABELS,
    owners_in_range,
    state_counts,
)
from pagectl.tui.blockrender import STATE_COLORS

MAX_OWNERS = 6
MAX_ID = 18
PREVIEW_CHARS = 160


@dataclass
class Inspection:
    """The daemon's answer to ``InspectBlock`` (or why there is none)."""

    block_id: int
    result: dict | None = None
    # "pending", "ok", or an error message.
    status: str = "pending"


class BlockDetail(Static):
    # Show the inspected block's token ids instead of its text (the i key).
    show_ids = False

    def show(
        self,
        selection: tuple[int, int] | None,
        states: np.ndarray | None,
        rows: Sequence[RequestRow],
        block_size: int,
        inspection: Inspection | None,
        can_inspect: bool,
    ) -> None:
        self.update(
            render_detail(
                selection, states, rows, block_size, inspection, can_inspect, self.show_ids
            )
        )


def _swatch(t: Text, state: int, n: int | None = None) -> None:
    t.append("█ ", style=STATE_COLORS[state])
    t.append(STATE_LABELS[state], style="bold")
    if n is not None:
        t.append(f" {fmt.count(n)}")


def render_detail(
    selection: tuple[int, int] | None,
    states: np.ndarray | None,
    rows: Sequence[RequestRow],
    block_size: int,
    inspection: Inspection | None,
    can_inspect: bool,
    show_ids: bool = False,
) -> Text:
    """The selection's details. An inspected block shows its tokens as text when the console
    could detokenize them (``result["text"]``), else (or with ``show_ids``) as ids."""
    t = Text(no_wrap=True, overflow="ellipsis")
    if selection is None or states is None:
        t.append("No cell selected.\n", style="italic #8b949e")
        t.append(
            "Map (tab to focus): arrows or a click select a cell; enter inspects a block.\n"
            "Requests table: the highlighted request's blocks light up on the map.",
            style="#8b949e",
        )
        return t
    first, last = selection
    last = min(last, len(states) - 1)
    owners = owners_in_range(rows, first, last)
    if first == last:
        t.append(f"block {fmt.count(first)}  ", style="bold")
        _swatch(t, int(states[first]))
        if owners:
            fill = max(o.fill(block_size) for o in owners)
            t.append(f"   fill {fill}/{block_size}")
    else:
        t.append(f"blocks {fmt.count(first)}–{fmt.count(last)} ", style="bold")
        t.append(f"({fmt.count(last - first + 1)})  ", style="#8b949e")
        counts = state_counts(states, first, last)
        shown = [s for s in range(NUM_STATES) if counts[s]]
        for i, s in enumerate(shown):
            if i:
                t.append("  ")
            _swatch(t, s, counts[s])
    t.append("\n")
    t.append("owners ", style="#8b949e")
    if not owners:
        t.append("none", style="italic")
    else:
        positions = {o.first_position for o in owners}
        for i, o in enumerate(owners[:MAX_OWNERS]):
            if i:
                t.append(", ")
            t.append(_short(o.seq_id), style="bold")
            if first != last:
                t.append(f" ×{o.num_blocks}", style="#8b949e")
            elif len(positions) > 1:
                t.append(f" @{o.first_position}", style="#8b949e")
        if len(owners) > MAX_OWNERS:
            t.append(f" … +{len(owners) - MAX_OWNERS} more", style="#8b949e")
        if first == last and len(positions) == 1:
            lo = owners[0].first_position * block_size
            t.append(
                f"  (table position {owners[0].first_position}: tokens {lo}–{lo + block_size - 1})",
                style="#8b949e",
            )
    if first != last:
        return t
    t.append("\n")
    if inspection is None or inspection.block_id != first:
        if can_inspect:
            t.append(
                "enter: ask the daemon for this block's hash and tokens", style="italic #8b949e"
            )
        else:
            t.append("hash and tokens need the control channel (read-only)", style="italic #8b949e")
        return t
    if inspection.status == "pending":
        t.append("inspecting…", style="italic #8b949e")
        return t
    if inspection.status != "ok" or inspection.result is None:
        t.append(f"inspect failed: {inspection.status}", style="#ff7b72")
        return t
    res = inspection.result
    t.append("refcount ", style="#8b949e")
    t.append(str(res.get("ref_cnt", "?")), style="bold")
    t.append("  hash ", style="#8b949e")
    h = res.get("hash")
    t.append(
        f"{h[:16]}…" if h else "none (not in the prefix cache)", style="bold" if h else "italic"
    )
    t.append("  fill ", style="#8b949e")
    t.append(f"{res.get('fill', 0)}/{block_size}", style="bold")
    t.append("\n")
    tokens = res.get("token_ids") or []
    text = res.get("text")
    if text is not None and not show_ids:
        t.append("text   ", style="#8b949e")
        preview = text if len(text) <= PREVIEW_CHARS else text[:PREVIEW_CHARS] + "…"
        t.append(repr(preview)[1:-1] if preview else "(empty)", style="#e3b341")
        t.append("  i: ids", style="#8b949e")
        return t
    t.append("tokens ", style="#8b949e")
    listed = ", ".join(str(x) for x in tokens[:24])
    t.append(f"[{listed}{', …' if len(tokens) > 24 else ''}]" if tokens else "none")
    if text is not None:
        t.append("  i: text", style="#8b949e")
    elif res.get("text_error"):
        t.append(f"  ({res['text_error']})", style="#8b949e")
    return t


def _short(seq: str) -> str:
    """Long generated ids (cmpl-<32 hex>) cut in the middle; the sample suffix kept."""
    base, sep, index = seq.partition("#")
    if len(base) > MAX_ID:
        base = base[: MAX_ID - 1] + "…"
    return base + sep + index
