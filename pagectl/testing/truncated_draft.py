"""A draft model cut from a target: its first ``num_layers`` decoder layers, its embedding,
final norm and LM head, and its tokenizer files, so that it shares the target's vocabulary.

Used by the tests and by ``scripts/make_draft_model.py`` (the benchmark's draft of the
built-in model). No training: the draft is the target's shallow prefix, whose next-token
guesses often agree with the whole model's on repetitive text.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Files copied as they are (tokenizer, chat template, generation defaults).
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def write_truncated_draft(src: str | Path, dst: str | Path, num_layers: int) -> Path:
    """Write the draft directory ``dst`` from the model directory ``src``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                m = _LAYER.match(name)
                if m is None or int(m.group(1)) < num_layers:
                    tensors[name] = st.get_tensor(name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    return dst
