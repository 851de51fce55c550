"""HF -> GGUF with llama.cpp's ``convert_hf_to_gguf.py``, run by the llama-cpp venv's
interpreter: ``python gguf_convert.py CONVERTER MODEL_DIR OUT_FILE OUTTYPE``.

The benchmark models' word-level tokenizer (one word per id) is not a form the converter
accepts, so for them the vocabulary is written directly as a GPT-2-style BPE vocabulary with
the same token strings and ids (one placeholder merge, which llama.cpp's BPE loader needs):
requests are sent as token ids, so tokenization never runs. Other models convert as they are.

The converter is either one file with every model class in it (older llama.cpp) or a thin
script over a ``conversion`` package beside it whose model modules load on demand through
``get_model_class``; the vocabulary hook covers both. CONVERTER may be a symbolic link into
the llama.cpp sources: the directory it resolves to is the one searched for ``conversion``
and ``gguf-py``.
"""

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any


def _patch_class(cls: type, set_vocab: Any) -> None:
    """``set_vocab`` on ``cls`` and on every base that defines its own (a subclass's
    ``super().set_vocab()`` then still reaches the word vocabulary)."""
    for c in cls.__mro__:
        if "set_vocab" in vars(c):
            setattr(c, "set_vocab", set_vocab)  # noqa: B010


def main() -> None:
    converter, model_dir, out, outtype = sys.argv[1:5]
    src = Path(converter).resolve()
    sys.path.insert(0, str(src.parent))
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", src)
    assert spec is not None and spec.loader is not None, converter
    conv: Any = importlib.util.module_from_spec(spec)
    sys.modules["convert_hf_to_gguf"] = conv
    spec.loader.exec_module(conv)
    if (Path(model_dir) / "pagectl_synthetic.json").exists():
        import gguf

        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        vocab_size = cfg["vocab_size"]

        def set_vocab(self: Any) -> None:
            words = ["<|endoftext|>"] + [f"t{i}" for i in range(1, vocab_size)]
            types = [gguf.TokenType.CONTROL] + [gguf.TokenType.NORMAL] * (vocab_size - 1)
            w = self.gguf_writer
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre("qwen2")
            w.add_token_list(words)
            w.add_token_types(types)
            w.add_token_merges(["t 1"])
            w.add_eos_token_id(0)
            w.add_pad_token_id(0)
            w.add_add_bos_token(False)

        # One-file converter: every model class is a module attribute.
        text_model = getattr(conv, "TextModel", None)
        if text_model is not None:
            for cls in list(vars(conv).values()):
                if isinstance(cls, type) and issubclass(cls, text_model):
                    _patch_class(cls, set_vocab)
        # Package converter: the model class arrives through get_model_class.
        get_model_class = getattr(conv, "get_model_class", None)
        if get_model_class is not None:

            def patched_get_model_class(*args: Any, **kw: Any) -> Any:
                cls = get_model_class(*args, **kw)
                _patch_class(cls, set_vocab)
                return cls

            conv.get_model_class = patched_get_model_class
    sys.argv = [converter, model_dir, "--outfile", out, "--outtype", outtype]
    conv.main()


if __name__ == "__main__":
    main()
