"""The engine process's native-memory bounds: set before torch loads, trim only when idle."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagectl.engine_process import native_memory
from pagectl.engine_process.native_memory import ENV_DEFAULTS, IdleTrim


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_idle_trim_runs_once_per_idle_period_and_never_before_the_delay():
    clock = Clock()
    calls = []
    t = IdleTrim(after_s=2.0, trim=lambda: calls.append(clock.t) or True, clock=clock)
    t.idle()
    assert calls == []  # never stepped: nothing freed to give back
    t.busy()
    clock.t += 1.9
    t.idle()
    assert calls == []
    clock.t += 0.2
    t.idle()
    t.idle()
    clock.t += 60
    t.idle()
    assert calls == [pytest.approx(102.1)] and t.trims == 1
    t.busy()  # a new burst, then idle again: one more
    clock.t += 2.5
    t.idle()
    assert len(calls) == 2 and t.trims == 2


def test_configure_sets_defaults_and_leaves_the_operators_values(monkeypatch):
    name = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    monkeypatch.delenv("PAGECTL_NATIVE_MEMORY", raising=False)
    monkeypatch.delenv(name, raising=False)
    assert native_memory.configure()[name] == ENV_DEFAULTS[name]
    monkeypatch.setenv(name, "512")
    assert name not in native_memory.configure()
    assert native_memory.os.environ[name] == "512"
    monkeypatch.delenv(name)
    monkeypatch.setenv("PAGECTL_NATIVE_MEMORY", "0")
    assert native_memory.configure() == {} and name not in native_memory.os.environ


def test_malloc_trim_works_here():
    assert native_memory.malloc_trim() is True  # glibc on the machines we test on


def test_the_engine_entry_imports_no_torch_before_configure():
    # configure() must run before torch loads; torch reads these settings once.
    code = (
        "import sys, pagectl.engine_process.main as m; "
        "assert 'torch' not in sys.modules, 'torch imported by the entry module'; "
        "m.native_memory.configure(); import os; "
        "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    )
    env = {k: v for k, v in native_memory.os.environ.items() if not k.startswith("ONEDNN")}
    env.pop("PAGECTL_NATIVE_MEMORY", None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ENV_DEFAULTS["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
