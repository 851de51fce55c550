"""A telemetry scenario with a beam search, built by a real engine core over the fake model
of ``pagectl.testing.fake_engine`` (it returns top logprobs, so beams fork and share blocks).
Times pinned as in test_tui_scenarios."""

from __future__ import annotations

from test_tui_scenarios import BLOCK_SIZE, MODEL, SYSTEM_PROMPT, Recorder

from pagectl.engine.beam_search import BeamSearchParams
from pagectl.engine.config import CacheConfig, SchedulerConfig
from pagectl.engine.core import EngineCore
from pagectl.engine.scheduler import Scheduler
from pagectl.engine.telemetry import TelemetrySnapshot
from pagectl.testing.fake_engine import FakeExecutor

BEAM_WIDTH = 4


def beam_snapshots() -> list[TelemetrySnapshot]:
    """A beam search of width 4 ("beam") beside a plain request ("chat") and n=2 sampling
    ("pair"), stopped while the beams are live and forked."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=256,
            max_num_seqs=16,
            max_model_len=1024,
            long_prefill_token_threshold=0,
            policy="fcfs",
        ),
        CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=64, enable_prefix_caching=True),
    )
    core = EngineCore(
        sched, FakeExecutor(2000), vocab_size=2000, eos_token_ids=[0], model_info=MODEL
    )
    rec = Recorder(core)
    rec.take()
    core.add_beam_request(
        "beam", SYSTEM_PROMPT + [700] * 13, BeamSearchParams(beam_width=BEAM_WIDTH, max_tokens=60)
    )
    rec._arrivals["beam"] = 0
    rec.add("chat", SYSTEM_PROMPT + [701] * 7, max_tokens=80)
    rec.add("pair", [702] * 20, max_tokens=80, n=2)
    for _ in range(3):
        rec.run(3)
    return rec.pinned()
