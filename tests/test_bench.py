"""The benchmark harness: workloads, token accounting, percentiles, SSE parsing, reports.

Timings are never asserted; what is checked is the logic that turns runs into figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagectl.bench import client, report, stats, throughput
from pagectl.bench.results import EngineResult, count_useful
from pagectl.bench.workload import WorkloadSpec, random_workload, shared_prefix_workload

ROOT = Path(__file__).resolve().parent.parent


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- workloads ------------------------------------------------------------------------------


def test_random_workload_is_deterministic_and_in_range():
    spec = WorkloadSpec(
        num_requests=50,
        min_input_len=3,
        max_input_len=9,
        min_output_len=2,
        max_output_len=5,
        vocab_size=40,
        seed=7,
    )
    a, b = random_workload(spec), random_workload(spec)
    assert a == b
    assert random_workload(WorkloadSpec(**{**vars(spec), "seed": 8})) != a
    assert len(a) == 50
    assert {r.prompt_len for r in a} <= set(range(3, 10))
    assert {r.output_len for r in a} <= set(range(2, 6))
    # Both ends of each range are reachable with enough requests.
    assert min(r.prompt_len for r in a) == 3 and max(r.prompt_len for r in a) == 9
    ids = {t for r in a for t in r.prompt_token_ids}
    assert min(ids) >= 1 and max(ids) <= 39  # id 0 (EOS / padding) never in prompts


@pytest.mark.parametrize(
    "kw",
    [
        {"num_requests": 0},
        {"min_input_len": 10, "max_input_len": 5},
        {"min_output_len": 0},
        {"vocab_size": 1},
    ],
)
def test_workload_spec_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        WorkloadSpec(**kw)


def test_shared_prefix_workload():
    w = shared_prefix_workload(
        10, prefix_len=32, min_suffix_len=2, max_suffix_len=6, output_len=4, vocab_size=100, seed=1
    )
    prefix = w[0].prompt_token_ids[:32]
    assert all(r.prompt_token_ids[:32] == prefix for r in w)
    assert all(34 <= r.prompt_len <= 38 and r.output_len == 4 for r in w)
    assert len({tuple(r.prompt_token_ids) for r in w}) == 10
    assert w == shared_prefix_workload(10, 32, 2, 6, 4, 100, seed=1)


# -- accounting -----------------------------------------------------------------------------


def test_count_useful_caps_each_request_at_its_length():
    useful, mismatches = count_useful([[1, 2, 3], [4], [5, 6]], [2, 3, 2])
    assert useful == 2 + 1 + 2
    assert mismatches == 2
    with pytest.raises(ValueError):
        count_useful([[1]], [1, 2])


def test_engine_result_rate_and_dict():
    r = EngineResult("x", "X", 2, useful_output_tokens=300, elapsed_s=1.5)
    assert r.tokens_per_s == pytest.approx(200.0)
    assert r.to_dict()["tokens_per_s"] == pytest.approx(200.0)
    assert (
        EngineResult("x", "X", error="boom", useful_output_tokens=5, elapsed_s=1).tokens_per_s
        is None
    )
    f = EngineResult("forward", "F", elapsed_s=0.5, tokens_per_s_override=1024.0)
    assert f.tokens_per_s == 1024.0
    # Model tok/s: None when the engine's positions were not counted; the probe's own rate.
    assert r.model_tokens_per_s is None and r.to_dict()["model_tokens_per_s"] is None
    assert f.model_tokens_per_s == 1024.0


class _FakeLLM:
    """Records what generate() was asked; returns as many tokens as it is told to."""

    def __init__(self, short_by: int = 0):
        self.calls = []
        self.short_by = short_by
        self.core = SimpleNamespace(
            counters=SimpleNamespace(steps=0, prompt_tokens=0, generation_tokens=0, preemptions=0),
            executor=SimpleNamespace(execute_model=lambda so: None),
        )

    def generate(self, prompts, params):
        prompts = prompts if isinstance(prompts, list) else [prompts]
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append((prompts, params))
        c = self.core.counters
        c.steps += 3
        c.prompt_tokens += sum(len(p["prompt_token_ids"]) for p in prompts)
        # One "step" feeding every prompt and every decode input (prompt + output - 1 each).
        fed = sum(
            len(p["prompt_token_ids"]) + sp.max_tokens - 1
            for p, sp in zip(prompts, params, strict=True)
        )
        self.core.executor.execute_model(SimpleNamespace(total_num_scheduled_tokens=fed))
        outs = []
        for i, sp in enumerate(params):
            n = sp.max_tokens - (self.short_by if i == 0 else 0)
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * n)]))
        return outs


def test_run_pagectl_uses_each_requests_length_and_counts_useful_tokens():
    spec = WorkloadSpec(
        num_requests=5, min_input_len=4, max_input_len=8, min_output_len=3, max_output_len=9
    )
    w = random_workload(spec)
    llm = _FakeLLM()
    res = throughput.run_pagectl(llm, w)
    assert len(llm.calls) == 2  # warm-up, then the whole workload in one call
    prompts, params = llm.calls[1]
    assert [p["prompt_token_ids"] for p in prompts] == [r.prompt_token_ids for r in w]
    assert [sp.max_tokens for sp in params] == [r.output_len for r in w]
    assert all(sp.ignore_eos and sp.temperature == 0.0 for sp in params)
    assert res.useful_output_tokens == sum(r.output_len for r in w)
    assert res.num_length_mismatches == 0
    # Counter deltas cover the timed call only (the warm-up is excluded).
    assert res.extra["steps"] == 3
    assert res.extra["prompt_tokens_computed"] == sum(r.prompt_len for r in w)
    # Tokens through the model, counted at the executor; the counter is removed afterwards.
    assert res.model_tokens == sum(r.prompt_len + r.output_len - 1 for r in w)
    assert res.model_tokens_per_s == pytest.approx(res.model_tokens / res.elapsed_s)
    assert llm.core.executor.execute_model(None) is None


def test_run_pagectl_reports_short_outputs():
    w = random_workload(WorkloadSpec(num_requests=3, min_output_len=5, max_output_len=5))
    res = throughput.run_pagectl(_FakeLLM(short_by=2), w)
    assert res.useful_output_tokens == 15 - 2
    assert res.num_length_mismatches == 1


def test_report_ratios_and_targets():
    spec = WorkloadSpec(num_requests=2)
    results = [
        EngineResult(
            "pagectl", "p", 2, useful_output_tokens=1000, elapsed_s=1.0, model_tokens=1400
        ),
        EngineResult("hf-cb", "cb", 2, useful_output_tokens=1000, elapsed_s=4.0),
        EngineResult("hf-static", "st", 2, useful_output_tokens=1000, elapsed_s=5.0),
        EngineResult(
            "forward",
            "fw",
            tokens_per_s_override=2000.0,
            extra={"last_logits_tokens_per_s": 2800.0},
        ),
    ]
    rep = throughput.build_report(spec, "m", results)
    # Against the forward limit the engine's model tok/s counts: 1400 / 2000, and 1400 / 2800
    # against the stricter probe that computes logits for the last position only.
    assert rep["ratios"] == {
        "pagectl/hf-cb": 4.0,
        "pagectl/hf-static": 5.0,
        "pagectl_useful/forward": 0.5,
        "pagectl/forward_last_logits": 0.5,
        "pagectl/forward": 0.7,
    }
    assert "pagectl/forward_last_logits" not in rep["targets"]
    assert rep["targets"]["pagectl/hf-cb"]["met"] is False  # 4x < 5x
    assert rep["targets"]["pagectl/hf-static"]["met"] is True
    assert rep["targets"]["pagectl/forward"]["met"] is True  # 0.7 >= 0.6
    json.loads(report.dumps(rep))  # strict JSON
    table = throughput.render_table(results)
    assert "4.00x" in table and "5.00x" in table and "0.70x" in table
    targets = throughput.render_targets(rep)
    assert "NOT met" in targets
    assert "last-position logits only: 2800.0 tok/s" in targets and "0.50x" in targets
    # A probe without the stricter figure prints no such line.
    results[-1].extra = {}
    assert "last-position" not in throughput.render_targets(
        throughput.build_report(spec, "m", results)
    )


def test_report_with_a_skipped_peer_is_pending():
    results = [
        EngineResult("pagectl", "p", 2, useful_output_tokens=10, elapsed_s=1.0),
        EngineResult("hf-cb", "cb", 2, error="no"),
    ]
    rep = throughput.build_report(WorkloadSpec(), "m", results)
    assert rep["ratios"]["pagectl/hf-cb"] is None
    assert rep["targets"]["pagectl/hf-cb"]["met"] is None
    assert "cb skipped: no" in throughput.render_table(results)


def test_parse_peers():
    assert throughput.parse_peers("none") == []
    assert throughput.parse_peers("forward, hf-cb") == ["forward", "hf-cb"]
    with pytest.raises(ValueError, match="unknown peer"):
        throughput.parse_peers("vllm")
    # bench serve's peers go through the same parser.
    assert throughput.parse_peers("hf-serve,", ("hf-serve",)) == ["hf-serve"]
    with pytest.raises(ValueError, match="choose from hf-serve"):
        throughput.parse_peers("hf-cb", ("hf-serve",))


class _Sched:
    def schedule(self):
        return "so"

    def update_from_output(self, so, ro):
        return [so, ro]


class _Exec:
    def execute_model(self, so):
        return "ro"


def test_phase_timer_and_token_counter_wrap_and_restore():
    from pagectl.bench.profile import ModelTokenCounter, PhaseTimer, render_breakdown

    core = SimpleNamespace(scheduler=_Sched(), executor=_Exec())
    llm = SimpleNamespace(core=core)
    with ModelTokenCounter(llm) as fed, PhaseTimer(llm) as timer:
        for _ in range(3):
            so = core.scheduler.schedule()
            assert (
                core.executor.execute_model(SimpleNamespace(total_num_scheduled_tokens=5)) == "ro"
            )
            assert core.scheduler.update_from_output(so, "ro") == ["so", "ro"]
    assert fed.tokens == 15 and fed.steps == 3
    assert timer.calls == {"schedule": 3, "execute_model": 3, "update_from_output": 3}
    # Every wrapper is gone: the instances use their class methods again.
    assert "schedule" not in vars(core.scheduler) and "execute_model" not in vars(core.executor)
    b = timer.breakdown(elapsed_s=10.0)
    assert sum(b.values()) == pytest.approx(10.0)
    assert "execute_model" in render_breakdown(b, steps=3)


# -- percentiles and latency ----------------------------------------------------------------


@pytest.mark.parametrize(
    "values", [[5.0], [3.0, 1.0], [1, 2, 3, 4, 10], list(range(101)), [0.5, 0.25, 8, 8, 9, 1e-3]]
)
@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy(values, q):
    np = pytest.importorskip("numpy")
    assert stats.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges():
    assert math.isnan(stats.percentile([], 50))
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)
    s = stats.summarize([1.0, 2.0, 3.0, 4.0])
    assert s == {"mean": 2.5, "p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97)}


def test_serving_metrics_from_timings():
    a = stats.RequestTiming(start=0.0, chunk_times=[0.5, 0.6, 0.8], chunk_tokens=[1, 1, 1], end=0.9)
    b = stats.RequestTiming(
        start=1.0, chunk_times=[1.2, 1.3], chunk_tokens=[1, 1], end=1.3, usage_output_tokens=2
    )
    bad = stats.RequestTiming(start=0.0, end=0.1, error="HTTP 500")
    m = stats.serving_metrics([a, b, bad], duration_s=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_output_tokens"] == 5
    assert m["output_throughput"] == pytest.approx(2.5)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(350.0)  # TTFTs 500 and 200 ms
    # TPOT: a = (0.8 - 0.5) / 2 = 150 ms, b = 100 ms; ITLs: 100, 200, 100 ms.
    assert m["tpot_ms"]["mean"] == pytest.approx(125.0)
    assert m["itl_ms"]["p50"] == pytest.approx(100.0)
    assert m["itl_ms"]["mean"] == pytest.approx(400.0 / 3)
    assert m["e2e_ms"]["p50"] == pytest.approx(600.0)


def test_tpot_uses_usage_count_when_chunks_carry_several_tokens():
    t = stats.RequestTiming(
        start=0.0, chunk_times=[1.0, 2.0], chunk_tokens=[1, 1], end=2.0, usage_output_tokens=5
    )
    assert t.output_tokens == 5
    assert t.tpot == pytest.approx(0.25)
    assert stats.RequestTiming(start=0.0, chunk_times=[1.0], chunk_tokens=[1]).tpot is None


# -- SSE parsing ----------------------------------------------------------------------------


def test_parse_sse_line():
    assert client.parse_sse_line(b'data: {"a": 1}\n') == {"a": 1}
    assert client.parse_sse_line("data: [DONE]") == "[DONE]"
    assert client.parse_sse_line(b"\n") is None
    assert client.parse_sse_line(b": keep-alive\n") is None
    assert client.parse_sse_line(b"event: x\n") is None


def test_apply_chunk_counts_tokens_usage_and_errors():
    t = stats.RequestTiming(start=0.0)
    client.apply_chunk(t, {"choices": [{"text": "a", "finish_reason": None}]}, 1.0)
    client.apply_chunk(
        t, {"choices": [{"text": "", "finish_reason": None}]}, 1.1
    )  # token with no text yet
    client.apply_chunk(t, {"choices": [{"delta": {"content": "b"}}]}, 1.2)  # chat-style chunk
    client.apply_chunk(
        t, {"choices": [{"text": "", "finish_reason": "length"}]}, 1.3
    )  # closing chunk only
    client.apply_chunk(t, {"choices": [], "usage": {"completion_tokens": 3}}, 1.4)
    assert t.chunk_times == [1.0, 1.1, 1.2]
    assert t.output_tokens == 3
    e = stats.RequestTiming(start=0.0)
    client.apply_chunk(e, {"error": {"message": "too long"}}, 1.0)
    assert e.error == "too long" and not e.ok


# -- tables and JSON ------------------------------------------------------------------------


def test_format_table_aligns_and_prints_missing_values():
    out = report.format_table(
        ["name", "value"], [["a", 1.5], ["longer", None], ["x", float("nan")], ["y", 1234.56]]
    )
    lines = out.splitlines()
    assert lines[0].startswith("name") and set(lines[1]) <= {"-", " "}
    assert lines[2].endswith("1.50") and lines[3].endswith("-") and lines[4].endswith("-")
    assert lines[5].endswith("1234.6")
    assert len({len(line) for line in lines[:2]}) == 1


def test_json_output_is_strict():
    s = report.dumps({"a": float("nan"), "b": (1, float("inf")), "c": {"d": 1.5}})
    assert json.loads(s) == {"a": None, "b": [1, None], "c": {"d": 1.5}}
    assert report.ratio(1.0, 0.0) is None and report.ratio(3.0, 2.0) == 1.5
    assert report.fmt_ratio(None) == "-" and report.fmt_ratio(2.0) == "2.00x"


# -- serve plumbing -------------------------------------------------------------------------


def _serve_args(argv: list[str]) -> argparse.Namespace:
    from pagectl.bench import serve

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(argv)


def test_daemon_gets_only_changed_engine_flags():
    from pagectl.bench.serve import engine_flags

    assert engine_flags(_serve_args([])) == []
    flags = engine_flags(
        _serve_args(
            ["--max-num-seqs", "32", "--no-enable-prefix-caching", "--tp", "2", "--model", "m"]
        )
    )
    assert flags == ["--tp", "2", "--max-num-seqs", "32", "--no-enable-prefix-caching"]
    # Each flag as the parser spells it: store_true flags bare, values after their flag.
    flags = engine_flags(_serve_args(["--enforce-eager", "--kv-cache-memory", "2GiB"]))
    assert flags == ["--kv-cache-memory", "2GiB", "--enforce-eager"]


def test_paged_cache_blocks_hold_every_request_at_full_length():
    from pagectl.bench.peers import paged_cache_blocks
    from pagectl.bench.workload import BenchRequest

    w = [BenchRequest([1] * 10, 6), BenchRequest([1] * 10, 7)]  # 16 and 17 tokens
    # ceil(16 / 16) + ceil(17 / 16) pages, one spare per request, two more.
    assert paged_cache_blocks(w, 16) == 1 + 2 + 2 + 2


def test_payloads():
    from pagectl.bench.serve import pagectl_payloads, transformers_payloads

    w = random_workload(WorkloadSpec(num_requests=2, min_input_len=3, max_input_len=3))
    p = pagectl_payloads("m", w, 0.0)
    assert p[0]["prompt"] == w[0].prompt_token_ids and p[0]["max_tokens"] == w[0].output_len
    assert (
        p[0]["ignore_eos"] and p[0]["stream"] and p[0]["stream_options"] == {"include_usage": True}
    )
    t = transformers_payloads("dir", ["a b c", "d e f"], w, 0.0)
    assert (
        t[1]["prompt"] == "d e f" and json.loads(t[1]["generation_config"])["eos_token_id"] is None
    )


def test_serve_targets():
    from pagectl.bench.serve import serve_targets

    res = {
        "pagectl": {"completed": 4, "output_throughput": 300.0, "ttft_ms": {"p50": 50.0}},
        "hf-serve": {"completed": 4, "output_throughput": 90.0, "ttft_ms": {"p50": 40.0}},
    }
    t = serve_targets(res)
    assert t["output_throughput_ratio"] == pytest.approx(300 / 90)
    assert t["output_throughput_met"] is True and t["ttft_p50_lower"] is False
    assert (
        serve_targets({"pagectl": res["pagectl"], "hf-serve": {"skipped": "x"}})[
            "output_throughput_met"
        ]
        is None
    )
    # Every pagectl request failed: nothing to compare, not "0x".
    failed = {"completed": 0, "output_throughput": 0.0, "ttft_ms": {"p50": float("nan")}}
    t = serve_targets({"pagectl": failed, "hf-serve": res["hf-serve"]})
    assert t == {
        "output_throughput_ratio": None,
        "output_throughput_met": None,
        "ttft_p50_lower": None,
    }


def test_cli_parses_both_benches():
    from pagectl.cli import build_parser

    argv = [
        "bench",
        "throughput",
        "--num-requests",
        "8",
        "--peers",
        "forward",
        "--synthetic-model",
        "qwen3-tiny",
        "--json",
    ]
    args = build_parser(argv).parse_args(argv)
    assert (
        args.num_requests == 8
        and args.peers == "forward"
        and args.json
        and args.bench == "throughput"
    )
    argv = ["bench", "serve", "--url", "http://127.0.0.1:1", "--concurrency", "4"]
    args = build_parser(argv).parse_args(argv)
    assert args.concurrency == 4 and args.bench == "serve"


# -- synthetic model tokenizer --------------------------------------------------------------


def test_word_tokenizer_round_trips_token_ids(tmp_path):
    from transformers import AutoTokenizer

    from pagectl.bench.synthetic import build_word_tokenizer

    build_word_tokenizer(tmp_path, 300)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 300
    ids = [5, 299, 1, 17, 17]
    assert tok(tok.decode(ids)).input_ids == ids
    assert tok.eos_token_id == 0


# -- KV accounting benchmarks (scheduler and KV manager, no model) --------------------------


def test_kv_efficiency_is_exact_at_block_size_one():
    kv = _load_script("kv_efficiency")
    spec = WorkloadSpec(
        num_requests=8, min_input_len=5, max_input_len=40, min_output_len=3, max_output_len=20
    )
    r1 = kv.measure(spec, block_size=1)
    assert r1["peak"]["paged_share"] == 1.0  # no block can be partly empty
    r16 = kv.measure(spec, block_size=16)
    p = r16["peak"]
    assert 0 < p["live_tokens"] <= p["allocated_slots"]
    # At most one partly filled block per running sequence.
    assert p["allocated_slots"] - p["live_tokens"] < 16 * p["num_running"]
    assert p["contiguous_max_len_share"] < p["contiguous_own_len_share"] <= 1.0
    assert r16["preemptions"] == 0


def test_parallel_sampling_shares_prompt_blocks():
    ps = _load_script("parallel_sampling")
    w = random_workload(
        WorkloadSpec(
            num_requests=4, min_input_len=20, max_input_len=60, min_output_len=8, max_output_len=16
        )
    )
    r = ps.measure(w, n=4)
    assert r["shared"]["peak_blocks"] < r["independent"]["peak_blocks"]
    assert 0 < r["peak_saved"] < 1
    # Same tokens generated either way: n samples of each request's length.
    assert (
        r["shared"]["generated_tokens"]
        == r["independent"]["generated_tokens"]
        == 4 * sum(x.output_len for x in w)
    )
    assert r["independent"]["block_copies"] == 0


def test_prefix_caching_simulation_counts_prefill():
    pc = _load_script("prefix_caching")
    w = shared_prefix_workload(8, 64, 2, 6, 4, vocab_size=1000)
    off = pc.run_simulated(w, False, 256)
    on = pc.run_simulated(w, True, 256)
    assert off["prefill_tokens_computed"] == off["prompt_tokens"] and off["prefix_hit_tokens"] == 0
    assert on["prefill_tokens_computed"] + on["prefix_hit_tokens"] == on["prompt_tokens"]
    assert on["prefix_hit_tokens"] % 16 == 0 and on["prefix_hit_tokens"] > 0
    s = pc.summarize(on, off)
    assert s["fewer_prefill_tokens"] == pytest.approx(
        1 - on["prefill_tokens_computed"] / off["prompt_tokens"]
    )


@pytest.mark.parametrize("script", ["kv_efficiency", "parallel_sampling"])
def test_benchmark_scripts_print_a_table_and_json(script):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / f"{script}.py"),
            "--num-requests",
            "4",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout.splitlines()
    data = json.loads(out[-1])
    assert data["benchmark"] == script and data["results"]
    assert any(line.startswith("---") or line.startswith("-") for line in out[:-1])


# -- end to end (processes, tiny models) ----------------------------------------------------

_TINY = [
    "--synthetic-model",
    "qwen3-tiny",
    "--num-requests",
    "6",
    "--min-input-len",
    "8",
    "--max-input-len",
    "40",
]
_TINY += ["--min-output-len", "4", "--max-output-len", "12", "--json"]


def _pagectl(argv: list[str], tmp_path: Path, timeout: int = 300) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PAGECTL_BENCH_CACHE": str(tmp_path / "models")}
    proc = subprocess.run(
        [sys.executable, "-m", "pagectl", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow
def test_bench_throughput_end_to_end(tmp_path):
    rep = _pagectl(
        ["bench", "throughput", *_TINY, "--peers", "forward,hf-static", "--hf-batch-size", "4"],
        tmp_path,
    )
    total = rep["workload"]["num_requests"]
    st = rep["results"]["hf-static"]
    assert (
        st["num_requests"] == total and st["num_length_mismatches"] == 0 and st["tokens_per_s"] > 0
    )
    assert rep["results"]["forward"]["tokens_per_s"] > 0
    assert rep["results"]["forward"]["extra"]["last_logits_tokens_per_s"] > 0
    pc = rep["results"]["pagectl"]
    if pc["error"] is None:  # the engine is present: every request got exactly its length
        assert pc["num_length_mismatches"] == 0
        assert pc["useful_output_tokens"] == st["useful_output_tokens"]
        assert rep["ratios"]["pagectl/hf-static"] is not None


@pytest.mark.slow
def test_bench_serve_end_to_end_against_a_fake_engine_daemon(tmp_path):
    argv = ["bench", "serve", *_TINY, "--concurrency", "3", "--peers", "none"]
    argv += [
        "--daemon-arg=--engine-factory",
        "--daemon-arg=pagectl.testing.fake_engine:fake_engine",
    ]
    rep = _pagectl(argv, tmp_path)
    m = rep["results"]["pagectl"]
    assert m["completed"] == 6 and m["failed"] == 0
    w = random_workload(WorkloadSpec(**rep["workload"]))
    assert m["total_output_tokens"] == sum(
        r.output_len for r in w
    )  # ignore_eos honoured, usage counted
    assert m["ttft_ms"]["p50"] > 0 and m["itl_ms"]["p99"] >= m["itl_ms"]["p50"]
