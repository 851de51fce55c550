"""The request detail view's content: facts from the telemetry rows, tokens from the daemon.

Pure (no Textual), so the tests read it directly. The facts come from the snapshot's
``RequestRow``s (refreshed with every snapshot); the tokens from the ``inspect_request``
command (``engine/inspect.py``: bounded id lists, a long one as head and tail), turned into
text by ``fetch_tokens`` in a worker thread with the model's tokenizer: never on the
engine's thread, never on the console's event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.text import Text

from pagectl.engine.commands import InspectRequest
from pagectl.engine.telemetry import RequestRow
from pagectl.tui import fmt
from pagectl.tui.blockmodel import block_ids, seq_id
from pagectl.tui.request_groups import child_label, group_row
from pagectl.tui.widgets.requests_table import STATE_STYLES

# Block ids listed in the facts (the rest counted).
MAX_BLOCK_IDS = 12
# Ids listed per token list in the ids view.
MAX_IDS_SHOWN = 512
_DIM = "#8b949e"
_TEXT = "#e3b341"


@dataclass(frozen=True)
class Target:
    """What the view shows: a whole request (``seq`` ""), or one of its sequences."""

    request_id: str
    seq: str = ""

    def members(self, rows: Sequence[RequestRow]) -> list[RequestRow]:
        """The live rows of the target in ``rows`` (none once it finished)."""
        if self.seq:
            return [r for r in rows if r.request_id == self.request_id and seq_id(r) == self.seq]
        return [r for r in rows if r.request_id == self.request_id]

    @property
    def title(self) -> str:
        return f"Request {self.seq or self.request_id}"


async def fetch_tokens(source: Any, detokenizer: Any, target: Target, max_tokens: int) -> dict:
    """The daemon's ``inspect_request`` answer, each id list given ``text`` (its head and
    tail decoded apart, joined by the view) when a tokenizer is at hand, else ``text_error``
    on the result. Raises ``CommandError``."""
    result = await source.send(
        InspectRequest(target.request_id, seq_id=target.seq, max_tokens=max_tokens)
    )
    result["seq_filter"] = target.seq
    if detokenizer is None:
        return result
    parts = [result["prompt"], *(s["output"] for s in result.get("sequences", ()))]

    def decode_all() -> str:
        for part in parts:
            ids, at = part["token_ids"], part["gap_at"]
            head = detokenizer.decode(ids[:at])
            tail = detokenizer.decode(ids[at:]) if part["gap"] else ""
            if head is None or tail is None:
                return detokenizer.error or "no tokenizer"
            part["text"] = [head, tail]
        return ""

    error = await asyncio.to_thread(decode_all)
    if error:
        result["text_error"] = error
    return result


def render_facts(target: Target, members: Sequence[RequestRow], gone: bool) -> Text:
    """(Under the view's title, ``Target.title``.) State, priority, token counts, blocks (with sharing), preemptions and
    age; a group lists its members (samples, or beams with their cumulative logprobs)."""
    t = Text(no_wrap=True, overflow="ellipsis")
    if not members:
        t.append("not in the telemetry: finished, aborted or never seen", style="italic " + _DIM)
        return t
    group = not target.seq and (len(members) > 1 or members[0].beam_width > 0)
    row = group_row(members) if group else members[0]
    t.append(row.state, style="bold " + STATE_STYLES.get(row.state, ""))
    if gone:
        t.append(" (last seen; finished or aborted since)", style="italic " + _DIM)
    if row.beam_width and group:
        t.append(f" · beam search, width {row.beam_width}, {len(members)} live beams")
    elif group:
        t.append(f" · {len(members)} samples")
    t.append(f" · priority {row.priority}\n")
    _kv(t, "prompt", f"{fmt.count(row.num_prompt_tokens)} tokens")
    cached = fmt.count(row.num_cached_tokens) if row.admitted else "— (not admitted)"
    _kv(t, " · cached", cached)
    _kv(t, " · output", fmt.count(row.num_output_tokens))
    _kv(t, " · computed", fmt.count(row.num_computed_tokens))
    t.append("\n")
    _kv(t, "blocks", fmt.count(row.num_blocks))
    shared = fmt.count(row.num_shared_blocks)
    t.append(f" ({shared} shared among its sequences)" if group else f" ({shared} shared)")
    _kv(t, " · preemptions", str(row.num_preemptions))
    _kv(t, " · age", fmt.duration(row.age_s))
    if row.beam_width and target.seq:
        _kv(t, " · cum logprob", f"{row.cum_logprob:.3f}")
    ids = block_ids(row).tolist()
    if ids:
        t.append("\n")
        listed = " ".join(str(b) for b in ids[:MAX_BLOCK_IDS])
        more = f" … +{len(ids) - MAX_BLOCK_IDS}" if len(ids) > MAX_BLOCK_IDS else ""
        _kv(t, "block ids", listed + more)
    if group:
        ordered = sorted(members, key=lambda m: -m.cum_logprob) if row.beam_width else members
        for i, m in enumerate(ordered):
            t.append("\n  ")
            t.append(f"{child_label(m, i == len(ordered) - 1):<16}", style=_DIM)
            t.append(f"{m.state:<10}", style=STATE_STYLES.get(m.state, ""))
            t.append(
                f"out {fmt.count(m.num_output_tokens):>5}  blocks {m.num_blocks - m.num_shared_blocks}"
                f"/{m.num_shared_blocks} own/shr  preempt {m.num_preemptions}"
            )
    return t


def _kv(t: Text, key: str, value: str) -> None:
    t.append(f"{key} ", style=_DIM)
    t.append(value, style="bold")


def render_tokens(
    result: dict | None, status: str, show_ids: bool, can_fetch: bool, read_only_reason: str
) -> Text:
    """The request's tokens: the prompt, then each sequence's output, as text (or ids)."""
    t = Text()
    if result is None:
        if not can_fetch:
            why = f" ({read_only_reason})" if read_only_reason else ""
            t.append(f"Tokens need the control channel{why}.", style="italic " + _DIM)
        elif status == "pending":
            t.append("asking the daemon for the tokens…", style="italic " + _DIM)
        else:
            t.append(f"tokens: {status}", style="#ff7b72")
        return t
    use_text = not show_ids and "text_error" not in result
    if not show_ids and "text_error" in result:
        t.append(f"ids only: {result['text_error']}\n", style=_DIM)
    _section(
        t, f"prompt · {fmt.count(result['num_prompt_tokens'])} tokens", result["prompt"], use_text
    )
    seqs = result.get("sequences", [])
    for s in seqs:
        t.append("\n")
        name = s["seq_id"] if len(seqs) > 1 else "output"
        extra = f" · cum logprob {s['cum_logprob']:.3f}" if s.get("cum_logprob") is not None else ""
        _section(
            t, f"{name} · {fmt.count(s['num_output_tokens'])} tokens{extra}", s["output"], use_text
        )
    hidden = 0 if result.get("seq_filter") else result.get("num_sequences", 0) - len(seqs)
    if hidden > 0:
        t.append(f"\n… {hidden} more sequences not listed", style=_DIM)
    if status not in ("ok", "pending"):
        t.append(f"\nrefresh failed: {status}", style="#ff7b72")
    return t


def _section(t: Text, title: str, part: dict, use_text: bool) -> None:
    t.append(f"{title}\n", style="bold #58a6ff")
    ids, at, gap = part["token_ids"], part["gap_at"], part["gap"]
    if not ids:
        t.append("(none yet)\n", style="italic " + _DIM)
        return
    marker = f" … {fmt.count(gap)} tokens not shown … "
    if use_text and "text" in part:
        head, tail = part["text"]
        t.append(head, style=_TEXT)
        if gap:
            t.append(marker, style="reverse " + _DIM)
            t.append(tail, style=_TEXT)
        t.append("\n")
        return
    head_ids, tail_ids = ids[:at], ids[at:]
    t.append(_ids(head_ids))
    if gap:
        t.append(marker, style="reverse " + _DIM)
        t.append(_ids(tail_ids))
    t.append("\n")


def _ids(ids: list[int]) -> str:
    shown = " ".join(str(x) for x in ids[:MAX_IDS_SHOWN])
    return shown + (f" … (+{len(ids) - MAX_IDS_SHOWN} ids)" if len(ids) > MAX_IDS_SHOWN else "")
