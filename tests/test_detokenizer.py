"""Incremental detokenization and stop strings, against a plain full-decode reference."""

from __future__ import annotations

import pytest
from tiny_models import build_tokenizer

from pagectl.engine.sampling_params import SamplingParams
from pagectl.engine.tokenizer import IncrementalDetokenizer, apply_chat_template, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d)
    return load_tokenizer(d)


TEXT = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))  # émoji ✓ done\n"


def stream(tok, text: str, params: SamplingParams, prompt: str = "x = 1\n"):
    prompt_ids = tok(prompt).input_ids
    ids = tok(text).input_ids
    d = IncrementalDetokenizer(tok, prompt_ids, params)
    pieces = []
    for t in ids:
        pieces.append(d.push([t]))
        if d.stop_hit is not None:
            break
    pieces.append(d.flush())
    return d, "".join(pieces)


def test_streamed_text_equals_full_decode(tok):
    d, out = stream(tok, TEXT, SamplingParams())
    assert out == TEXT == d.text
    assert d.stop_hit is None


@pytest.mark.parametrize("stop", ["return", "\n\n", "(1, 2)", "✓"])
def test_stop_string_cuts_text_and_never_leaks(tok, stop):
    d, out = stream(tok, TEXT, SamplingParams(stop=[stop]))
    assert d.stop_hit == stop
    assert out == TEXT[: TEXT.index(stop)]
    assert stop not in out


def test_include_stop_str_in_output(tok):
    d, out = stream(tok, TEXT, SamplingParams(stop=["b):"], include_stop_str_in_output=True))
    assert out == "def add(a, b):"


def test_earliest_of_several_stop_strings_wins(tok):
    d, out = stream(tok, TEXT, SamplingParams(stop=["print", "return"]))
    assert d.stop_hit == "return" and out == "def add(a, b):\n    "


def test_no_tokenizer_gives_no_text():
    d = IncrementalDetokenizer(None, [1, 2], SamplingParams(stop=["x"]))
    assert d.push([5, 6]) == "" and d.flush() == "" and d.stop_hit is None


def test_chat_template(tok):
    ids = apply_chat_template(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="no tokenizer"):
        apply_chat_template(None, [{"role": "user", "content": "hi"}])


def test_dir_without_tokenizer_files_loads_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(tmp_path) is None


def test_incomplete_utf8_at_the_end_is_flushed(tok):
    ids = tok("ok ✓").input_ids
    d = IncrementalDetokenizer(tok, [], SamplingParams())
    out = "".join(d.push([t]) for t in ids[:-1])  # stop in the middle of the ✓ bytes
    out += d.flush()
    assert out == d.text == tok.decode(ids[:-1])


def test_llm_text_ends_with_a_token_cut_inside_a_character(tmp_path):
    """The offline API's final text is the full decode of the output tokens, even when the
    last token ends in the middle of a multi-byte character."""
    from tiny_models import build_tiny_model

    from pagectl import LLM

    path = build_tiny_model(tmp_path / "m", "qwen3", seed=3)
    tok = load_tokenizer(path)
    partial = next(i for i in range(len(tok)) if tok.decode([i]) == "\ufffd")
    with LLM(str(path), dtype="float32", num_kv_blocks=32) as llm:
        sp = SamplingParams(max_tokens=1, temperature=0, logit_bias={partial: 100})
        out = llm.generate("ok ", sp)[0].outputs[0]
    assert out.token_ids == [partial]
    assert out.text == tok.decode([partial]) == "\ufffd"
