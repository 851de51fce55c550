"""Regenerate screenshots/: ``pagectl top`` attached to a real daemon under a real mixed load.

Starts ``pagectl daemon`` on a tiny random-weight model (CPU), drives it with concurrent
completions (a shared 64-token prefix, parallel sampling with n=3, long decodes) into a pool
small enough to force preemptions, attaches the real console over ZMQ (headless, at a fixed
terminal size) and saves SVG screenshots, plus PNG ones when cairosvg is installed. A second
console at 80x24 shows the compact layout (compact-80x24).

    python scripts/screenshots.py [--out screenshots] [--size 160x48] [--warmup 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_tui_e2e import MixedLoad  # noqa: E402
from tiny_models import build_tiny_model  # noqa: E402

from pagectl.testing.daemon_process import DaemonProcess  # noqa: E402
from pagectl.tui.app import PagectlTop  # noqa: E402
from pagectl.tui.blockmodel import SHARED2, block_ids  # noqa: E402
from pagectl.tui.daemon_choice import SelectingResolver  # noqa: E402
from pagectl.tui.detokenize import Detokenizer  # noqa: E402
from pagectl.tui.request_groups import GROUP_PREFIX  # noqa: E402
from pagectl.tui.screens.request_detail import RequestDetailScreen  # noqa: E402
from pagectl.tui.widgets.block_map import BlockMapView  # noqa: E402
from pagectl.tui.zmq_source import ZmqSource  # noqa: E402


def console(run_dir: Path) -> PagectlTop:
    chooser = SelectingResolver(str(run_dir))
    detok = Detokenizer(lambda: chooser.info.tokenizer_path if chooser.info else None)
    return PagectlTop(ZmqSource(chooser), chooser=chooser, detokenizer=detok)


def busy_enough(app: PagectlTop, warmup: float) -> bool:
    s = app.snapshot
    return (
        s is not None
        and s.counters.preemptions > 0
        and s.num_cached_free_blocks > 0
        and any(r.index > 0 for r in s.requests)
        and len(app.history.samples) >= warmup
    )


async def shoot_compact(run_dir: Path, out: Path, warmup: float) -> list[Path]:
    """The same daemon in an 80x24 terminal: map, KV usage, events and requests."""
    app = console(run_dir)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: busy_enough(app, warmup), 240, "a busy picture")
        path = out / "compact-80x24.svg"
        app.save_screenshot(str(path))
        print(f"saved {path}")
    return [path]


def to_png(svg: Path) -> Path | None:
    """Convert with cairosvg (if installed), in a monospace font that has block glyphs."""
    try:
        import cairosvg
    except ImportError:
        return None
    text = svg.read_text().replace("Fira Code, monospace", "DejaVu Sans Mono")
    text = text.replace('"Fira Code"', '"DejaVu Sans Mono"')
    png = svg.with_suffix(".png")
    cairosvg.svg2png(bytestring=text.encode(), write_to=str(png))
    return png


async def wait_until(pilot, predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        await pilot.pause(0.1)


async def shoot(run_dir: Path, daemon: DaemonProcess, out: Path, size, warmup: float) -> list[Path]:
    app = console(run_dir)
    saved: list[Path] = []

    def save(name: str) -> None:
        path = out / f"{name}.svg"
        app.save_screenshot(str(path))
        saved.append(path)
        print(f"saved {path}")

    async with app.run_test(size=size) as pilot:
        await wait_until(pilot, lambda: app.snapshot is not None, 60, "telemetry")

        await wait_until(
            pilot,
            lambda: busy_enough(app, warmup),
            240,
            "a busy picture: preemption, cached blocks, n>1",
        )
        save("overview")

        # A shared block, inspected through the control channel.
        states = app.current.states
        shared = [int(i) for i in (states >= SHARED2).nonzero()[0]]
        if shared:
            app.query_one(BlockMapView).select_cell(shared[0])
            await wait_until(
                pilot,
                lambda: app.inspection is not None and app.inspection.status != "pending",
                10,
                "the block inspection",
            )
            await pilot.pause(0.3)
            save("block-inspect")
            app.query_one(BlockMapView).select_cell(None)

        # A sampled request (n=3): its group line highlighted lights all its samples' blocks.
        await pilot.press("tab")
        rows = app.snapshot.requests
        # The youngest one, so that it is still running when its detail asks for its tokens.
        sampled = [r for r in rows if r.index > 0 and len(block_ids(r))]
        target = min(sampled, key=lambda r: r.num_output_tokens, default=None)
        table = app.requests_table
        key = f"{GROUP_PREFIX}{target.request_id}" if target is not None else None
        if key is not None and key in table.lines_by_key:
            table.move_cursor(row=list(table.lines_by_key).index(key), animate=False)
        await pilot.pause(0.5)
        save("request-highlight")

        # Its detail: facts, and the prompt and each sample's output as text.
        if key is not None and table.selected_line is not None:
            table.focus()
            await pilot.pause()
            await pilot.press("enter")
            await wait_until(
                pilot,
                lambda: (
                    isinstance(app.screen, RequestDetailScreen) and app.screen.status != "pending"
                ),
                60,
                "the request detail's tokens",
            )
            print(f"request detail: {app.screen.status}")
            await pilot.pause(0.3)
            save("request-detail")
            await pilot.press("escape")
            await pilot.pause(0.3)

        # The daemon goes away: the last picture stays, marked stale.
        await pilot.press("tab")
        await asyncio.to_thread(daemon.kill)
        await wait_until(pilot, lambda: app.link.state == "stale", 30, "the stale mark")
        await pilot.pause(0.5)
        save("disconnected")
    return saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "screenshots"))
    ap.add_argument("--size", default="160x48")
    ap.add_argument("--warmup", type=float, default=20, help="seconds of history before shooting")
    ap.add_argument("--num-kv-blocks", type=int, default=256)
    args = ap.parse_args()
    size = tuple(int(x) for x in args.size.split("x"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagectl-shots-") as tmp:
        tmp_path = Path(tmp)
        os.chmod(tmp_path, 0o700)
        model = build_tiny_model(tmp_path / "tiny-qwen3", "qwen3")
        daemon_args = [
            "--model", str(model), "--device", "cpu", "--dtype", "float32",
            "--num-kv-blocks", str(args.num_kv_blocks), "--max-num-batched-tokens", "256",
            "--max-num-seqs", "32", "--max-model-len", "512",
        ]  # fmt: skip
        daemon = DaemonProcess(tmp_path / "run", daemon_args).start(timeout=600)
        load = MixedLoad(daemon.base_url, workers=12, max_tokens=200).start()
        try:
            saved = asyncio.run(shoot_compact(tmp_path / "run", out, args.warmup))
            saved += asyncio.run(shoot(tmp_path / "run", daemon, out, size, args.warmup))
        finally:
            load.stop()
            daemon.kill()
    for svg in saved:
        png = to_png(svg)
        if png:
            print(f"saved {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
