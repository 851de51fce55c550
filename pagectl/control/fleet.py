"""Which admin channels make a fleet: several daemons (``pagectl top --url A --url B``), the
engines of a data-parallel daemon (``RuntimeInfo.engines``), or the backends of a
``pagectl route`` proxy (its ``GET /router/backends``).

A fleet is a list of ``MemberSpec``: a label and where its admin endpoints are read from (a
daemon's runtime file, found by HTTP URL, and an engine index). The same list serves every
case, so a data-parallel daemon and several daemons are one code path in the console.

The admin channel is local (ipc sockets or loopback TCP, and a 0600 token file), so a
backend on another host is listed as unreachable with the reason rather than attached.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagectl.control.protocol import RuntimeInfo
from pagectl.control.runtime import RuntimeNotFound
from pagectl.control.selection import Selector, select_runtime

# The router's listing of its backends (``pagectl route``).
BACKENDS_PATH = "/router/backends"
# Host names and addresses that are this machine.
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::", "ip6-localhost"})


@dataclass(frozen=True)
class MemberSpec:
    """One member of a fleet, before it is attached."""

    # What the console calls it: "host:port", "engine i", or "host:port engine i".
    label: str
    # The daemon's HTTP URL; its runtime file is found by it at every (re)connection.
    http_url: str
    # Data-parallel engine index (None: the daemon's top-level endpoints, one engine).
    engine: int | None = None
    # Why the console cannot attach to it ("" when it can), e.g. a backend on another host.
    unreachable: str = ""


def host_port(url: str) -> str:
    """ "host:port" of an HTTP URL (the label of a daemon in a fleet)."""
    parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}" if port is not None else host


def is_local_url(url: str) -> bool:
    """Whether ``url`` names this machine (loopback, 127/8, or this host's own name)."""
    host = (urllib.parse.urlsplit(url if "://" in url else "http://" + url).hostname or "").lower()
    if host in LOOPBACK or host.startswith("127."):
        return True
    names = {socket.gethostname().lower(), socket.getfqdn().lower()}
    return host in names


def engine_endpoints(info: RuntimeInfo, engine: int | None) -> tuple[str, str]:
    """(telemetry, control) endpoints of one engine of the daemon ``info`` describes.

    Raises:
        RuntimeNotFound: the daemon has no engine ``engine`` (it restarted with fewer).
    """
    if engine is None or (not info.engines and engine == 0):
        return info.telemetry_endpoint, info.control_endpoint
    for e in info.engines:
        if e.index == engine:
            return e.telemetry_endpoint, e.control_endpoint
    raise RuntimeNotFound(f"the daemon at {info.http_url} has no engine {engine}")


# A backends list larger than this is not a router's answer.
_MAX_BACKENDS_BODY = 1 << 20


def router_backends(url: str, timeout: float = 2.0) -> list[str] | None:
    """The backend URLs a ``pagectl route`` proxy at ``url`` lists, or None when ``url``
    does not answer as one."""
    base = url if "://" in url else "http://" + url
    try:
        with urllib.request.urlopen(base.rstrip("/") + BACKENDS_PATH, timeout=timeout) as r:
            raw = r.read(_MAX_BACKENDS_BODY + 1)
        if len(raw) > _MAX_BACKENDS_BODY:
            return None
        body = json.loads(raw)
    except (OSError, ValueError, http.client.HTTPException):  # URLError is an OSError
        return None
    items = body.get("backends") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return None
    urls = [b.get("url") for b in items if isinstance(b, dict)]
    return [u for u in urls if isinstance(u, str)]


def _engines(info: RuntimeInfo) -> list[int | None]:
    return [e.index for e in sorted(info.engines, key=lambda e: e.index)] or [None]


def _daemon_members(info: RuntimeInfo, url: str, alone: bool) -> list[MemberSpec]:
    """The members of one daemon found by its runtime file: itself, or each engine."""
    engines = _engines(info)
    if engines == [None]:
        return [MemberSpec(host_port(url), url)]
    name = "" if alone else host_port(url) + " "
    return [MemberSpec(f"{name}engine {i}", url, i) for i in engines]


def fleet_members(
    runtime_dir: str | os.PathLike | None,
    urls: Sequence[str],
    backends_of: Callable[[str], list[str] | None] = router_backends,
) -> list[MemberSpec]:
    """The members ``pagectl top --url U ...`` shows, in the order given.

    A URL whose daemon has a runtime file here is that daemon (or its engines). A URL with
    none is asked for ``/router/backends``: a router stands for its backends, each attached
    when it is local and has a runtime file here, else listed with the reason. Any other URL
    stays a member that attaches once its daemon appears.
    """
    found: list[tuple[str, RuntimeInfo | None, str]] = []
    for url in urls:
        try:
            found.append((url, select_runtime(runtime_dir, Selector(url=url)), ""))
            continue
        except RuntimeNotFound:
            pass
        backends = backends_of(url)
        if backends is None:
            found.append((url, None, ""))
            continue
        for b in backends:
            if not is_local_url(b):
                why = "on another host: the admin channel is local, run pagectl top there"
                found.append((b, None, why))
                continue
            try:
                found.append((b, select_runtime(runtime_dir, Selector(url=b)), ""))
            except RuntimeNotFound:
                found.append((b, None, "no runtime file for it here (see pagectl ls)"))
    alone = len(found) == 1
    members: list[MemberSpec] = []
    for url, info, why in found:
        if info is None:
            members.append(MemberSpec(host_port(url), url, None, why))
        else:
            members.extend(_daemon_members(info, info.http_url or url, alone))
    return members


def plan_fleet(
    runtime_dir: str | os.PathLike | None,
    selector: Selector,
    urls: Sequence[str],
    backends_of: Callable[[str], list[str] | None] = router_backends,
) -> list[MemberSpec] | None:
    """The fleet ``pagectl top`` shows, or None for the one-daemon console: several URLs; a
    daemon (the one named, or the only one) with several engines; a router's URL."""
    if len(urls) > 1:
        return fleet_members(runtime_dir, urls, backends_of)
    try:
        info = select_runtime(runtime_dir, selector)
    except RuntimeNotFound:  # ambiguous (the picker asks), or no daemon (the header says so)
        backends = backends_of(urls[0]) if urls else None
        if backends is None:
            return None
        return fleet_members(runtime_dir, urls, lambda url: backends)
    if not info.engines:
        return None
    return _daemon_members(info, info.http_url, alone=True)
