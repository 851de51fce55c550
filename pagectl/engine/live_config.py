"""Operator controls applied between steps: live settings, prefix cache on/off and reset,
pause/resume of admission. Each accepted change is recorded as an event (old -> new, client).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagectl.engine.config import SchedulerConfig
    from pagectl.engine.kv.manager import KVCacheManager
    from pagectl.engine.request import Request
    from pagectl.engine.spec_decode.config import SpeculativeConfig
    from pagectl.engine.telemetry import Event


@dataclass(frozen=True)
class LiveSetting:
    """One setting an operator may change while the engine runs (``SetConfig``)."""

    # snake_case name, as in EngineArgs, SetConfig and the snapshot's config.
    name: str
    # int or bool.
    type: type
    # One line for ``ctl``'s help, the console and the docs' table.
    description: str
    # Lowest value (int settings).
    low: int = 0
    # Highest value as a multiple of the start-up value (1: up to it); None: no upper bound.
    # A bounded setting's limit is in the snapshot's config as "<name>_limit".
    startup_factor: int | None = None
    # The console: a short label, and the multiple its ] / [ steps round to.
    label: str = ""
    granularity: int = 1
    # The one method that applies a checked value (a LiveConfigMixin method), and the one
    # that reads the value in force.
    apply: Callable[[Any, Any], None] = lambda sched, value: None
    read: Callable[[Any], Any] = lambda sched: None
    # The start-up value the upper bound multiplies; None: the start-up SchedulerConfig's
    # field of the same name. A function returning None means the setting is unavailable
    # in this engine, for the reason in ``unavailable``.
    startup: Callable[[Any], int | None] | None = None
    unavailable: str = ""

    @property
    def flag(self) -> str:
        """The kebab-case spelling (``ctl set`` and the CLI flag)."""
        return self.name.replace("_", "-")

    @property
    def limit_key(self) -> str | None:
        return f"{self.name}_limit" if self.startup_factor is not None else None

    def limit(self, startup_value: int) -> int | None:
        return None if self.startup_factor is None else self.startup_factor * startup_value


def normalize_name(name: str) -> str:
    """The snake_case name of a setting spelled either way (max-num-seqs, max_num_seqs)."""
    return name.strip().lower().replace("-", "_")


class LiveConfigMixin:
    """Live configuration of a ``Scheduler`` (which provides the attributes below)."""

    config: SchedulerConfig
    # The configuration the engine started with (bounds "up to the start-up value").
    startup_config: SchedulerConfig
    kv: KVCacheManager
    running: list[Request]
    paused: bool
    block_size: int
    num_spec_tokens: int
    spec_config: SpeculativeConfig | None

    if TYPE_CHECKING:

        def add_event(self, kind: str, message: str, **data) -> Event: ...

    def set(self, name: str, value: object, client: str = "") -> tuple[object, object]:
        """Change one live setting; applied from the next step. Returns (old, new).

        ``name`` is snake_case or kebab-case. Raises ``KeyError`` for an unknown name and
        ``ValueError`` for a bad value.
        """
        name = normalize_name(name)
        setting = LIVE_SETTINGS.get(name)
        if setting is None:
            raise KeyError(f"unknown setting {name!r}; live settings: {', '.join(LIVE_SETTINGS)}")
        value = self.check_value(setting, value)
        old = setting.read(self)
        setting.apply(self, value)
        if old != value:
            who = f" by {client}" if client else ""
            # A lowered running cap never preempts: running sequences finish, admission
            # waits until fewer than ``value`` run.
            running = len(self.running)
            drain = (
                f" (draining: {running} running)"
                if name == "max_num_seqs" and running > value
                else ""
            )
            self.add_event(
                "config",
                f"{name}: {old} -> {value}{who}{drain}",
                name=name,
                old=old,
                new=value,
                client=client,
            )
        return old, value

    def check_value(self, setting: LiveSetting, value: object) -> int | bool:
        """``value`` parsed and within the setting's bounds (raises ``ValueError``)."""
        name = setting.name
        if setting.type is bool:
            return _parse_bool(name, value)
        v = _parse_int(name, value)
        start = self.startup_value(setting)
        if start is None:
            raise ValueError(f"{name}: {setting.unavailable}")
        high = setting.limit(start)
        if high is None:
            if v < setting.low:
                raise ValueError(f"{name} must be >= {setting.low}, got {v}")
        elif not setting.low <= v <= high:
            why = " (the start-up value is the limit)" if setting.startup_factor == 1 else ""
            raise ValueError(f"{name} must be in [{setting.low}, {high}]{why}, got {v}")
        return v

    def startup_value(self, setting: LiveSetting) -> int | None:
        """The start-up value ``setting``'s upper bound is a multiple of."""
        if setting.startup is not None:
            return setting.startup(self)
        return getattr(self.startup_config, setting.name, None)

    # The appliers: every live change of the scheduler's behaviour happens in one of these.

    def _set_max_num_batched_tokens(self, value: int) -> None:
        self.config.max_num_batched_tokens = value

    def _set_max_num_seqs(self, value: int) -> None:
        self.config.max_num_seqs = value

    def _set_long_prefill_token_threshold(self, value: int) -> None:
        self.config.long_prefill_token_threshold = value

    def _set_num_speculative_tokens(self, value: int) -> None:
        self.num_spec_tokens = value

    def _set_prefix_caching(self, enabled: bool) -> None:
        kv = self.kv
        if enabled == kv.enable_prefix_caching:
            return
        kv.enable_prefix_caching = enabled
        if not enabled:
            # Stop lookups and new entries; cached-but-unused blocks become plain free blocks.
            # Running sequences keep their blocks and re-register them if caching returns.
            kv.reset_prefix_cache()
            for req in self.running:
                req.num_registered_blocks = 0

    def reset_prefix_cache(self, client: str = "") -> int:
        released = self.kv.reset_prefix_cache()
        who = f" by {client}" if client else ""
        self.add_event(
            "prefix_cache_reset",
            f"prefix cache reset{who}: {released} cached blocks released",
            released_blocks=released,
            client=client,
        )
        return released

    def set_paused(self, paused: bool, client: str = "") -> bool:
        old = self.paused
        self.paused = paused
        if old != paused:
            who = f" by {client}" if client else ""
            self.add_event(
                "pause" if paused else "resume",
                f"admission {'paused' if paused else 'resumed'}{who}",
                client=client,
            )
        return old

    def live_config(self) -> dict[str, int | float | str | bool]:
        """The snapshot's config: every live setting, its limit, and the fixed sizes."""
        out: dict[str, int | float | str | bool] = {}
        for setting in LIVE_SETTINGS.values():
            out[setting.name] = setting.read(self)
        out.update(
            paused=self.paused,
            policy=self.config.policy,
            block_size=self.block_size,
            num_kv_blocks=self.kv.num_blocks,
            max_model_len=self.config.max_model_len,
            speculative_method=self.spec_config.method if self.spec_config else "none",
        )
        if self.spec_config is not None and self.spec_config.model:
            out["speculative_model"] = self.spec_config.model
        for setting in LIVE_SETTINGS.values():
            high = setting.limit(self.startup_value(setting) or 0)
            if setting.limit_key and high is not None:
                out[setting.limit_key] = high
        return out


# The live settings, in display order. Adding one: an entry here (and its applier above).
LIVE_SETTINGS: dict[str, LiveSetting] = {
    s.name: s
    for s in (
        LiveSetting(
            "max_num_batched_tokens",
            int,
            "tokens one engine step may schedule (prefill chunks and decodes together)",
            low=1,
            startup_factor=4,
            label="token budget",
            granularity=64,
            apply=LiveConfigMixin._set_max_num_batched_tokens,
            read=lambda sched: sched.config.max_num_batched_tokens,
        ),
        LiveSetting(
            "max_num_seqs",
            int,
            "most sequences running at once (up to the start-up value)",
            low=1,
            startup_factor=1,
            label="running cap",
            apply=LiveConfigMixin._set_max_num_seqs,
            read=lambda sched: sched.config.max_num_seqs,
        ),
        LiveSetting(
            "long_prefill_token_threshold",
            int,
            "most prompt tokens one request prefills per step (0: only the budget limits it)",
            low=0,
            label="long-prefill threshold",
            granularity=64,
            apply=LiveConfigMixin._set_long_prefill_token_threshold,
            read=lambda sched: sched.config.long_prefill_token_threshold,
        ),
        LiveSetting(
            "enable_prefix_caching",
            bool,
            "prefix caching on or off (off forgets every cached prefix)",
            label="prefix caching",
            apply=LiveConfigMixin._set_prefix_caching,
            read=lambda sched: sched.kv.enable_prefix_caching,
        ),
        LiveSetting(
            "num_speculative_tokens",
            int,
            "most tokens proposed per sequence per step (0: speculation off; up to the "
            "start-up value)",
            low=0,
            startup_factor=1,
            label="speculative tokens",
            apply=LiveConfigMixin._set_num_speculative_tokens,
            read=lambda sched: sched.num_spec_tokens,
            startup=lambda sched: (
                sched.spec_config.num_speculative_tokens if sched.spec_config else None
            ),
            unavailable="speculative decoding is not configured (start the engine with "
            "--speculative-config)",
        ),
    )
}


def _parse_bool(name: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "on", "yes"):
        return True
    if isinstance(value, str) and value.lower() in ("0", "false", "off", "no"):
        return False
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name} must be on/off (true/false), got {value!r}")


def _parse_int(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip().replace("_", ""))
        except ValueError:
            pass
    raise ValueError(f"{name} must be an integer, got {value!r}")


def settings_table() -> str:
    """The Markdown table of the live settings in docs/ADMIN_PROTOCOL.md (a test checks that
    the docs hold exactly this)."""
    rows = [("name", "type", "range", "meaning")]
    for s in LIVE_SETTINGS.values():
        if s.type is bool:
            span = '`true`/`false`, or `"on"`/`"off"`, `"1"`/`"0"`, ...'
        elif s.startup_factor is None:
            span = f">= {s.low}"
        else:
            whose = (
                "the start-up value"
                if s.startup_factor == 1
                else f"{s.startup_factor}x the start-up value"
            )
            span = f"{s.low} .. `{s.limit_key}` ({whose})"
        rows.append((f"`{s.name}`", s.type.__name__, span, s.description))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
