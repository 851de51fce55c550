"""Token authentication of the telemetry PUB: ZMQ's PLAIN mechanism checked by a ZAP handler.

An ``ipc://`` path in the daemon's 0700 runtime directory is reachable by its own user only,
so it needs nothing more. A loopback ``tcp://`` port or an abstract ``ipc://@`` socket is
reachable by every local user: there the engine's PUB socket is a PLAIN server, and a
subscriber must present the user name ``pagectl`` and the control token (the first line of
the daemon's 0600 token file) as its password. A subscriber without them, or with a wrong
token, fails the handshake and receives nothing. PLAIN sends the token in clear over the
socket, which other local users cannot read on loopback (that takes root); the admin
channel never leaves loopback (``control.runtime.loopback_only``).

``--telemetry-public`` turns this off (NULL mechanism: anyone who can connect reads the
snapshots). The runtime file's ``telemetry_auth`` says which one a daemon runs, so clients
that find it through the runtime file know whether to present the token.
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from pagectl.control.runtime import read_token

# The user name of every PLAIN handshake; the password is the control token.
USERNAME = "pagectl"
# ZAP domain of the telemetry socket (the handler accepts only this one).
DOMAIN = "pagectl-telemetry"
# ``RuntimeInfo.telemetry_auth`` of a daemon whose telemetry wants the token.
PLAIN = "plain"


def reachable_by_others(endpoint: str) -> bool:
    """Whether another local user can connect to ``endpoint`` (loopback TCP, abstract ipc)."""
    return endpoint.startswith("tcp://") or endpoint.startswith("ipc://@")


def server_mode(endpoint: str, public: bool) -> str:
    """``PLAIN`` when the telemetry at ``endpoint`` must ask for the token, else ""."""
    return PLAIN if reachable_by_others(endpoint) and not public else ""


class TelemetryAuth:
    """The ZAP handler of one context, accepting PLAIN handshakes that carry ``token``.

    One thread (pyzmq's ``ThreadAuthenticator``) answers ZAP requests; it runs only during
    handshakes, never on the engine loop. ``stop()`` before the context is terminated.
    """

    def __init__(self, ctx: zmq.Context, token: str) -> None:
        self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("pagectl.telemetry_auth"))
        self._auth.start()
        self._auth.configure_plain(domain=DOMAIN, passwords={USERNAME: token})

    def protect(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a PLAIN server checked by this handler (before it binds)."""
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN.encode())

    def stop(self) -> None:
        self._auth.stop()


def present_token(sock: zmq.Socket, token: str) -> None:
    """Make the subscriber ``sock`` authenticate with ``token`` (before it connects)."""
    sock.setsockopt(zmq.PLAIN_USERNAME, USERNAME.encode())
    sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())


def subscriber_token(endpoint: str, token_file: str | None, auth: str | None) -> str | None:
    """The token a subscriber of ``endpoint`` must present, or None for none.

    ``auth``: the runtime file's ``telemetry_auth``; None when the endpoint was given by
    hand, where the token is presented when the endpoint is reachable by other users and a
    token file was given.
    """
    if not token_file:
        return None
    wanted = auth == PLAIN if auth is not None else reachable_by_others(endpoint)
    return read_token(token_file) if wanted else None
