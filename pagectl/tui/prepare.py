"""Decode a telemetry frame and precompute the block map, off the event loop.

``prepare`` runs in a worker thread: msgspec decoding and the per-block numpy work release
the event loop, so a 1,000,000-block snapshot never stalls keys or rendering.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from pagectl.engine.telemetry import TelemetrySnapshot, decode_snapshot
from pagectl.tui.blockmodel import Cells, aggregate, classify
from pagectl.tui.recording import RecordWriter
from pagectl.tui.source import Frame


@dataclass
class Prepared:
    """A decoded snapshot and what the panels derive from it."""

    snapshot: TelemetrySnapshot
    # One state per block (see ``blockmodel``).
    states: np.ndarray
    # Console-side receive time of the frame.
    received_at: float
    # The block map folded at ``cells.per`` (the map's cell size when the work started).
    cells: Cells | None
    # Seconds spent decoding and preparing (shown in the help screen's diagnostics).
    cost_s: float


def prepare(frame: Frame, per: int | None, recorder: RecordWriter | None = None) -> Prepared:
    t0 = time.perf_counter()
    if recorder is not None:
        recorder.write(frame.received_at, frame.data)
    snap = decode_snapshot(frame.data)
    b = snap.blocks
    states = classify(b.ref_counts, b.hashed, snap.requests, b.block_size)
    cells = aggregate(states, per) if per else None
    return Prepared(snap, states, frame.received_at, cells, time.perf_counter() - t0)
