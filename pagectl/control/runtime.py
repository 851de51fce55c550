"""The runtime directory: where a running daemon leaves its sockets, token and runtime file.

Layout (every directory the daemon creates 0700, every file 0600; see ``runtime_base`` for
which existing directories it accepts -- it never chmods one)::

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
import stat
import tempfile
import urllib.parse
from pathlib import Path

import msgspec

from pagectl.control.protocol import RuntimeInfo

RUNTIME_FILE = "runtime.json"
TOKEN_FILE = "control.token"
# Where the sockets went when the daemon's directory was too long for a socket name.
SOCKET_DIR_FILE = "socket-dir"
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


def runtime_base(path: Path) -> Path:
    """The directory daemons create their own directories in, made safe to use.

    Never changes the mode of a directory it did not create:
    - missing: created 0700;
    - owned by another user (other than root): refused;
    - writable by group or others with the sticky bit (``/tmp``): a private subdirectory
      ``pagectl-<uid>`` in it is used instead (checked the same way);
    - writable by group or others without the sticky bit: refused (anyone could replace
      our files there);
    - otherwise used as it is (what goes inside is 0700 / 0600 anyway).
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(path)
        if st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return path
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"runtime dir {path} is not a directory")
    if st.st_uid not in (os.getuid(), 0):
        raise PermissionError(f"runtime dir {path} belongs to another user; refusing to use it")
    if st.st_mode & 0o022:
        if st.st_mode & stat.S_ISVTX:
            return runtime_base(path / f"pagectl-{os.getuid()}")
        raise PermissionError(
            f"runtime dir {path} is writable by other users and has no sticky bit; refusing "
            "to use it (choose a private directory)"
        )
    return path


def _fresh_private_dir(path: Path) -> Path:
    """``path`` created 0700 by us now; a leftover of ours (a dead daemon that had our pid)
    is removed first, anything else there is refused."""
    if os.path.lexists(path):
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(f"{path} exists and is not a directory of ours; refusing")
        _remove_daemon_dir(path)
    path.mkdir(mode=0o700)
    return path


def _remove_daemon_dir(path: Path) -> None:
    """Remove one daemon's directory and the short socket directory it recorded."""
    with contextlib.suppress(OSError):
        sock_dir = Path((path / SOCKET_DIR_FILE).read_text().strip())
        st = os.lstat(sock_dir)
        if sock_dir.name.startswith("pagectl-") and st.st_uid == os.getuid():
            shutil.rmtree(sock_dir, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)


def remove_stale(runtime_dir: str | os.PathLike | None = None) -> list[Path]:
    """Remove the directories of dead daemons (killed before they could clean up, leaving
    their token and sockets) from a runtime directory; returns what was removed.

    Only directories named by a pid, owned by this user, whose pid is not alive are touched.
    Shared by ``pagectl daemon`` at start and by the finders (``pagectl ls``).
    """
    base = Path(runtime_dir).expanduser() if runtime_dir else default_runtime_dir()
    removed: list[Path] = []
    try:
        children = list(base.iterdir())
    except OSError:
        return removed
    for child in children:
        if not child.name.isdigit() or int(child.name) == os.getpid():
            continue
        try:
            st = os.lstat(child)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not pid_alive(int(child.name)):
            _remove_daemon_dir(child)
            removed.append(child)
    return removed


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
        self.runtime_dir = runtime_base(Path(runtime_dir) if runtime_dir else default_runtime_dir())
        remove_stale(self.runtime_dir)  # what SIGKILLed daemons left (tokens, sockets)
        self.path = _fresh_private_dir(self.runtime_dir / str(pid or os.getpid()))
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
                # Recorded, so that remove_stale finds it if this daemon is killed.
                write_private_file(self.path / SOCKET_DIR_FILE, str(self._socket_dir).encode())
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


def read_token_file(path: str | os.PathLike | None) -> tuple[str | None, str]:
    """(the control token, "") or (None, why the client is read-only): no file named, the
    file unreadable, or empty. The one reader of token files."""
    if not path:
        return None, "no control token file"
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        return None, f"cannot read the control token ({e.strerror}: {path})"
    if not token:
        return None, f"the control token file {path} is empty"
    return token, ""


def read_token(path: str | os.PathLike | None) -> str | None:
    """The control token, or None when the file is missing, unreadable or empty (read-only)."""
    return read_token_file(path)[0]


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
