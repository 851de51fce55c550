"""Request fields that vLLM or OpenAI document for the generation endpoints and pagectl does
not implement: a request that sets one (to anything but its no-op value) gets a 400 naming
it. Fields nobody documents are ignored, as OpenAI's server does, with a debug log line.
"""

from __future__ import annotations

import logging
from typing import Any

from pagectl.server.errors import bad_request

log = logging.getLogger("pagectl.server")

# Field -> the values that change nothing (accepted). Missing or null is always accepted.
_REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    "truncate_prompt_tokens": (),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "logits_processors": ([],),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "prompt_embeds": (),
    "mm_processor_kwargs": (),
    "request_id": (),
    "spaces_between_special_tokens": (True,),
    "reasoning_effort": (),
    "include_reasoning": (True,),
    "thinking_token_budget": (),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "service_tier": ("auto", "default"),
    "store": (False,),
    "metadata": (),
    "verbosity": (),
    "prompt_cache_key": (),
    "safety_identifier": (),
    "function_call": (),
    "functions": (),
}

# Beam search (server/validation.py: _beam_search), on both endpoints.
_BEAM_SEARCH_FIELDS = ("use_beam_search", "length_penalty", "early_stopping")

# Fields both generation endpoints take (sampling, structured outputs, beam search, ...).
_SHARED_FIELDS = (
    *_BEAM_SEARCH_FIELDS,
    "model",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "prompt_logprobs",
    "add_special_tokens",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
    "guided_whitespace_pattern",
    "structural_tag",
    "priority",
    "cache_salt",
)

COMPLETION_FIELDS = frozenset(
    [
        *_SHARED_FIELDS,
        "prompt",
        "best_of",
        "suffix",
    ]
)
CHAT_FIELDS = frozenset(
    [
        *_SHARED_FIELDS,
        "messages",
        "top_logprobs",
        "max_completion_tokens",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "chat_template",
        "chat_template_kwargs",
    ]
)


def check_fields(body: dict, known: frozenset[str], endpoint: str) -> None:
    """400 for a documented field pagectl does not implement; a debug line for unknown ones."""
    for name, value in body.items():
        if name in known or value is None:
            continue
        if name in _REFUSED_UNLESS:
            if any(_same(value, ok) for ok in _REFUSED_UNLESS[name]):
                continue
            raise bad_request(f"`{name}` is not supported by pagectl", name)
        log.debug("%s: ignoring unknown field %r", endpoint, name)


def _same(a: Any, b: Any) -> bool:
    """Equal, with booleans never equal to numbers (True is not 1 here)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return bool(a == b)
