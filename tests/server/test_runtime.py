"""Runtime directory, process identity, the worker lock and cleanup after a dead predecessor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import posix_ipc
import pytest

from shmrpc.schema.naming import lock_path, runtime_dir, socket_path
from shmrpc.server.checks import StartupError
from shmrpc.server.lockfile import WorkerAlreadyRunning, WorkerLock, lock_is_held, remove_stale_lock
from shmrpc.server.procs import pid_alive, process_start_ticks
from shmrpc.server.rundir import ensure_runtime_dir, remove_socket
from shmrpc.server.shm import list_segments


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _segment(name: str) -> str:
    shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=4096)
    shm.close_fd()
    return name


def test_ensure_runtime_dir_creates_0700(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "a" / "rt"
    monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(target))
    old = os.umask(0o022)
    try:
        assert ensure_runtime_dir() == target
    finally:
        os.umask(old)
    assert (target.stat().st_mode & 0o777) == 0o700
    assert ensure_runtime_dir() == target  # existing and fine


def test_ensure_runtime_dir_refuses_open_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "rt"
    target.mkdir()
    target.chmod(0o755)
    monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(target))
    with pytest.raises(StartupError, match=r"mode 0755.*chmod 700 .*SHMRPC_RUNTIME_DIR"):
        ensure_runtime_dir()


def test_ensure_runtime_dir_refuses_file_and_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "rt"
    target.write_text("")
    monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(target))
    with pytest.raises(StartupError, match="not a directory"):
        ensure_runtime_dir()
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(link))
    with pytest.raises(StartupError, match="not a directory"):
        ensure_runtime_dir()


def test_process_identity() -> None:
    me = os.getpid()
    ticks = process_start_ticks(me)
    assert isinstance(ticks, int) and ticks > 0
    assert pid_alive(me)
    assert pid_alive(me, ticks)
    assert not pid_alive(me, ticks + 1)  # a reused pid has another start time
    dead = _dead_pid()
    assert process_start_ticks(dead) is None or not pid_alive(dead)
    assert not pid_alive(0) and not pid_alive(-1)


def test_lock_twice_raises_with_pid(worker_name: str) -> None:
    with WorkerLock.acquire(worker_name) as lock:
        assert lock.held and lock.cleaned == []
        assert lock_is_held(lock.path)
        assert (lock.path.stat().st_mode & 0o777) == 0o600
        info = json.loads(lock.path.read_text())
        assert info["pid"] == os.getpid()
        assert info["start_ticks"] == process_start_ticks(os.getpid())
        assert info["socket"] == str(socket_path(worker_name))
        assert info["regions"] == []
        with pytest.raises(WorkerAlreadyRunning) as exc_info:
            WorkerLock.acquire(worker_name)
        assert exc_info.value.pid == os.getpid()
        assert f"pid {os.getpid()}" in str(exc_info.value)
        assert isinstance(exc_info.value, StartupError)
        lock.set_regions(["/shmrpc.x.0.0123456789abcdef"])
        assert json.loads(lock.path.read_text())["regions"] == ["/shmrpc.x.0.0123456789abcdef"]
    assert not lock.held
    assert not lock.path.exists()
    lock.release()  # idempotent
    with WorkerLock.acquire(worker_name):  # free again
        pass


def test_lock_held_by_other_process(worker_name: str) -> None:
    code = (
        "import sys; from shmrpc.server.lockfile import WorkerLock; "
        f"l = WorkerLock.acquire({worker_name!r}); print('ok', flush=True); sys.stdin.read(); l.release()"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ok"
        with pytest.raises(WorkerAlreadyRunning) as exc_info:
            WorkerLock.acquire(worker_name)
        assert exc_info.value.pid == proc.pid
    finally:
        proc.communicate("", timeout=10)
    assert proc.returncode == 0


def test_stale_lock_cleans_predecessor(worker_name: str) -> None:
    ensure_runtime_dir()
    mine = _segment(f"/shmrpc.{worker_name}.0.00000000000000aa")
    other = _segment(f"/shmrpc.{worker_name}x.0.00000000000000bb")  # another worker's prefix: not ours to touch
    unlisted = _segment(f"/shmrpc.{worker_name}.1.00000000000000cc")  # created after the last lock write
    try:
        sock = socket_path(worker_name)
        sock.write_text("")
        dead = _dead_pid()
        lock_path(worker_name).write_text(
            json.dumps({"pid": dead, "start_ticks": 1, "socket": str(sock), "regions": [mine, other]})
        )
        with WorkerLock.acquire(worker_name) as lock:
            assert sorted(lock.cleaned) == sorted([mine, unlisted, str(sock)])
            assert not sock.exists()
            assert list_segments(f"shmrpc.{worker_name}.") == []
            assert list_segments(f"shmrpc.{worker_name}x.") == [other]
            assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    finally:
        for name in (mine, other, unlisted):
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass


def test_junk_lock_file_is_replaced(worker_name: str) -> None:
    ensure_runtime_dir()
    lock_path(worker_name).write_text("{not json")
    with WorkerLock.acquire(worker_name) as lock:
        assert lock.cleaned == []
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()


def test_orphan_socket_without_lock_is_removed(worker_name: str) -> None:
    ensure_runtime_dir()
    sock = socket_path(worker_name)
    sock.write_text("")
    with WorkerLock.acquire(worker_name) as lock:
        assert lock.cleaned == [str(sock)]
    assert not remove_socket(worker_name)


def test_remove_socket(worker_name: str) -> None:
    ensure_runtime_dir()
    socket_path(worker_name).write_text("")
    assert remove_socket(worker_name)
    assert not remove_socket(worker_name)


def test_invalid_name() -> None:
    with pytest.raises(ValueError, match="invalid worker name"):
        WorkerLock.acquire("../evil")


def test_runtime_dir_is_the_session_one() -> None:
    assert str(runtime_dir()) == os.environ["SHMRPC_RUNTIME_DIR"]


def test_remove_stale_lock(worker_name: str) -> None:
    with WorkerLock.acquire(worker_name) as lock:
        assert not remove_stale_lock(lock.path)  # held: kept
        assert lock.path.exists()
    lock.path.write_text("{}")
    assert remove_stale_lock(lock.path)
    assert not lock.path.exists()
    assert not remove_stale_lock(lock.path)


def test_a_lock_file_that_cannot_be_written_is_one_line_and_left_behind_by_nobody(
        worker_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full file system under the runtime directory: the start is refused with the path and the remedy (a bare
    `OSError: [Errno 28] No space left on device` before), and no empty lock file is left for doctor to report."""
    import errno

    def full(self: WorkerLock) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(WorkerLock, "_write", full)
    with pytest.raises(StartupError) as e:
        WorkerLock.acquire(worker_name)
    path = lock_path(worker_name)
    assert str(e.value).startswith(f"cannot write the lock file {path}: No space left on device; free space in")
    assert not path.exists()


def test_a_directory_opened_to_passing_through_serves_workers_with_and_without_allow_uid(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a worker with --allow-uid makes the directory 0711; a plain worker started there later (another unit sharing
    # /run/shmrpc) once refused it and could not start: others may pass through, not list or change it, and the
    # plain worker's sockets are 0600 of their own; the mode is left as the shared worker needs it
    target = tmp_path / "rt"
    monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(target))
    ensure_runtime_dir(shared=True)
    assert target.stat().st_mode & 0o777 == 0o711
    assert ensure_runtime_dir() == target
    assert target.stat().st_mode & 0o777 == 0o711
    for mode in (0o731, 0o751, 0o713):  # group or other may change (w) or list (r) it: refused either way
        target.chmod(mode)
        with pytest.raises(StartupError, match=f"mode {mode:04o}"):
            ensure_runtime_dir()
        with pytest.raises(StartupError, match=f"mode {mode:04o}"):
            ensure_runtime_dir(shared=True)


@pytest.mark.parametrize(("inodes", "what"), [(2, "the lock file"), (3, "the attach socket"), (4, "the socket")])
def test_a_runtime_directory_out_of_inodes_is_one_line_naming_the_file(
        tmp_path: Path, worker_name: str, inodes: int, what: str) -> None:
    """A runtime directory on a tmpfs with no inode left for the lock, the attach socket or the ZeroMQ socket: the
    start is refused in one line naming the file and the remedy (a bare `OSError: [Errno 28]` or a ZMQError before),
    and nothing is left there."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    # the tmpfs's root and the runtime directory take two inodes: the rest are left for the worker's files
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=1M,nr_inodes={inodes}", "tmpfs", str(mnt)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        rt = mnt / "run"
        rt.mkdir(mode=0o700)
        env = {**os.environ, "SHMRPC_RUNTIME_DIR": str(rt)}
        proc = subprocess.run([sys.executable, "-m", "shmrpc.cli", "serve", "--name", worker_name],
                              env=env, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"shmrpc serve: cannot create {what} {rt / worker_name}."), lines[0]
        assert "No space left on device" in lines[0] and "SHMRPC_RUNTIME_DIR" in lines[0], lines[0]
        assert list(rt.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
