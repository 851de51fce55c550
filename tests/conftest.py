import os
import sys
import time

import pytest

# Helpers shared by the tests (tiny_models, fakes) live next to them.
sys.path.insert(0, os.path.dirname(__file__))


def pytest_addoption(parser):
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run tests marked `extended` (long stress, fuzzing and soak budgets)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--extended"):
        return
    skip = pytest.mark.skip(reason="long budget: run with --extended")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def utc(monkeypatch):
    """Event times are shown in local time: pin the zone (a module that shows them takes it
    with ``pytestmark = pytest.mark.usefixtures("utc")``)."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """One tiny Qwen3 checkpoint per test session, shared by the daemon test modules."""
    from tiny_models import build_tiny_model

    d = tmp_path_factory.getbasetemp() / "tiny-qwen3"
    if not (d / "config.json").exists():
        build_tiny_model(d, "qwen3")
    return d


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    """A directory holding the tiny byte-level BPE tokenizer."""
    from tiny_models import build_tokenizer

    d = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(d)
    return d


@pytest.fixture
def make_client(aiohttp_client, tok_dir):
    """``await make_client(settings, **engine_args)`` -> (aiohttp test client, InProcessEngine):
    the HTTP app around a real EngineCore with the fake model and the tiny tokenizer."""
    from pagectl.engine.args import EngineArgs
    from pagectl.server.app import create_app
    from pagectl.server.state import ServerSettings
    from pagectl.testing.fake_engine import fake_engine
    from pagectl.testing.in_process import InProcessEngine

    async def make(settings: ServerSettings | None = None, **engine_kw):
        kw = {"num_kv_blocks": 64, "max_num_batched_tokens": 64, "max_model_len": 256}
        kw.update(engine_kw)
        engine = InProcessEngine(fake_engine(EngineArgs(model=str(tok_dir), **kw)))
        client = await aiohttp_client(create_app(settings or ServerSettings(), engine))
        return client, engine

    return make


@pytest.fixture(scope="module")
def module_daemon(tmp_path_factory):
    """``module_daemon(args, chat_template=None)`` -> a started ``DaemonProcess`` with its own
    runtime dir, killed after the module's last test. ``chat_template`` (Jinja source) is
    written to a file, passed as ``--chat-template`` ahead of ``args``."""
    from pagectl.testing.daemon_process import DaemonProcess

    started = []

    def start(args: list[str], chat_template: str | None = None) -> DaemonProcess:
        if chat_template is not None:
            path = tmp_path_factory.mktemp("tpl") / "chat.jinja"
            path.write_text(chat_template)
            args = ["--chat-template", str(path), *args]
        d = DaemonProcess(tmp_path_factory.mktemp("rt"), args)
        started.append(d)
        return d.start()

    yield start
    for d in started:
        d.kill()


@pytest.fixture(scope="module")
def tiny_daemon(module_daemon, tiny_qwen3):
    """``tiny_daemon(args, chat_template=None, positional_model=False)``: ``module_daemon``
    serving ``tiny_qwen3`` as ``tiny`` (``--model DIR``, or ``DIR`` alone as ``vllm serve``
    takes it, then ``--served-model-name tiny`` ahead of ``args``)."""

    def start(args: list[str], chat_template: str | None = None, positional_model: bool = False):
        model = [str(tiny_qwen3)] if positional_model else ["--model", str(tiny_qwen3)]
        return module_daemon([*model, "--served-model-name", "tiny", *args], chat_template)

    return start


@pytest.fixture(scope="module")
def structured_daemon(tiny_daemon):
    """``structured_daemon(args, **kw)``: ``tiny_daemon`` in float32 with 256 KV blocks and
    xgrammar structured outputs that allow no free whitespace, then ``args`` (``kw`` as
    ``tiny_daemon`` takes it)."""
    structured = '{"backend": "xgrammar", "disable_any_whitespace": true}'

    def start(args: list[str], **kw):
        settings = ["--num-kv-blocks", "256", "--dtype", "float32"]
        return tiny_daemon([*settings, "--structured-outputs-config", structured, *args], **kw)

    return start
