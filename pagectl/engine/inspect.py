"""The ``inspect_request`` command's answer: one live request's sequences and token ids.

Runs on the engine thread between two steps (``EngineCore.apply_command``), so it costs
O(ids returned) and gives ids only: text is the client's job (the console decodes in a
worker thread, with the model's tokenizer). Every id list is bounded by ``max_tokens`` (at
most ``MAX_INSPECT_TOKENS``); a longer one keeps its first and last halves and says how many
ids it left out, and where (``clip``). With several sequences (n > 1, beams) each output
gets an equal share of the bound, never under ``MIN_SEQ_TOKENS``, and at most
``MAX_INSPECT_SEQS`` sequences are listed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagectl.engine.commands import CommandError, InspectRequest
from pagectl.engine.request import RequestStatus

if TYPE_CHECKING:
    from pagectl.engine.scheduler import Scheduler

# Most ids in one list of a reply (the prompt, one sequence's output).
MAX_INSPECT_TOKENS = 4096
# Most sequences listed, and the fewest output ids each gets when they share the bound.
MAX_INSPECT_SEQS = 64
MIN_SEQ_TOKENS = 32

_STATES = {
    RequestStatus.WAITING: "waiting",
    RequestStatus.RUNNING: "running",
    RequestStatus.PREEMPTED: "preempted",
}


def clip(ids: list[int], limit: int, start: int = 0, end: int | None = None) -> dict:
    """``ids[start:end]`` as ``{"token_ids", "gap_at", "gap"}``: all of them, or the first
    ``limit // 2`` and the last ``limit - limit // 2`` with ``gap`` ids left out before index
    ``gap_at``. Only the ids returned are copied (a long prompt is not)."""
    stop = len(ids) if end is None else end
    n = stop - start
    if n <= limit:
        return {"token_ids": ids[start:stop], "gap_at": n, "gap": 0}
    head = limit // 2
    tail = limit - head
    return {
        "token_ids": ids[start : start + head] + (ids[stop - tail : stop] if tail else []),
        "gap_at": head,
        "gap": n - limit,
    }


def inspect_request(sched: Scheduler, cmd: InspectRequest) -> dict:
    """The reply map of ``inspect_request`` (docs/ADMIN_PROTOCOL.md); raises ``CommandError``."""
    limit = cmd.max_tokens
    if (
        isinstance(limit, bool)
        or not isinstance(limit, int)
        or not 1 <= limit <= MAX_INSPECT_TOKENS
    ):
        raise CommandError(
            "invalid_value", f"max_tokens must be an integer in [1, {MAX_INSPECT_TOKENS}]"
        )
    seqs = list(sched.groups.get(cmd.request_id, ()))
    if not seqs:
        raise CommandError("not_found", f"no live request with id {cmd.request_id!r}")
    total = len(seqs)
    if cmd.seq_id:
        seqs = [r for r in seqs if r.seq_id == cmd.seq_id]
        if not seqs:
            raise CommandError(
                "not_found", f"request {cmd.request_id!r} has no live sequence {cmd.seq_id!r}"
            )
    group = sched.beam_groups.get(cmd.request_id)
    shown = seqs[:MAX_INSPECT_SEQS]
    per_seq = limit if len(shown) == 1 else min(limit, max(MIN_SEQ_TOKENS, limit // len(shown)))
    first = shown[0]
    return {
        "request_id": cmd.request_id,
        # Live sequences of the request (all of them, whatever ``seq_id`` chose).
        "num_sequences": total,
        "beam_width": group.width if group is not None else 0,
        "num_prompt_tokens": first.num_prompt_tokens,
        "prompt": clip(first.all_token_ids, limit, 0, first.num_prompt_tokens),
        "sequences": [
            {
                "seq_id": r.seq_id,
                "index": r.index,
                "state": _STATES.get(r.status, "finished"),
                "num_output_tokens": r.num_output_tokens,
                "num_computed_tokens": r.num_computed_tokens,
                "num_cached_tokens": r.num_cached_tokens,
                "num_blocks": len(r.block_ids),
                "num_preemptions": r.num_preemptions,
                # A beam's cumulative logprob (None: not a beam).
                "cum_logprob": group.cum.get(r.seq_id) if group is not None else None,
                "output": clip(r.all_token_ids, per_seq, r.num_prompt_tokens),
            }
            for r in shown
        ],
    }
