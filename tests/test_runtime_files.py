"""Files and sockets: the runtime dir is never chmodded, only our dead sockets are removed.

Found by an adversarial run: ``--runtime-dir`` chmodded an existing directory (a 1777 one;
as root it would change /tmp), an explicit ``ipc://PATH`` deleted whatever file was at PATH
and left its socket after exit, and a SIGKILLed daemon left its token behind.
"""

from __future__ import annotations

import os
import signal
import socket
import stat

import pytest
from test_engine_frames import fake_daemon

from pagectl.control import ipc
from pagectl.control.runtime import DaemonDir, remove_stale, runtime_base


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_sticky_world_writable_dir_is_left_alone_and_a_private_subdir_used(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    d = DaemonDir(shared)
    try:
        assert mode(shared) == 0o1777  # unchanged
        assert d.runtime_dir == shared / f"pagectl-{os.getuid()}"
        assert mode(d.runtime_dir) == 0o700 and mode(d.path) == 0o700
    finally:
        d.remove()


def test_a_world_writable_dir_without_sticky_bit_is_refused(tmp_path):
    bad = tmp_path / "open"
    bad.mkdir()
    os.chmod(bad, 0o777)
    with pytest.raises(PermissionError, match="sticky"):
        runtime_base(bad)
    assert mode(bad) == 0o777


def test_an_existing_private_enough_dir_keeps_its_mode(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    os.chmod(mine, 0o755)
    assert runtime_base(mine) == mine and mode(mine) == 0o755
    missing = tmp_path / "a" / "b"
    assert runtime_base(missing) == missing and mode(missing) == 0o700


def test_remove_stale_removes_dead_daemons_dirs_only(tmp_path):
    base = runtime_base(tmp_path / "run")
    dead = base / "999999999"
    dead.mkdir()
    (dead / "control.token").write_text("secret")
    alive = base / str(os.getppid())
    alive.mkdir()
    other = base / "notes"
    other.mkdir()
    assert remove_stale(base) == [dead]
    assert not dead.exists() and alive.exists() and other.exists()


def test_ipc_claim_refuses_files_and_live_sockets_and_frees_stale_ones(tmp_path):
    regular = tmp_path / "important.txt"
    regular.write_text("keep me")
    with pytest.raises(ipc.IpcPathError, match="not a socket"):
        ipc.claim(f"ipc://{regular}")
    assert regular.read_text() == "keep me"
    live_path = tmp_path / "live.sock"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(live_path))
    live.listen()
    try:
        with pytest.raises(ipc.IpcPathError, match="in use"):
            ipc.claim(f"ipc://{live_path}")
    finally:
        live.close()
    ipc.claim(f"ipc://{live_path}")  # nobody listens any more: stale, removed
    assert not live_path.exists()
    ipc.claim("ipc://@abstract-name")  # no file: nothing to do


def test_release_removes_only_the_socket_we_bound(tmp_path):
    path = tmp_path / "s.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    c = ipc.bound(f"ipc://{path}")
    s.close()
    os.unlink(path)
    path.write_text("someone else's file now")
    ipc.release(c)
    assert path.read_text() == "someone else's file now"


def test_an_explicit_ipc_path_holding_a_file_is_refused_and_kept(tmp_path_factory, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("data")
    d = fake_daemon(tmp_path_factory, "--admin-control-endpoint", f"ipc://{victim}")
    with pytest.raises(RuntimeError, match="exited"):
        d.start(timeout=60)
    assert victim.read_text() == "data"


def test_explicit_ipc_socket_is_removed_at_exit_and_a_killed_daemons_dir_at_next_start(
    tmp_path_factory, tmp_path
):
    sock = tmp_path / "ctl.sock"
    d = fake_daemon(tmp_path_factory, "--admin-control-endpoint", f"ipc://{sock}")
    d.start()
    assert stat.S_ISSOCK(os.lstat(sock).st_mode)
    own_dir = d.runtime_dir / str(d.proc.pid)
    assert (own_dir / "control.token").exists()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(30) == 0
    assert not sock.exists() and not own_dir.exists()
    # SIGKILL leaves the directory with the token; the next daemon removes it.
    d2 = fake_daemon(tmp_path_factory)
    d2.runtime_dir = d.runtime_dir
    d2.env["PAGECTL_RUNTIME_DIR"] = str(d.runtime_dir)
    d2.start()
    killed_dir = d2.runtime_dir / str(d2.proc.pid)
    for k in d2.children():
        k.kill()
    d2.proc.kill()
    d2.proc.wait(10)
    assert (killed_dir / "control.token").exists()
    d3 = fake_daemon(tmp_path_factory)
    d3.runtime_dir = d.runtime_dir
    d3.env["PAGECTL_RUNTIME_DIR"] = str(d.runtime_dir)
    d3.start()
    try:
        assert not killed_dir.exists()
    finally:
        d3.kill()


def test_api_key_file_protects_the_api(tmp_path_factory, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("k-123\n")
    os.chmod(key_file, 0o600)
    d = fake_daemon(tmp_path_factory, "--api-key-file", str(key_file))
    d.start()
    try:
        import requests

        url = d.base_url + "/v1/models"
        assert requests.get(url, timeout=10).status_code == 401
        ok = requests.get(url, headers={"Authorization": "Bearer k-123"}, timeout=10)
        assert ok.status_code == 200
        with open(f"/proc/{d.proc.pid}/cmdline", "rb") as f:
            assert b"k-123" not in f.read()
    finally:
        d.kill()
