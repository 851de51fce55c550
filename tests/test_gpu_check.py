"""benchmarks/gpu_check.py in smoke mode on CPU: the same phases as on a GPU, on a tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_checks_and_measures_every_cpu_configuration(gpu_check, tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--smoke", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    report = json.loads(printed[-1])  # the last line printed: the report as JSON
    saved = json.loads((tmp_path / "report.json").read_text())
    assert report["correctness"] == saved["correctness"]
    assert saved["passed"] and report["passed"]
    assert [r["config"] for r in saved["correctness"]] == ["torch", "cpu-kernel"]
    for row in saved["correctness"]:
        assert row["passed"] and row["first_divergence"] is None
        assert row["tokens"] == 4 * 6  # smoke: 4 prompts, 6 greedy tokens each
        assert row["max_abs_logprob_diff"] < 0.2
    # float32: token for token against transformers.
    assert [r["config"] for r in saved["exact_fp32"]] == ["torch", "cpu-kernel"]
    for row in saved["exact_fp32"]:
        assert row["passed"] and row["hf_argmax_agreement"] == 1.0
        assert row["engine"]["kv_cache_dtype"] == "float32"
        assert row["engine"]["attention_backend"] == row["config"]
    assert [r["config"] for r in saved["throughput"]] == ["torch", "cpu-kernel"]
    for row in saved["throughput"]:
        assert row["requests"] == 6 and row["wrong_lengths"] == 0 and row["output_tok_s"] > 0
    # Decode rate at fixed batches (smoke: 1 and 4), per configuration.
    assert [(d["config"], d["batch"]) for d in saved["decode"]] == [
        ("torch", 1),
        ("torch", 4),
        ("cpu-kernel", 1),
        ("cpu-kernel", 4),
    ]
    assert all(d["decode_tok_s"] > 0 for d in saved["decode"])
    table = (tmp_path / "table.txt").read_text()
    assert "throughput (nano-vllm workload)" in table and "cpu-kernel" in table


def test_a_divergence_is_reported_with_its_position(gpu_check, tmp_path):
    # A zero tolerance turns any rounding difference into a reported divergence.
    argv = ["--device", "cpu", "--smoke", "--out", str(tmp_path), "--skip-throughput"]
    argv.append("--skip-fp32")
    assert gpu_check.main(argv + ["--prompts", "2", "--logprob-tol", "0"]) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert not report["passed"]
    first = report["correctness"][0]["first_divergence"]
    assert first is not None
    assert {"prompt", "position", "token", "logprob", "hf_logprob", "hf_argmax"} <= set(first)
    assert abs(first["logprob"] - first["hf_logprob"]) > 0
