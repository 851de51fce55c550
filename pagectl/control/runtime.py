"""The runtime directory: where a running daemon leaves its sockets, token and runtime file.

Layout (every directory 0700, every file 0600)::

    <runtime dir>/                 $PAGECTL_RUNTIME_DIR, else $XDG_RUNTIME_DIR/pagectl,
                                   else the user's cache dir (~/.cache/pagectl/run)
      <daemon pid>/
        runtime.json               RuntimeInfo (endpoints, model, pid, start time)
        control.token              the control token
        telemetry.sock control.sock          admin channel (ipc://)
        engine-in.sock engine-out.sock       API server <-> engine (internal)

``live_runtimes`` lists the daemons whose pid is alive; ``remove_stale_runtimes`` removes
the directories of dead ones. ``find_runtime`` picks the newest live daemon (choosing one
among several with a selector is ``pagectl.control.selection``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import tempfile
import urllib.parse
from pathlib import Path

import msgspec

from pagectl.control.protocol import RuntimeInfo

RUNTIME_FILE = "runtime.json"
TOKEN_FILE = "control.token"
AUDIT_FILE = "audit.jsonl"
# sun_path holds 108 bytes on Linux (104 on macOS); longer socket paths move to a private
# short directory from ``tempfile.mkdtemp`` (0700 as well).
_MAX_IPC_PATH = 100


class RuntimeNotFound(FileNotFoundError):
    """No live daemon recorded in the runtime directory."""


def default_runtime_dir() -> Path:
    """``$PAGECTL_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/pagectl``, else ~/.cache/pagectl/run."""
    env = os.environ.get("PAGECTL_RUNTIME_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "pagectl"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "pagectl" / "run"


def _private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user; refusing to use it")
    os.chmod(path, 0o700)
    return path


def write_private_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` (mode 0600 from the start, replaced atomically)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def loopback_only(endpoint: str) -> None:
    """Refuse a ``tcp://`` endpoint that is not on a loopback address (ipc:// is fine)."""
    if endpoint.startswith("ipc://"):
        return
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"admin endpoint must be ipc:// or tcp:// on loopback, got {endpoint!r}")
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    try:
        ok = ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = host == "localhost"
    if not ok:
        raise ValueError(
            f"admin endpoint {endpoint!r} is not on a loopback address; the admin channel is "
            "never exposed on other interfaces"
        )


class DaemonDir:
    """This daemon's private directory under the runtime dir; removed by ``remove()``."""

    def __init__(self, runtime_dir: str | os.PathLike | None = None, pid: int | None = None):
        self.runtime_dir = _private_dir(Path(runtime_dir) if runtime_dir else default_runtime_dir())
        self.path = _private_dir(self.runtime_dir / str(pid or os.getpid()))
        self.token_file = self.path / TOKEN_FILE
        self.runtime_file = self.path / RUNTIME_FILE
        self.audit_file = self.path / AUDIT_FILE
        # Where sockets go when ``path`` is too long for a socket name.
        self._socket_dir: Path | None = None

    def endpoint(self, name: str) -> str:
        """``ipc://<dir>/<name>.sock`` in this directory (or in a short private one)."""
        sock = self.path / f"{name}.sock"
        if len(str(sock)) > _MAX_IPC_PATH:
            if self._socket_dir is None:
                self._socket_dir = Path(tempfile.mkdtemp(prefix="pagectl-"))
            sock = self._socket_dir / f"{name}.sock"
        return f"ipc://{sock}"

    def create_token(self) -> str:
        token = secrets.token_urlsafe(32)
        write_private_file(self.token_file, token.encode())
        return token

    def write_runtime(self, info: RuntimeInfo) -> None:
        write_private_file(self.runtime_file, msgspec.json.encode(info))

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)


def read_runtime_file(path: str | os.PathLike) -> RuntimeInfo:
    return msgspec.json.decode(Path(path).read_bytes(), type=RuntimeInfo)


def read_token(path: str | os.PathLike) -> str | None:
    """The control token, or None when the file is missing or unreadable (read-only mode)."""
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _candidates(base: Path) -> list[Path]:
    if base.is_file():
        return [base]
    if (base / RUNTIME_FILE).is_file():
        return [base / RUNTIME_FILE]
    return sorted(base.glob(f"*/{RUNTIME_FILE}"))


def live_runtimes(runtime_dir: str | os.PathLike | None = None) -> list[RuntimeInfo]:
    """The runtime info of every live daemon, oldest first.

    Args:
        runtime_dir: a runtime directory (default: ``default_runtime_dir()``), one daemon's
            directory inside it, or a runtime file.
    """
    base = Path(runtime_dir).expanduser() if runtime_dir else default_runtime_dir()
    found: list[RuntimeInfo] = []
    for path in _candidates(base):
        with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
            info = read_runtime_file(path)
            if pid_alive(info.pid):
                found.append(info)
    return sorted(found, key=lambda i: i.start_time)


def remove_stale_runtimes(runtime_dir: str | os.PathLike | None = None) -> list[Path]:
    """Remove the directories that dead daemons left in the runtime directory.

    A daemon's directory is named by its pid; it is stale when that pid is not alive (a
    daemon killed with SIGKILL, a crash). Only directories named by a pid and owned by this
    user are touched; a starting daemon (no runtime file yet) is alive, so it is kept.
    Returns the directories removed.
    """
    base = Path(runtime_dir).expanduser() if runtime_dir else default_runtime_dir()
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for d in entries:
        if not d.name.isdigit():
            continue
        try:
            st = d.lstat()
        except OSError:
            continue
        if not os.path.isdir(d) or d.is_symlink() or st.st_uid != os.getuid():
            continue
        if pid_alive(int(d.name)):
            continue
        # A dead daemon's sockets may have lived in a short private directory.
        with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
            info = read_runtime_file(d / RUNTIME_FILE)
            for ep in (info.telemetry_endpoint, info.control_endpoint):
                sock_dir = Path(ep.removeprefix("ipc://")).parent
                if ep.startswith("ipc://") and sock_dir.name.startswith("pagectl-"):
                    shutil.rmtree(sock_dir, ignore_errors=True)
        shutil.rmtree(d, ignore_errors=True)
        removed.append(d)
    return removed


def find_runtime(runtime_dir: str | os.PathLike | None = None) -> RuntimeInfo:
    """The runtime info of the newest live daemon.

    Args:
        runtime_dir: a runtime directory (default: ``default_runtime_dir()``), one daemon's
            directory inside it, or a runtime file.

    Raises:
        RuntimeNotFound: no live daemon is recorded there.
    """
    found = live_runtimes(runtime_dir)
    if not found:
        base = Path(runtime_dir).expanduser() if runtime_dir else default_runtime_dir()
        raise RuntimeNotFound(no_daemon_message(base))
    return found[-1]


def no_daemon_message(base: Path) -> str:
    return (
        f"no running pagectl daemon found in {base} (start one with `pagectl daemon`, or "
        "pass --runtime-dir / set PAGECTL_RUNTIME_DIR to where it runs)"
    )
