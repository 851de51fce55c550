"""``peer_scripts/gguf_convert.py`` against stand-ins of llama.cpp's two converter layouts.

llama.cpp's ``convert_hf_to_gguf.py`` is either one file holding every model class, or a
thin script over a ``conversion`` package whose model modules are imported on demand by
``get_model_class``. For a benchmark model (word-level tokenizer) the vocabulary hook must
reach the model class in both, through its own ``set_vocab`` and any base's, and write the
words at their ids; for any other model the converter runs untouched. The stand-ins record
what the hook wrote (a real converter needs the ``gguf`` package, which lives in the
llama-cpp venv only).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagectl.bench import external

SCRIPT = Path(external.__file__).parent / "peer_scripts" / "gguf_convert.py"

# A stand-in for the gguf package: the names the hook uses.
GGUF = """
import enum
class TokenType(enum.IntEnum):
    NORMAL = 1
    CONTROL = 3
"""

# Model classes as llama.cpp writes them: the Qwen3 class inherits Qwen2's set_vocab, which
# cannot read a word-level tokenizer; the base TextModel has its own.
MODELS = """
class Writer:
    def __init__(self):
        self.calls = []
    def __getattr__(self, name):
        return lambda *args: self.calls.append([name, list(args)])

class TextModel:
    def __init__(self):
        self.gguf_writer = Writer()
    def set_vocab(self):
        raise FileNotFoundError("tokenizer.model")

class Qwen2Model(TextModel):
    def set_vocab(self):
        raise FileNotFoundError("no BPE vocabulary in a word-level tokenizer")

class Qwen3Model(Qwen2Model):
    pass
"""

MAIN = """
import json, sys
def main():
    out = sys.argv[sys.argv.index("--outfile") + 1]
    model = get_model_class("Qwen3ForCausalLM")()
    model.set_vocab()
    with open(out, "w") as f:
        json.dump(model.gguf_writer.calls, f)
"""


def _package_layout(root: Path) -> Path:
    (root / "conversion").mkdir(parents=True)
    (root / "gguf-py" / "gguf").mkdir(parents=True)
    (root / "gguf-py" / "gguf" / "__init__.py").write_text(GGUF)
    (root / "conversion" / "__init__.py").write_text(
        textwrap.dedent("""
            def get_model_class(name):
                from conversion import qwen
                return {"Qwen3ForCausalLM": qwen.Qwen3Model}[name]
        """)
    )
    (root / "conversion" / "qwen.py").write_text(MODELS)
    conv = root / "convert_hf_to_gguf.py"
    conv.write_text(
        "import sys\nfrom pathlib import Path\n"
        "sys.path.insert(1, str(Path(__file__).parent / 'gguf-py'))\n"
        "from conversion import get_model_class\n" + MAIN
    )
    return conv


def _one_file_layout(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "gguf.py").write_text(GGUF)
    conv = root / "convert_hf_to_gguf.py"
    conv.write_text(
        MODELS
        + "\ndef get_model_class(name):\n    return {'Qwen3ForCausalLM': Qwen3Model}[name]\n"
        + MAIN
    )
    return conv


def _model_dir(root: Path, synthetic: bool) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"vocab_size": 5}))
    if synthetic:
        (root / "pagectl_synthetic.json").write_text("{}")
    return root


@pytest.mark.parametrize("layout", [_package_layout, _one_file_layout])
def test_the_word_vocabulary_is_written_at_its_ids(tmp_path, layout):
    conv = layout(tmp_path / "llama.cpp")
    # Installed as a link from the venv's bin/, as install_peers.sh does.
    (tmp_path / "bin").mkdir()
    link = tmp_path / "bin" / "convert_hf_to_gguf.py"
    link.symlink_to(conv)
    model = _model_dir(tmp_path / "model", synthetic=True)
    out = tmp_path / "out.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), str(link), str(model), str(out), "f32"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    calls = dict((name, args) for name, args in json.loads(out.read_text()))
    assert calls["add_tokenizer_model"] == ["gpt2"]
    assert calls["add_token_list"] == [["<|endoftext|>", "t1", "t2", "t3", "t4"]]
    assert calls["add_token_types"] == [[3, 1, 1, 1, 1]]
    assert calls["add_eos_token_id"] == [0]


def test_other_models_convert_untouched(tmp_path):
    conv = _package_layout(tmp_path / "llama.cpp")
    model = _model_dir(tmp_path / "model", synthetic=False)
    res = subprocess.run(
        [sys.executable, str(SCRIPT), str(conv), str(model), str(tmp_path / "o"), "f32"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0
    assert "no BPE vocabulary" in res.stderr
