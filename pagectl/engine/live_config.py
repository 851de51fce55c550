"""Operator controls applied between steps: live settings, prefix cache on/off and reset,
pause/resume of admission. Each accepted change is recorded as an event (old -> new, client).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagectl.engine.config import SchedulerConfig
    from pagectl.engine.kv.manager import KVCacheManager
    from pagectl.engine.request import Request
    from pagectl.engine.spec_decode.config import SpeculativeConfig
    from pagectl.engine.telemetry import Event

# Live settings: name -> (type, description).
LIVE_SETTINGS = {
    "max_num_batched_tokens": (int, "token budget of one step"),
    "max_num_seqs": (int, "most sequences running at once"),
    "long_prefill_token_threshold": (int, "most prompt tokens one request prefills per step"),
    "enable_prefix_caching": (bool, "prefix caching on or off"),
    "num_speculative_tokens": (int, "most tokens proposed per sequence per step (0: off)"),
}


class LiveConfigMixin:
    """Live configuration of a ``Scheduler`` (which provides the attributes below)."""

    config: SchedulerConfig
    kv: KVCacheManager
    running: list[Request]
    paused: bool
    max_num_seqs_limit: int
    block_size: int
    num_spec_tokens: int
    spec_config: SpeculativeConfig | None

    if TYPE_CHECKING:

        def add_event(self, kind: str, message: str, **data) -> Event: ...

    def set(self, name: str, value: object, client: str = "") -> tuple[object, object]:
        """Change one live setting; applied from the next step. Returns (old, new).

        Raises ``KeyError`` for an unknown name and ``ValueError`` for a bad value.
        """
        if name not in LIVE_SETTINGS:
            raise KeyError(f"unknown setting {name!r}; live settings: {', '.join(LIVE_SETTINGS)}")
        typ = LIVE_SETTINGS[name][0]
        if typ is bool:
            value = _parse_bool(name, value)
        else:
            value = _parse_int(name, value)
        cfg = self.config
        if name == "max_num_batched_tokens":
            if not 1 <= value <= cfg.max_num_batched_tokens_limit:
                raise ValueError(
                    f"max_num_batched_tokens must be in [1, {cfg.max_num_batched_tokens_limit}], "
                    f"got {value}"
                )
        elif name == "max_num_seqs":
            if not 1 <= value <= self.max_num_seqs_limit:
                raise ValueError(
                    f"max_num_seqs must be in [1, {self.max_num_seqs_limit}] (the start-up "
                    f"value is the limit), got {value}"
                )
        elif name == "long_prefill_token_threshold" and value < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {value}")
        elif name == "num_speculative_tokens":
            if self.spec_config is None:
                raise ValueError(
                    "num_speculative_tokens: speculative decoding is not configured (start "
                    "the engine with --speculative-config)"
                )
            limit = self.spec_config.num_speculative_tokens
            if not 0 <= value <= limit:
                raise ValueError(
                    f"num_speculative_tokens must be in [0, {limit}] (the start-up value is "
                    f"the limit), got {value}"
                )
        old: object
        if name == "enable_prefix_caching":
            old = self.kv.enable_prefix_caching
            self._set_prefix_caching(bool(value))
        elif name == "num_speculative_tokens":
            old = self.num_spec_tokens
            self.num_spec_tokens = int(value)
        else:
            old = getattr(cfg, name)
            setattr(cfg, name, value)
        if old != value:
            who = f" by {client}" if client else ""
            self.add_event(
                "config",
                f"{name}: {old} -> {value}{who}",
                name=name,
                old=old,
                new=value,
                client=client,
            )
        return old, value

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
        cfg = self.config
        return {
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_num_seqs": cfg.max_num_seqs,
            "long_prefill_token_threshold": cfg.long_prefill_token_threshold,
            "enable_prefix_caching": self.kv.enable_prefix_caching,
            "paused": self.paused,
            "policy": cfg.policy,
            "block_size": self.block_size,
            "num_kv_blocks": self.kv.num_blocks,
            "max_model_len": cfg.max_model_len,
            "max_num_seqs_limit": self.max_num_seqs_limit,
            "max_num_batched_tokens_limit": cfg.max_num_batched_tokens_limit,
            "num_speculative_tokens": self.num_spec_tokens,
            "speculative_method": self.spec_config.method if self.spec_config else "none",
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
