"""HF -> GGUF with llama.cpp's ``convert_hf_to_gguf.py``, run by the llama-cpp venv's
interpreter: ``python gguf_convert.py CONVERTER MODEL_DIR OUT_FILE OUTTYPE``.

The benchmark models' word-level tokenizer (one word per id) is not a form the converter
accepts, so for them the vocabulary is written directly as a GPT-2-style BPE vocabulary with
the same token strings and ids (one placeholder merge, which llama.cpp's BPE loader needs):
requests are sent as token ids, so tokenization never runs. Other models convert as they are.
"""

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any


def main() -> None:
    converter, model_dir, out, outtype = sys.argv[1:5]
    sys.path.insert(0, str(Path(converter).parent))
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", converter)
    assert spec is not None and spec.loader is not None, converter
    conv: Any = importlib.util.module_from_spec(spec)
    sys.modules["convert_hf_to_gguf"] = conv
    spec.loader.exec_module(conv)
    if (Path(model_dir) / "pagectl_synthetic.json").exists():
        import gguf

        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        vocab_size = cfg["vocab_size"]

        def set_vocab(self):
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

        conv.TextModel.set_vocab = set_vocab
        for cls in vars(conv).values():
            if (
                isinstance(cls, type)
                and "set_vocab" in vars(cls)
                and issubclass(cls, conv.TextModel)
            ):
                setattr(cls, "set_vocab", set_vocab)  # noqa: B010
    sys.argv = [converter, model_dir, "--outfile", out, "--outtype", outtype]
    conv.main()


if __name__ == "__main__":
    main()
