"""Beam search inside the engine: the W beams of a prompt are sequences of one group.

Every beam is a ``Request`` decoding greedily with ``logprobs = 2W``, so each step the runner
returns, per beam, the 2W most likely next tokens with their log-probabilities (log-softmax of
the raw logits). Once every live beam of a group has its row (``BeamGroup.ready``), the group
takes one step, as transformers' beam search does (``generate(num_beams=W)``):

- the candidates are the W x 2W (beam, token) pairs scored by cumulative logprob; the 2W best
  are kept, in order;
- a candidate that ends its beam (EOS unless ``ignore_eos``, or the length limit) becomes a
  finished hypothesis when it ranks among the first W, scored ``cum_logprob / len **
  length_penalty`` (len counts generated tokens, EOS included); the W best hypotheses are
  kept aside;
- the first W candidates that do not end are the next beams. A beam chosen k > 1 times is
  forked k - 1 times (``KVCacheManager.fork``: every block shared by refcount; the partial
  last block is copied on write when a beam writes into it); a beam chosen by no candidate
  is freed at once;
- the search ends at the length limit, when no running beam can beat the worst of W
  finished hypotheses (transformers' heuristic for ``early_stopping`` False / "never"), or,
  with ``early_stopping=True``, as soon as W hypotheses are finished.

The result is the finished hypotheses, best first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagectl.engine.outputs import TokenLogprobs
from pagectl.engine.sampling_params import MAX_LOGPROBS

if TYPE_CHECKING:
    from pagectl.engine.request import Request

_NEG = -1.0e9


# 2 x beam_width candidates per beam are read from the top logprobs, which are capped.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
# |length_penalty| at most this: (2**31 tokens) ** 10 is still far inside float range.
MAX_LENGTH_PENALTY = 10.0


@dataclass(frozen=True)
class BeamSearchParams:
    """Parameters of one beam search (vLLM's names)."""

    # W: beams kept per step, and sequences returned.
    beam_width: int
    # Most tokens generated per sequence.
    max_tokens: int
    # Keep searching past EOS (no beam ever finishes early).
    ignore_eos: bool = False
    # Only 0 is supported: beam search ranks by the model's own log-probabilities.
    temperature: float = 0.0
    # Final ranking: cum_logprob / len ** length_penalty.
    length_penalty: float = 1.0
    # False / "never": transformers' heuristics for when to stop; True: stop once W
    # hypotheses are finished.
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        w = self.beam_width
        # Each beam's row carries its 2W most likely next tokens, as top logprobs.
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {w!r}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {m!r}")
        if self.temperature != 0.0:
            raise ValueError("beam search supports temperature 0 only")
        lp = self.length_penalty
        # Bounded so that len ** length_penalty stays a finite float for any length.
        if (
            isinstance(lp, bool)
            or not isinstance(lp, (int, float))
            or not -MAX_LENGTH_PENALTY <= lp <= MAX_LENGTH_PENALTY
        ):
            raise ValueError(
                f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, "
                f"{MAX_LENGTH_PENALTY}], got {lp!r}"
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}"
            )


@dataclass
class BeamSequence:
    """One finished hypothesis."""

    # Generated tokens (EOS included when the beam ended on it).
    token_ids: list[int]
    cum_logprob: float
    # cum_logprob / len(token_ids) ** length_penalty: the ranking key.
    score: float
    # "stop" (EOS) or "length".
    finish_reason: str


@dataclass
class BeamGroup:
    """The live beams of one prompt and its finished hypotheses."""

    request_id: str
    params: BeamSearchParams
    num_prompt_tokens: int
    # Length limit in generated tokens (max_tokens, capped by the context).
    max_new_tokens: int
    # Live beams, best first, and each one's cumulative logprob (by seq_id).
    beams: list[Request]
    cum: dict[str, float] = field(default_factory=dict)
    # seq_id -> the 2W most likely next tokens of that beam, once computed this step.
    pending: dict[str, TokenLogprobs] = field(default_factory=dict)
    finished: list[BeamSequence] = field(default_factory=list)
    # False once no running beam can beat the worst finished hypothesis.
    open: bool = True
    done: bool = False
    # Next child number (seq ids "<request_id>#b<k>").
    next_child: int = 1
    # Most blocks the group's beams held at once (the block saving of sharing).
    peak_blocks: int = 0

    @property
    def width(self) -> int:
        return self.params.beam_width

    def ready(self) -> bool:
        return len(self.pending) == len(self.beams)

    def step(self) -> list[tuple[Request, list[tuple[int, float]]]]:
        """One beam step over the pending rows. Returns, per live beam in order, the
        (token, cumulative logprob) of each beam that continues it, best first: the first
        extends the beam itself, each other one a fork of it; none frees the beam. Sets
        ``done`` (and returns no continuations) when the search ends."""
        w = self.width
        lp = self.params.length_penalty
        cands: list[tuple[float, int, int]] = []
        for b, beam in enumerate(self.beams):
            base = self.cum[beam.seq_id]
            for tok, logprob in self.pending[beam.seq_id].top[: 2 * w]:
                cands.append((base + logprob, b, tok))
        self.pending.clear()
        cands.sort(key=lambda c: -c[0])
        cands = cands[: 2 * w]
        gen_len = self.beams[0].num_output_tokens + 1
        last = gen_len >= self.max_new_tokens
        eos = () if self.params.ignore_eos else self.beams[0].stop_ids
        kept: list[tuple[float, int, int]] = []
        for rank, (score, b, tok) in enumerate(cands):
            if last or tok in eos:
                if rank < w and self.open:
                    self._add_finished(
                        self.beams[b].output_token_ids + [tok],
                        score,
                        "length" if last and tok not in eos else "stop",
                    )
                continue
            if len(kept) < w:
                kept.append((score, b, tok))
        if last or not kept:
            self.done = True
            return [(beam, []) for beam in self.beams]
        # transformers' stopping heuristic, on the best running beam.
        if self.params.early_stopping == "never" and lp > 0.0:
            best_len = self.max_new_tokens
        else:
            best_len = gen_len
        best_running = kept[0][0] / (best_len**lp)
        worst_finished = min(f.score for f in self.finished) if len(self.finished) >= w else _NEG
        self.open = self.open and best_running > worst_finished
        if not self.open or (self.params.early_stopping is True and len(self.finished) >= w):
            self.done = True
            return [(beam, []) for beam in self.beams]
        conts: list[list[tuple[int, float]]] = [[] for _ in self.beams]
        for score, b, tok in kept:
            conts[b].append((tok, score))
        return list(zip(self.beams, conts, strict=True))

    def _add_finished(self, tokens: list[int], cum: float, reason: str) -> None:
        score = cum / (len(tokens) ** self.params.length_penalty)
        self.finished.append(BeamSequence(tokens, cum, score, reason))
        self.finished.sort(key=lambda f: -f.score)
        del self.finished[self.width :]

    def results(self) -> list[BeamSequence]:
        return sorted(self.finished, key=lambda f: -f.score)[: self.width]
