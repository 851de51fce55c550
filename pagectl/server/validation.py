"""Request validation for the OpenAI-compatible API: everything is checked here, in the API
server, before anything reaches the engine.

The body was parsed by ``json_fields.parse_json`` (which refuses NaN, Infinity and numbers
that overflow); ``parse_completion`` / ``parse_chat`` turn a body into a
``GenerationSpec`` or raise ``APIError`` (400 / 404) naming the offending field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagectl.engine.beam_search import BeamSearchParams
from pagectl.engine.sampling_params import SamplingParams
from pagectl.server import chat
from pagectl.server.chat import ChatSettings
from pagectl.server.errors import APIError, bad_request
from pagectl.server.fields import CHAT_FIELDS, COMPLETION_FIELDS, check_fields
from pagectl.server.json_fields import get_bool, get_int, get_number, get_str, is_int
from pagectl.server.structured import Constraint, parse_structured
from pagectl.server.tools.request import ToolSpec, parse_tools

# Most prompts in one completions request, and most messages in one chat request.
MAX_PROMPTS = 256


@dataclass
class ModelFacts:
    """What the API server knows about the served model (from the engine handshake)."""

    served_model_name: str
    vocab_size: int
    max_model_len: int
    tokenizer: Any | None
    # Default sampling parameters (from the model's generation_config.json): a field the
    # request leaves out takes its value from here, then from SamplingParams' own default.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # Largest text prompt (UTF-8 bytes, all prompts or messages of a request together)
    # accepted for tokenization (--max-prompt-bytes); checked before any work.
    max_prompt_bytes: int = 2 * 1024 * 1024
    # Most characters one token of this tokenizer stands for (its longest vocabulary entry;
    # 0: unknown). A text longer than max_model_len * this * 4 cannot fit the context, so
    # it is refused before it is tokenized (the 4 covers normalizers that merge characters).
    max_chars_per_token: int = 0
    # The daemon's chat options (templates, tool-call and reasoning parsers).
    chat: ChatSettings = field(default_factory=ChatSettings)
    # Further names accepted for the model (responses report served_model_name).
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.aliases)


@dataclass
class Prompt:
    token_ids: list[int]
    # The prompt as text when it was sent (or rendered) as text; for echo.
    text: str | None = None


@dataclass
class GenerationSpec:
    """A validated generation request."""

    prompts: list[Prompt]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    # Completions: top-k logprobs per token (None: off). Chat: top_logprobs when logprobs.
    logprobs: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    # The structured-outputs constraint and the field it came from (None: unconstrained).
    constraint: Constraint | None = None
    # Chat: what the request asked of tools.
    tools: ToolSpec | None = None
    # Completions: top-k logprobs of each prompt token, returned per choice (None: off).
    prompt_logprobs: int | None = None
    # use_beam_search: the beam search (beam_width = n) that replaces sampling.
    beam: BeamSearchParams | None = None


def check_model(body: dict, facts: ModelFacts) -> None:
    """404 for a model this daemon does not serve (a missing model means the served one)."""
    model = get_str(body, "model")
    if model is not None and model not in facts.names:
        raise APIError(
            404,
            f"The model `{model}` does not exist. This daemon serves `{facts.served_model_name}`.",
            param="model",
            code="model_not_found",
        )


# -- sampling -----------------------------------------------------------------------------

_NUMBER_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_FIELDS = ("n", "top_k", "seed", "min_tokens")
_BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens")


# Sampling fields that mean nothing to beam search, with the values that change nothing:
# any other value is refused with use_beam_search.
_BEAM_NO_OP: dict[str, tuple] = {
    "temperature": (0,),
    "top_p": (1,),
    "top_k": (0, -1),
    "min_p": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "stop": ([],),
    "stop_token_ids": ([],),
    "min_tokens": (0,),
    "logprobs": (False,),
    "echo": (False,),
    "include_stop_str_in_output": (False,),
    "seed": (),
    "top_logprobs": (),
}


def _beam_search(body: dict, spec: GenerationSpec) -> None:
    """vLLM's beam search fields: ``use_beam_search`` (beam width = n), ``length_penalty``
    and ``early_stopping`` (true, false or "never"); the latter two need the first."""
    if not get_bool(body, "use_beam_search"):
        for name in ("length_penalty", "early_stopping"):
            if body.get(name) is not None:
                raise bad_request(f"{name} requires use_beam_search", name)
        return
    if spec.stream:
        raise bad_request("streaming is not supported with use_beam_search", "stream")
    for name, no_op in _BEAM_NO_OP.items():
        v = body.get(name)
        if v is not None and not any(
            v == a and isinstance(v, bool) == isinstance(a, bool) for a in no_op
        ):
            raise bad_request(f"{name} is not supported with use_beam_search", name)
    early = body.get("early_stopping", False)
    if early not in (True, False, "never") or early in (0, 1) and not isinstance(early, bool):
        raise bad_request('early_stopping must be true, false or "never"', "early_stopping")
    p = spec.params
    if p.max_tokens is None:
        raise bad_request("use_beam_search needs max_tokens", "max_tokens")
    try:
        spec.beam = BeamSearchParams(
            beam_width=p.n,
            max_tokens=p.max_tokens,
            ignore_eos=p.ignore_eos,
            length_penalty=float(get_number(body, "length_penalty", 1.0)),
            early_stopping=early,
        )
    except ValueError as e:  # the message starts with the field at fault
        message = str(e)
        param = next((f for f in ("length_penalty", "max_tokens") if message.startswith(f)), "n")
        raise bad_request(message, param) from None


def _sampling_kwargs(body: dict) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    for name in _NUMBER_FIELDS:
        v = get_number(body, name)
        if v is not None:
            kw[name] = v
    for name in _INT_FIELDS:
        v = get_int(body, name)
        if v is not None:
            kw[name] = v
    for name in _BOOL_FIELDS:
        if body.get(name) is not None:
            kw[name] = get_bool(body, name)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise bad_request("stop must be a string or a list of strings", "stop")
        kw["stop"] = stop
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(is_int(t) for t in ids):
            raise bad_request("stop_token_ids must be a list of integers", "stop_token_ids")
        kw["stop_token_ids"] = ids
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise bad_request("logit_bias must be an object of token id -> bias", "logit_bias")
        kw["logit_bias"] = bias
    return kw


def _with_defaults(
    kw: dict[str, Any],
    max_tokens: int | None,
    prompts: list[Prompt],
    facts: ModelFacts,
    fallback_max_tokens: int | None,
) -> dict[str, Any]:
    """Fill what the request left out from the model's defaults. A max_tokens the request did
    not give (the model's, else ``fallback_max_tokens``; None: the rest of the context) is
    shortened to the room the context leaves, so it is never an error by itself."""
    defaults = facts.sampling_defaults
    out = {k: v for k, v in defaults.items() if k != "max_tokens"}
    out.update(kw)
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens", fallback_max_tokens)
        if max_tokens is not None:
            room = facts.max_model_len - max(len(p.token_ids) for p in prompts)
            max_tokens = min(max_tokens, room) if room >= 1 else None
    out["max_tokens"] = max_tokens
    return out


def _build_params(kw: dict[str, Any], vocab_size: int) -> SamplingParams:
    try:
        params = SamplingParams(**kw)
        params.validate(vocab_size)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), getattr(e, "param", None)) from None
    return params


def _check_unsupported(body: dict) -> None:
    if body.get("suffix"):
        raise bad_request("`suffix` is not supported by pagectl", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise bad_request("`best_of` is not supported by pagectl (use n)", "best_of")


def _constrain(body: dict, kw: dict[str, Any], spec_constraint: Constraint | None) -> None:
    if spec_constraint is not None:
        kw["structured_outputs"] = spec_constraint.params


def _common(body: dict, spec: GenerationSpec) -> None:
    spec.stream = get_bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad_request("stream_options must be an object", "stream_options")
        spec.include_usage = spec.stream and get_bool(opts, "include_usage")
    spec.priority = get_int(body, "priority", 0)
    salt = get_str(body, "cache_salt")
    if salt is not None and not salt:
        raise bad_request("cache_salt must be a non-empty string", "cache_salt")
    spec.cache_salt = salt
    get_str(body, "user")


def _check_context(
    prompts: list[Prompt], max_tokens: int | None, facts: ModelFacts, param: str
) -> None:
    limit = facts.max_model_len
    for p in prompts:
        n = len(p.token_ids)
        if max_tokens is None and n >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, the prompt "
                f"has {n} tokens, leaving no room for the completion.",
                param,
            )
        if max_tokens is not None and n + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} for the completion). "
                "Please reduce the prompt or max_tokens.",
                param,
            )


# -- prompts ------------------------------------------------------------------------------


def _token_prompt(ids: list, facts: ModelFacts) -> Prompt:
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    vocab = facts.vocab_size
    for t in ids:
        if not is_int(t) or not 0 <= t < vocab:
            raise bad_request(
                f"prompt token id {json.dumps(t)} is outside the vocabulary [0, {vocab})", "prompt"
            )
    return Prompt(list(ids))


def text_bytes(text: str) -> int:
    """UTF-8 size of ``text`` (cheap for ASCII)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def check_prompt_size(num_bytes: int, facts: ModelFacts, param: str, *, context: bool) -> None:
    """400 before tokenization for text past --max-prompt-bytes, or (``context``) for text too
    long to fit the model's context whatever its tokens are."""
    if num_bytes > facts.max_prompt_bytes:
        raise bad_request(
            f"the prompt text is {num_bytes} bytes; this server accepts at most "
            f"{facts.max_prompt_bytes} bytes (--max-prompt-bytes)",
            param,
        )
    per_token = facts.max_chars_per_token
    if context and per_token and num_bytes > facts.max_model_len * per_token * 4:
        raise bad_request(
            f"the prompt text is {num_bytes} bytes, more than {facts.max_model_len} tokens "
            f"(this model's maximum context length) can hold",
            param,
        )


def _text_prompt(text: str, facts: ModelFacts, add_special_tokens: bool = True) -> Prompt:
    if not text:
        raise bad_request("the prompt is empty", "prompt")
    tok = facts.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer: send the prompt as token ids", "prompt")
    check_prompt_size(text_bytes(text), facts, "prompt", context=True)
    ids = list(tok.encode(text, add_special_tokens=add_special_tokens))
    if not ids:
        raise bad_request("the prompt is empty after tokenization", "prompt")
    return Prompt(ids, text)


def parse_prompts(value: Any, facts: ModelFacts, add_special_tokens: bool = True) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if value is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(value, str):
        return [_text_prompt(value, facts, add_special_tokens)]
    shape_error = bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists",
        "prompt",
    )
    if not isinstance(value, list):
        raise shape_error
    if not value:
        raise bad_request("the prompt is empty", "prompt")
    if all(is_int(t) for t in value):
        return [_token_prompt(value, facts)]
    if len(value) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    if all(isinstance(p, str) for p in value):
        check_prompt_size(sum(map(text_bytes, value)), facts, "prompt", context=False)
        return [_text_prompt(p, facts, add_special_tokens) for p in value]
    if all(isinstance(p, list) for p in value):
        return [_token_prompt(p, facts) for p in value]
    raise shape_error


# -- endpoints ----------------------------------------------------------------------------


def parse_completion(body: dict, facts: ModelFacts) -> GenerationSpec:
    check_model(body, facts)
    check_fields(body, COMPLETION_FIELDS, "completions")
    _check_unsupported(body)
    constraint = parse_structured(body)
    prompts = parse_prompts(body.get("prompt"), facts, get_bool(body, "add_special_tokens", True))
    # Completions default to 16 tokens (OpenAI's default) unless the model sets its own.
    kw = _with_defaults(_sampling_kwargs(body), get_int(body, "max_tokens"), prompts, facts, 16)
    _constrain(body, kw, constraint)
    echo = get_bool(body, "echo")
    logprobs = get_int(body, "logprobs")
    if logprobs is not None:
        kw["logprobs"] = logprobs
        if echo:
            kw["prompt_logprobs"] = logprobs
    prompt_logprobs = get_int(body, "prompt_logprobs")
    if prompt_logprobs is not None:
        if get_bool(body, "stream"):
            raise bad_request(
                "`prompt_logprobs` with `stream` is not supported by pagectl", "prompt_logprobs"
            )
        if "prompt_logprobs" in kw and kw["prompt_logprobs"] != prompt_logprobs:
            raise bad_request("with echo, prompt_logprobs must equal logprobs", "prompt_logprobs")
        kw["prompt_logprobs"] = prompt_logprobs
    params = _build_params(kw, facts.vocab_size)
    spec = GenerationSpec(
        prompts,
        params,
        echo=echo,
        logprobs=logprobs,
        constraint=constraint,
        prompt_logprobs=prompt_logprobs,
    )
    _common(body, spec)
    _beam_search(body, spec)
    _check_context(prompts, params.max_tokens, facts, "prompt")
    return spec


def parse_messages(value: Any) -> list[dict[str, Any]]:
    return chat.parse_messages(value)


def render_chat(
    messages: list[dict],
    facts: ModelFacts,
    body: dict,
    tools: list[dict] | None = None,
    *,
    context: bool = True,
) -> Prompt:
    """The chat prompt; ``context``: also refuse text too long for the context (not for
    /tokenize, which counts tokens of any text up to --max-prompt-bytes)."""
    size = sum(text_bytes(m["content"]) for m in messages if isinstance(m.get("content"), str))
    check_prompt_size(size, facts, "messages", context=context)
    ids, _ = chat.render_messages(messages, facts.tokenizer, body, facts.chat, tools)
    return Prompt(ids)


def parse_chat(body: dict, facts: ModelFacts) -> GenerationSpec:
    """Validate a chat request and render its prompt (the template runs here: call it from
    a worker thread)."""
    check_model(body, facts)
    check_fields(body, CHAT_FIELDS, "chat.completions")
    _check_unsupported(body)
    if get_bool(body, "echo"):
        raise bad_request("`echo` is not supported by pagectl for chat", "echo")
    if body.get("prompt_logprobs") is not None:
        raise bad_request("`prompt_logprobs` is not supported by pagectl", "prompt_logprobs")
    tools = parse_tools(body, facts.chat.enable_auto_tool_choice)
    constraint = parse_structured(body)
    tool_constraint = tools.constraint()
    if tool_constraint is not None:
        if constraint is not None:
            raise bad_request(
                f"tool_choice {tools.mode} constrains the output already; drop {constraint.param}",
                constraint.param,
            )
        constraint = Constraint(tool_constraint, "tools")
    messages = parse_messages(body.get("messages"))
    prompt = render_chat(messages, facts, body, tools.tools if tools.tools else None)
    max_tokens = get_int(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens")
    # Chat defaults to the whole remaining context unless the model sets a max_tokens.
    kw = _with_defaults(_sampling_kwargs(body), max_tokens, [prompt], facts, None)
    _constrain(body, kw, constraint)
    want_logprobs = get_bool(body, "logprobs")
    top = get_int(body, "top_logprobs")
    if top is not None and not want_logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    if logprobs is not None:
        kw["logprobs"] = logprobs
    params = _build_params(kw, facts.vocab_size)
    spec = GenerationSpec([prompt], params, logprobs=logprobs, constraint=constraint, tools=tools)
    _common(body, spec)
    _beam_search(body, spec)
    _check_context([prompt], params.max_tokens, facts, "messages")
    return spec
