"""The code stays lint-clean and type-checks (the same tools and versions as `[dev]`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed ([dev] extra)")
def test_ruff_check():
    res = _run(
        "ruff", "check", "pagectl", "tests", "benchmarks", "scripts", "--output-format", "concise"
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_mypy():
    pytest.importorskip("mypy")
    res = _run(sys.executable, "-m", "mypy")
    assert res.returncode == 0, res.stdout + res.stderr


def test_engine_imports_no_server_or_console_libraries():
    """pagectl.engine must not import aiohttp, zmq or textual (checked in a fresh process)."""
    code = (
        "import sys, pagectl.engine.core, pagectl.engine.llm, pagectl.engine.builder;"
        "bad = [m for m in ('aiohttp', 'zmq', 'textual') if m in sys.modules];"
        "print(','.join(bad))"
    )
    res = _run(sys.executable, "-c", code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == ""
