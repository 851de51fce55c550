"""Cost of one telemetry snapshot in ``pagectl top`` at a large pool (default 1,000,000 blocks).

Two measurements:

1. the pipeline, stage by stage: msgpack decode, per-block classification, folding into
   the map's cells, and rendering every visible row of the map as Strips;
2. the whole app, headless: snapshots pushed through a fake source into ``PagectlTop``
   (decode in a worker thread, every panel updated, Textual compositing the screen),
   timed from the first frame to the last one shown.

The console keeps up with 10 snapshots/s when the per-snapshot figure stays under 100 ms.

    python benchmarks/tui_render.py [--blocks 1000000] [--frames 30] [--size 160x48]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_tui_scenarios import NOW, huge_snapshot  # noqa: E402

from pagectl.engine.telemetry import decode_snapshot, encode_snapshot  # noqa: E402
from pagectl.tui.blockmodel import aggregate, classify, fit_layout  # noqa: E402
from pagectl.tui.blockrender import render_row  # noqa: E402


def timed(fn, repeat: int) -> tuple[float, object]:
    """Median seconds of ``repeat`` calls, and the last result."""
    times = []
    out = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def pipeline(blocks: int, map_width: int, map_height: int, repeat: int) -> float:
    snap = huge_snapshot(blocks)
    t_enc, frame = timed(lambda: encode_snapshot(snap), repeat)
    t_dec, dec = timed(lambda: decode_snapshot(frame), repeat)
    b = dec.blocks
    t_cls, states = timed(
        lambda: classify(b.ref_counts, b.hashed, dec.requests, b.block_size), repeat
    )
    layout = fit_layout(blocks, map_width, map_height)
    t_agg, cells = timed(lambda: aggregate(states, layout.per), repeat)
    t_ren, _ = timed(lambda: [render_row(layout, cells, y) for y in range(layout.rows)], repeat)
    total = t_dec + t_cls + t_agg + t_ren
    print(f"pool: {blocks:,} blocks, {len(dec.requests)} requests, frame {len(frame) / 1e6:.1f} MB")
    print(
        f"map:  {map_width}x{map_height} chars -> {layout.per:,} blocks per cell, {layout.rows} rows"
    )
    print(f"  encode (daemon side)  {t_enc * 1e3:7.2f} ms")
    print(f"  decode                {t_dec * 1e3:7.2f} ms")
    print(f"  classify blocks       {t_cls * 1e3:7.2f} ms")
    print(f"  fold into cells       {t_agg * 1e3:7.2f} ms")
    print(f"  render map rows       {t_ren * 1e3:7.2f} ms")
    print(f"  per snapshot          {total * 1e3:7.2f} ms  (up to {1 / total:,.0f} snapshots/s)")
    return total


async def whole_app(blocks: int, frames: int, size: tuple[int, int]) -> float:
    from pagectl.tui.app import PagectlTop
    from pagectl.tui.fake_source import FakeSource

    snaps = [huge_snapshot(blocks, seed=i % 3, seq=i + 1) for i in range(frames)]
    src = FakeSource(clock=lambda: NOW)
    app = PagectlTop(src, clock=lambda: NOW)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        t0 = time.perf_counter()
        for s in snaps:
            src.push(s)
        while app.frames_applied < frames:
            await pilot.pause(0.001)
        await pilot.pause()
        elapsed = time.perf_counter() - t0
    per = elapsed / frames
    print(f"whole app ({size[0]}x{size[1]}, {frames} frames): {per * 1e3:.1f} ms per snapshot "
          f"(up to {1 / per:.0f} snapshots/s)")  # fmt: skip
    return per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--frames", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--size", default="160x48", help="terminal size for the whole-app run")
    args = ap.parse_args()
    w, h = (int(x) for x in args.size.split("x"))
    # The map panel of a 160x48 terminal is about 92x20 characters inside its border.
    total = pipeline(args.blocks, w - 68, h - 28, args.repeat)
    app = asyncio.run(whole_app(args.blocks, args.frames, (w, h)))
    ok = max(total, app) < 0.1
    print(f"keeps up with 10 snapshots/s: {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
