"""A real daemon (fake model, the tiny tokenizer) running a beam search over HTTP, watched by
the real console over ZMQ: the beams show as one group with its children, highlighting the
group lights every beam's blocks, and the detail view shows each beam's tokens as text
decoded in the console with the daemon's tokenizer."""

from __future__ import annotations

import json
import threading
import urllib.request

import numpy as np
import pytest
from test_tui_app import wait_until

from pagectl.control.selection import Selector
from pagectl.engine.tokenizer import load_tokenizer
from pagectl.testing.daemon_process import DaemonProcess
from pagectl.tui.app import PagectlTop
from pagectl.tui.blockmodel import block_ids
from pagectl.tui.connection import LIVE
from pagectl.tui.daemon_choice import SelectingResolver
from pagectl.tui.detokenize import Detokenizer
from pagectl.tui.screens.request_detail import RequestDetailScreen
from pagectl.tui.zmq_source import ZmqSource

pytestmark = pytest.mark.slow

WIDTH = 3


def beam_group(app: PagectlTop):
    """The table's beam-search group line once its beams have forked, else None."""
    for line in app.requests_table.lines_by_key.values():
        if line.is_group and line.row.beam_width == WIDTH and len(line.members) == WIDTH:
            return line
    return None


async def test_a_real_beam_search_shows_as_one_group_with_text(tmp_path, tok_dir):
    daemon = DaemonProcess(
        tmp_path / "rt",
        [
            "--model",
            str(tok_dir),
            "--served-model-name",
            "fake",
            "--engine-factory",
            "pagectl.testing.fake_engine:fake_engine",
            "--num-kv-blocks",
            "256",
            "--max-model-len",
            "1024",
        ],
        # Slow steps keep the search live (about 40 s for 800 tokens) while the console
        # looks at it; the daemon is killed when the test is done.
        env={"PAGECTL_FAKE_STEP_DELAY_S": "0.05"},
    )
    # The console loads the tokenizer when it first needs it; importing transformers for it
    # is most of that, so it happens here, beside the daemon's start-up.
    warm = threading.Thread(target=load_tokenizer, args=(str(tok_dir),))
    warm.start()
    daemon.start()
    warm.join()
    answer: dict = {}

    def search() -> None:
        body = {
            "model": "fake",
            "prompt": "a beam search, watched from the console",
            "max_tokens": 800,
            "n": WIDTH,
            "use_beam_search": True,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            daemon.base_url + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                answer.update(json.load(r))
        except OSError as e:  # the daemon killed at the end
            answer["error"] = str(e)

    client = threading.Thread(target=search)
    try:
        chooser = SelectingResolver(str(daemon.runtime_dir), Selector(port=daemon.port))
        detok = Detokenizer(lambda: chooser.info.tokenizer_path if chooser.info else None)
        app = PagectlTop(ZmqSource(chooser), chooser=chooser, detokenizer=detok)
        async with app.run_test(size=(80, 24)) as pilot:
            assert await wait_until(pilot, lambda: app.link.state == LIVE and app.control_ready, 30)
            client.start()
            assert await wait_until(pilot, lambda: beam_group(app) is not None, 30)
            group = beam_group(app)
            assert group.label.endswith(f" W={WIDTH}")
            table = app.requests_table
            table.focus()
            await pilot.pause()
            table.move_cursor(row=list(table.lines_by_key).index(group.key), animate=False)
            await pilot.pause()
            line = table.selected_line
            assert line is not None and line.key == group.key
            every = np.unique(np.concatenate([block_ids(m) for m in line.members]))
            assert await wait_until(
                pilot,
                lambda: (
                    app.block_map._spotlight_ids is not None
                    and np.array_equal(np.unique(app.block_map._spotlight_ids), every)
                ),
                3.0,
            )
            # The beams share their prompt's blocks: fewer distinct blocks than held.
            assert len(every) < sum(m.num_blocks for m in line.members)
            await pilot.press("enter")
            assert await wait_until(pilot, lambda: isinstance(app.screen, RequestDetailScreen))
            screen = app.screen
            assert await wait_until(pilot, lambda: screen.tokens is not None, 10), screen.status
            tokens = screen.tokens
            assert tokens["beam_width"] == WIDTH and "text_error" not in tokens
            tok = load_tokenizer(str(tok_dir))
            shown = str(screen.tokens_panel.render())
            prompt = tokens["prompt"]
            assert prompt["gap"] == 0
            assert prompt["text"][0] == tok.decode(prompt["token_ids"], skip_special_tokens=False)
            assert "a beam search, watched from the console" in shown
            for s in tokens["sequences"]:
                out = s["output"]
                text = tok.decode(out["token_ids"][: out["gap_at"]], skip_special_tokens=False)
                assert out["text"][0] == text and s["cum_logprob"] is not None
            # Still searching: the view showed a live search, not its result.
            assert "choices" not in answer, answer
    finally:
        daemon.kill()
        client.join(30)
