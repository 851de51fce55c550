"""Sampling parameters: what a caller may ask of one generation, validated up front.

Validation runs before a request enters the engine: a bad value raises ``ValueError`` with a
message naming the field, so a single bad request can never fail inside the step loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from pagectl.engine.structured_outputs.params import StructuredOutputsParams

# Caps that keep one request from monopolising the engine or the wire.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 1024
# Temperatures below this sample greedily (the argmax).
GREEDY_TEMPERATURE = 1e-5


class SamplingParamsError(ValueError):
    """An invalid sampling value; ``param`` is the ``SamplingParams`` field at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _finite(param: str, value: float, what: str | None = None) -> float:
    name = what or param
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(param, f"{name} must be a number, got {type(value).__name__}")
    try:
        f = float(value)  # an int beyond float range raises OverflowError
    except OverflowError:
        raise SamplingParamsError(param, f"{name} is out of range") from None
    if not math.isfinite(f):
        raise SamplingParamsError(param, f"{name} must be finite, got {value}")
    return f


def _int(
    param: str, value: int, low: int | None = None, high: int | None = None, what: str | None = None
) -> int:
    name = what or param
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(param, f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise SamplingParamsError(param, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise SamplingParamsError(param, f"{name} must be <= {high}, got {value}")
    return value


@dataclass
class SamplingParams:
    """How to sample one request's continuation(s).

    Defaults follow the OpenAI / vLLM meaning of each field. ``temperature == 0`` is greedy.
    """

    n: int = 1  # number of parallel samples; n > 1 forks and shares the prompt's KV blocks
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0  # EOS and stop token ids are ignored (and masked) until this many
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> bias added to the logit
    seed: int | None = None  # per-request seed: same output whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the text
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled one always)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token
    skip_special_tokens: bool = True
    # False: no text is made (outputs carry token ids only, text ""), as vLLM's
    # ``detokenize=False``; stop strings need the text, so they are refused with it.
    detokenize: bool = True
    # A constraint on the output (JSON schema, regex, choice, grammar); None: unconstrained.
    # A plain dict (as it crosses the process boundary) is turned back into the dataclass.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``SamplingParamsError`` (a ``ValueError``) naming the first invalid field."""
        _int("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1)
        _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            )
        t = _finite("temperature", self.temperature)
        if t < 0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0, got {t}")
        p = _finite("top_p", self.top_p)
        if not 0 < p <= 1:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {p}")
        k = _int("top_k", self.top_k)
        if k < -1:
            raise SamplingParamsError(
                "top_k", f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {k}"
            )
        mp = _finite("min_p", self.min_p)
        if not 0 <= mp <= 1:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {mp}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = _finite(name, getattr(self, name))
            if not -2 <= v <= 2:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {v}")
        rp = _finite("repetition_penalty", self.repetition_penalty)
        if rp <= 0:
            raise SamplingParamsError(
                "repetition_penalty", f"repetition_penalty must be > 0, got {rp}"
            )
        if self.seed is not None:
            _int("seed", self.seed, -(2**63), 2**63 - 1)
        if not isinstance(self.detokenize, bool):
            raise SamplingParamsError("detokenize", "detokenize must be a boolean")
        if self.stop and not self.detokenize:
            raise SamplingParamsError(
                "stop",
                "stop strings need the output text: they cannot be used with detokenize=False",
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamsError("stop", f"stop may hold at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", "stop strings must be non-empty strings")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                "stop_token_ids", f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids"
            )
        for tid in self.stop_token_ids:
            _int(
                "stop_token_ids",
                tid,
                0,
                None if vocab_size is None else vocab_size - 1,
                what="stop_token_ids[]",
            )
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise SamplingParamsError(
                    "logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries"
                )
            clean: dict[int, float] = {}
            for tok, bias in self.logit_bias.items():
                try:
                    tid = int(tok)
                except (TypeError, ValueError):
                    raise SamplingParamsError(
                        "logit_bias", f"logit_bias key {tok!r} is not a token id"
                    ) from None
                high = None if vocab_size is None else vocab_size - 1
                _int("logit_bias", tid, 0, high, what="logit_bias key")
                b = _finite("logit_bias", bias, what="logit_bias value")
                if not -100 <= b <= 100:
                    raise SamplingParamsError(
                        "logit_bias", f"logit_bias values must be in [-100, 100], got {b}"
                    )
                clean[tid] = b
            self.logit_bias = clean
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                _int(name, v, 0, MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def clone(self, **changes: object) -> SamplingParams:
        """A copy with some fields changed (validated again)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["stop"] = list(self.stop)
        values["stop_token_ids"] = list(self.stop_token_ids)
        values["logit_bias"] = dict(self.logit_bias) if self.logit_bias else None
        values.update(changes)
        return SamplingParams(**values)  # type: ignore[arg-type]
