import os
import sys

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
