"""``ipc://`` socket files: claimed before binding, removed only if still ours.

libzmq unlinks whatever file is at an ``ipc://PATH`` before it binds there, so binding to a
path blindly would delete any file an operator (or an attacker) names. ``claim`` runs
before the bind and refuses a path that holds anything but a dead socket of this user; the
``IpcClaim`` it returns after the bind records the socket's inode, and ``release`` removes
the file at exit only if it is still that socket. Abstract endpoints (``ipc://@name``) have
no file and need neither.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from dataclasses import dataclass


class IpcPathError(RuntimeError):
    """The path of an ipc:// endpoint cannot be used."""


@dataclass
class IpcClaim:
    path: str
    inode: int
    device: int


def ipc_path(endpoint: str) -> str | None:
    """The file of an ``ipc://`` endpoint (None: not ipc, or abstract)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    return None if path.startswith("@") or not path else path


def claim(endpoint: str) -> None:
    """Make ``endpoint``'s path free for a bind, or raise ``IpcPathError``: only a socket
    file of this user that nobody listens on (a crashed daemon's) is removed."""
    path = ipc_path(endpoint)
    if path is None:
        return
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise IpcPathError(f"{path} exists and is not a socket; refusing to replace it")
    if st.st_uid != os.getuid():
        raise IpcPathError(f"socket {path} belongs to another user; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            pass  # nobody listens: a stale socket
        except OSError as e:
            raise IpcPathError(f"cannot tell whether socket {path} is in use: {e}") from None
        else:
            raise IpcPathError(f"socket {path} is in use by another process")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def bound(endpoint: str) -> IpcClaim | None:
    """Record the socket file a bind just created (call right after ``bind``)."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    st = os.lstat(path)
    return IpcClaim(path, st.st_ino, st.st_dev)


def release(c: IpcClaim | None) -> None:
    """Remove the socket file if it is still the one we bound."""
    if c is None:
        return
    with contextlib.suppress(OSError):
        st = os.lstat(c.path)
        if stat.S_ISSOCK(st.st_mode) and (st.st_ino, st.st_dev) == (c.inode, c.device):
            os.unlink(c.path)
