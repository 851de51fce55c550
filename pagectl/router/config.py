"""``pagectl route`` settings: built-in defaults, then a TOML file (``--config``), then flags.

Every flag of ``pagectl route`` has a key in the file, named as the flag without its dashes
(``max_skew`` or ``max-skew``). A flag given on the command line overrides the file's key;
``--backend`` given at all replaces the file's whole backend list. A file with an unknown
key, a value of the wrong type or out of range is refused with a message naming the key.

    # router.toml
    routing = "prefix"
    max_skew = 4
    health_interval = 1.0
    backends = [
        "http://127.0.0.1:8000,kv_events=tcp://127.0.0.1:5557",
        { url = "http://127.0.0.1:8001", kv_events = "tcp://127.0.0.1:5567" },
    ]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

from pagectl.router.backends import BackendSpec, parse_backend
from pagectl.routing.policy import POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, before it joined the standard library
    import tomli as tomllib

LOG_LEVELS = ("debug", "info", "warning")
BACKEND_KEYS = ("url", "kv_events", "replay", "topic")


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the key (or flag) and the file."""


@dataclass
class RouteSettings:
    """What ``pagectl route`` runs with (the flags' meanings: ``pagectl route --help``)."""

    # The daemons to route to.
    backends: list[BackendSpec] = field(default_factory=list)
    # Where the proxy listens.
    host: str = "127.0.0.1"
    port: int = 8080
    # "prefix", "load" or "round_robin" (``routing.policy``).
    routing: str = "prefix"
    # Prefix routing's bound: requests above the least loaded backend.
    max_skew: int = 4
    # Seconds between health checks, and each check's limit (None: max(interval, 1)).
    health_interval: float = 1.0
    health_timeout: float | None = None
    # Seconds to connect to a backend; a whole proxied request's limit (None: none).
    connect_timeout: float = 5.0
    request_timeout: float | None = None
    log_level: str = "info"


# key -> (type, lowest value allowed, whether 0 means "none" (for optional timeouts)).
_NUMBERS: dict[str, tuple[type, float, bool]] = {
    "port": (int, 1, False),
    "max_skew": (int, 0, False),
    "health_interval": (float, 0, False),
    "health_timeout": (float, 0, True),
    "connect_timeout": (float, 0, False),
    "request_timeout": (float, 0, True),
}
_CHOICES: dict[str, tuple[str, ...]] = {"routing": POLICIES, "log_level": LOG_LEVELS}
KEYS = ("backends", "host", *_NUMBERS, *_CHOICES)


def _number(key: str, value: Any, where: str) -> int | float | None:
    kind, low, zero_is_none = _NUMBERS[key]
    if isinstance(value, bool) or not isinstance(value, int if kind is int else (int, float)):
        raise ConfigError(f"{where}: {key} must be {'an integer' if kind is int else 'a number'}")
    if zero_is_none and value == 0:
        return None
    if key == "port":
        ok, bound = 1 <= value <= 65535, "between 1 and 65535"
    elif kind is int or zero_is_none:
        ok, bound = value >= low, f">= {low:g}" + (" (0: none)" if zero_is_none else "")
    else:
        ok, bound = value > low, f"> {low:g}"
    if not ok:
        raise ConfigError(f"{where}: {key} must be {bound}, not {value!r}")
    return kind(value)


def _backend(item: Any, i: int, where: str) -> BackendSpec:
    name = f"backends[{i}]"
    if isinstance(item, str):
        try:
            return parse_backend(item)
        except ValueError as e:
            raise ConfigError(f"{where}: {name}: {e}") from None
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: {name} must be a URL string or a table with url = ...")
    unknown = sorted(set(item) - set(BACKEND_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: {name}: unknown key {unknown[0]!r} (known: {', '.join(BACKEND_KEYS)})"
        )
    for k, v in item.items():
        if not isinstance(v, str):
            raise ConfigError(f"{where}: {name}.{k} must be a string")
    if "url" not in item:
        raise ConfigError(f"{where}: {name} has no url")
    try:
        spec = parse_backend(item["url"])
    except ValueError as e:
        raise ConfigError(f"{where}: {name}.url: {e}") from None
    if "," in item["url"]:
        raise ConfigError(f"{where}: {name}.url: options go in their own keys in a table")
    for k in BACKEND_KEYS[1:]:
        if k in item:
            setattr(spec, k, item[k])
    return spec


def read_config(path: str) -> dict[str, Any]:
    """The settings a TOML file sets (only the keys it has), validated.

    Raises:
        ConfigError: unreadable file, bad TOML, an unknown key, a bad value.
    """
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None
    out: dict[str, Any] = {}
    for written, value in raw.items():
        key = written.replace("-", "_")
        if key not in KEYS:
            raise ConfigError(f"{path}: unknown key {written!r} (known: {', '.join(KEYS)})")
        if key in out:
            raise ConfigError(f"{path}: {key} is set twice ({written!r})")
        if key == "backends":
            if not isinstance(value, list) or not value:
                raise ConfigError(f"{path}: backends must be a non-empty list")
            out[key] = [_backend(item, i, path) for i, item in enumerate(value)]
        elif key == "host":
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{path}: host must be a non-empty string")
            out[key] = value
        elif key in _CHOICES:
            if value not in _CHOICES[key]:
                raise ConfigError(
                    f"{path}: {key} must be one of {', '.join(_CHOICES[key])}, not {value!r}"
                )
            out[key] = value
        else:
            out[key] = _number(key, value, path)
    return out


def settings_from(args: argparse.Namespace) -> RouteSettings:
    """Defaults, then ``args.config``'s keys, then every flag given (flags default to None
    so that an absent one leaves the file's value).

    Raises:
        ConfigError: a bad file or flag value, or no backend at all.
    """
    s = RouteSettings()
    if getattr(args, "config", None):
        for k, v in read_config(args.config).items():
            setattr(s, k, v)
    if args.backend:
        try:
            s.backends = [parse_backend(b) for b in args.backend]
        except ValueError as e:
            raise ConfigError(str(e)) from None
    for key in ("host", "routing", "log_level"):
        if getattr(args, key) is not None:
            setattr(s, key, getattr(args, key))
    for key in _NUMBERS:
        value = getattr(args, key)
        if value is not None:
            setattr(s, key, _number(key, value, "--" + key.replace("_", "-")))
    if not s.backends:
        raise ConfigError("no backend: give --backend URL (repeatable) or backends in --config")
    return s
