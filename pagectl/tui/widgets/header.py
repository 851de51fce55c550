"""The header: what is served, the pool's shape, engine state, and the link to the daemon."""

from __future__ import annotations

import os

from rich.text import Text
from textual.widgets import Static

from pagectl.engine.telemetry import TelemetrySnapshot
from pagectl.tui import fmt
from pagectl.tui.connection import CONNECTING, LIVE, REPLAY, REPLAY_ENDED, STALE, Connection

ENGINE_STATE_STYLES = {
    "running": "bold #0d1117 on #3fb950",
    "paused": "bold #0d1117 on #d8a32b",
    "draining": "bold #0d1117 on #4c8fd6",
    "dead": "bold #ffffff on #da3633",
}
LINK_STYLES = {
    LIVE: "bold #3fb950",
    STALE: "bold #ffffff on #da3633",
    CONNECTING: "bold #d8a32b",
    REPLAY: "bold #4c8fd6",
}


class ConsoleHeader(Static):
    """Two lines: the model and pool, then the link and the live configuration."""

    def show(self, snap: TelemetrySnapshot | None, link: Connection) -> None:
        self.update(render_header(snap, link, self.size.width or None))


def render_header(
    snap: TelemetrySnapshot | None, link: Connection, width: int | None = None
) -> Text:
    """Two lines, each cut to ``width`` (the most important facts come first)."""
    t = _render_header(snap, link)
    if width is None:
        return t
    lines = t.split("\n")
    for line in lines:
        line.truncate(width, overflow="ellipsis")
    return Text("\n").join(lines)


def _render_header(snap: TelemetrySnapshot | None, link: Connection) -> Text:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append(" pagectl top ", style="bold #0d1117 on #c9d1d9")
    if snap is None:
        t.append("  no telemetry yet", style="italic")
    else:
        m = snap.model
        b = snap.blocks
        state = snap.engine_state
        t.append(" ")
        if link.state == STALE:
            # The engine's state is unknown while the link is down: the last one seen, dimmed.
            t.append(f" last seen {state} ", style="#8b949e on #30363d")
        else:
            t.append(f" {state.upper()} ", style=ENGINE_STATE_STYLES.get(state, "reverse"))
        t.append(f"  {model_name(m.model)}", style="bold")
        t.append(f" · {m.dtype or '?'} · {m.device or '?'} · TP {m.tp_size}", style="#8b949e")
        if m.attention_backend:
            graphs = " + graphs" if m.cuda_graph_max_batch else ""
            t.append(f" · attn {m.attention_backend}{graphs}", style="#8b949e")
        t.append("   KV ", style="#8b949e")
        t.append(f"{fmt.count(b.num_blocks)} blocks × {b.block_size} tok", style="bold")
        if m.kv_bytes_per_rank:
            total = m.kv_bytes_per_rank * max(1, m.tp_size)
            t.append(f" = {fmt.size(total)}", style="bold")
            if m.tp_size > 1:
                t.append(f" ({fmt.size(m.kv_bytes_per_rank)}/rank)", style="#8b949e")
        mp = m.memory_profile
        if mp:
            t.append(
                f" (GPU {mp.get('gpu_memory_utilization', 0):.0%} of "
                f"{fmt.size(int(mp.get('total_bytes', 0)))}, peak act "
                f"{fmt.size(int(mp.get('peak_activation_bytes', 0)))})",
                style="#8b949e",
            )
        t.append("   up ", style="#8b949e")
        t.append(fmt.duration(snap.time - snap.start_time))
    t.append("\n")
    t.append(" ")
    t.append_text(render_link(link))
    if snap is not None:
        cfg = snap.config
        t.append("   budget ", style="#8b949e")
        t.append(f"{fmt.count(int(cfg.get('max_num_batched_tokens', 0)))} tok/step", style="bold")
        t.append(" · max seqs ", style="#8b949e")
        t.append(f"{cfg.get('max_num_seqs', '?')}", style="bold")
        drain = draining(snap)
        if drain:
            t.append(f" {drain}", style="bold #d8a32b")
        t.append(" · prefix cache ", style="#8b949e")
        on = bool(cfg.get("enable_prefix_caching"))
        t.append("ON" if on else "OFF", style="bold #3fb950" if on else "bold #da3633")
        threshold = cfg.get("long_prefill_token_threshold")
        if threshold:
            t.append(" · long prefill ", style="#8b949e")
            t.append(f"{threshold}", style="bold")
        t.append(f" · {cfg.get('policy', 'fcfs')}", style="#8b949e")
    if link.read_only_reason:
        t.append("   ")
        t.append(" READ-ONLY ", style="bold #0d1117 on #8b949e")
        t.append(f" {link.read_only_reason}", style="#8b949e")
    return t


def draining(snap: TelemetrySnapshot) -> str:
    """ "draining to N (now M)" while more sequences run than the running cap allows (a
    lowered cap never preempts: running sequences finish, admission waits); else ""."""
    cap = snap.config.get("max_num_seqs")
    if isinstance(cap, int) and not isinstance(cap, bool) and snap.num_running > cap:
        return f"(draining to {cap}, now {snap.num_running})"
    return ""


def model_name(model: str) -> str:
    """A local checkpoint directory by its last part; hub ids (org/name) as they are."""
    if model.startswith(("/", "./", "../", "~")):
        return os.path.basename(model.rstrip("/")) or model
    return model or "?"


def render_link(link: Connection) -> Text:
    t = Text()
    age = "" if link.age is None else f" · age {fmt.duration(link.age)}"
    if link.state == LIVE:
        t.append("● live", style=LINK_STYLES[LIVE])
        t.append(f" {link.label}{age}", style="#8b949e")
        if link.busy_s >= 1.0:
            t.append(f" · busy in a step for {fmt.duration(link.busy_s)}", style="bold #d8a32b")
    elif link.state == STALE:
        t.append(" ● DISCONNECTED ", style=LINK_STYLES[STALE])
        t.append(f" no telemetry for {fmt.duration(link.age or 0)}", style="bold #ff7b72")
        t.append(" — last picture kept, reconnecting", style="#ff7b72")
        if link.detail:
            t.append(f" ({link.detail})", style="#8b949e")
    elif link.state == CONNECTING:
        t.append("◌ connecting", style=LINK_STYLES[CONNECTING])
        t.append(f" {link.label}", style="#8b949e")
        if link.detail:
            t.append(f" ({link.detail})", style="#8b949e")
    else:
        icon = "⏸" if link.state != REPLAY else "▶"
        if link.state == REPLAY_ENDED:
            icon = "■"
        t.append(f"{icon} {link.state}", style=LINK_STYLES[REPLAY])
        t.append(f" {link.label} · {link.speed:g}x", style="#8b949e")
        if link.position:
            n, total, played, length = link.position
            t.append(
                f" · {fmt.duration(played)}/{fmt.duration(length)} · frame {n}/{total}",
                style="#8b949e",
            )
        t.append(age, style="#8b949e")
    return t
