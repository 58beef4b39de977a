"""doctor: finds stale regions, locks and sockets; cleans only the stale ones."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import posix_ipc
import pytest

from shmrpc.schema.layout import parse_geometry
from shmrpc.schema.naming import attach_path, lock_path, socket_path
from shmrpc.server import checks
from shmrpc.server.doctor import doctor, scan
from shmrpc.server.lockfile import WorkerLock
from shmrpc.server.region import Region
from shmrpc.server.rundir import ensure_runtime_dir
from shmrpc.server.shm import list_segments

GEOMETRY = parse_geometry("64K:2")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _stale_region(worker: str) -> str:
    """A region whose superblock names a dead worker, as a crash would leave it."""
    region = Region.create(worker, GEOMETRY, mlock=False, prefault=False, memfd=False)
    sb = region.superblock._replace(worker_pid=_dead_pid())
    sb.pack_into(region.buf)
    # Drop the mapping without unlinking, like a killed process.
    name = region.name
    region.buf.release()
    region._mm.close()  # type: ignore[union-attr]
    region._mm = None
    return name


def _mine(findings, *workers):  # type: ignore[no-untyped-def]
    return {f.path: f for f in findings if f.worker in workers}


def test_stale_region_cleaned_live_kept(worker_name: str) -> None:
    dead_worker = worker_name + "-dead"
    stale = _stale_region(dead_worker)
    junk = f"/shmrpc.{dead_worker}.1.00000000000000aa"
    posix_ipc.SharedMemory(junk, flags=posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()  # no superblock
    ensure_runtime_dir()
    lock_path(dead_worker).write_text(json.dumps({"pid": _dead_pid(), "regions": [stale]}))
    socket_path(dead_worker).write_text("")
    attach_path(dead_worker).write_text("")
    lines: list[str] = []
    try:
        with WorkerLock.acquire(worker_name), Region.create(worker_name, GEOMETRY, mlock=False, memfd=False) as live:
            socket_path(worker_name).write_text("")
            try:
                found = _mine(scan(), worker_name, dead_worker)
                assert found[stale].stale and not found[stale].alive
                assert found[junk].stale and found[junk].owner_pid is None
                assert not found[live.name].stale and found[live.name].alive
                assert found[str(lock_path(dead_worker))].stale
                assert found[str(socket_path(dead_worker))].stale
                assert found[str(attach_path(dead_worker))].stale and found[str(attach_path(dead_worker))].worker == dead_worker
                assert not found[str(lock_path(worker_name))].stale
                assert not found[str(socket_path(worker_name))].stale

                assert doctor(region_nbytes=1 << 20, out=lines.append) == 1  # report only
                assert any("STALE" in line and stale in line for line in lines)
                assert any("doctor --clean" in line for line in lines)
                assert list_segments(f"shmrpc.{dead_worker}.") == sorted([stale, junk])

                lines.clear()
                assert doctor(clean=True, region_nbytes=1 << 20, out=lines.append) == 0, lines
                assert list_segments(f"shmrpc.{dead_worker}.") == []
                assert not lock_path(dead_worker).exists()
                assert not socket_path(dead_worker).exists() and not attach_path(dead_worker).exists()
                assert list_segments(f"shmrpc.{worker_name}.") == [live.name]
                assert lock_path(worker_name).exists() and socket_path(worker_name).exists()
                assert lines[-1] == "healthy"
            finally:
                socket_path(worker_name).unlink()
    finally:
        for name in (stale, junk):
            try:
                posix_ipc.unlink_shared_memory(name)
            except posix_ipc.ExistentialError:
                pass


def test_region_of_dead_pid_kept_while_lock_held(worker_name: str) -> None:
    """A region whose pid looks dead (e.g. another pid namespace) stays while its worker's lock is held."""
    with WorkerLock.acquire(worker_name):
        stale = _stale_region(worker_name)
        try:
            found = _mine(scan(), worker_name)
            assert not found[stale].stale and found[stale].alive
            assert doctor(clean=True, region_nbytes=1 << 20, out=lambda line: None) == 0
            assert list_segments(f"shmrpc.{worker_name}.") == [stale]
        finally:
            posix_ipc.unlink_shared_memory(stale)


def test_memory_problem_reported_as_serve_reports_it(worker_name: str) -> None:
    lines: list[str] = []
    assert doctor(region_nbytes=1 << 60, out=lines.append) == 1
    problems = [line for line in lines if line.startswith("PROBLEM ")]
    assert len(problems) == 1 and problems[0].endswith(
        "of memory is available (the host's, or its memory cgroup's limit less its use) but the region needs "
        "1073741824.0 GiB: free memory, give the container more, or pass a smaller --slots")
    assert not any("/dev/shm" in line for line in lines if line.startswith("PROBLEM"))


def test_a_small_dev_shm_is_no_problem(worker_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A region is a memfd: a container's 64 MiB /dev/shm does not stop a ~100 MiB one (serve starts)."""
    monkeypatch.setattr(checks, "shm_free_bytes", lambda shm_dir="/dev/shm": 64 << 20)
    nbytes = parse_geometry("64K:4,1M:100").region_nbytes
    if checks.memory_available_bytes() < 2 * nbytes:
        pytest.skip("this host has too little memory available for the check to pass")
    lines: list[str] = []
    doctor(region_nbytes=nbytes, out=lines.append)
    assert not any(line.startswith("PROBLEM") and ("/dev/shm" in line or "memory" in line) for line in lines), lines
    assert any(line.startswith("memory: ") and line.endswith("room for a 100.3 MiB region: ok") for line in lines), lines


def test_a_fifo_or_a_link_planted_under_a_region_name_hangs_nothing(worker_name: str, tmp_path: Path) -> None:
    # /dev/shm is writable by every user: a FIFO under a region's name used to block the worker's start (reading the
    # superblock of what a predecessor might have left) and `shmrpc doctor` in open(); both read without blocking
    # now, and anything but a regular file is not a region
    from shmrpc.server.region import read_superblock

    fifo, link = f"/dev/shm/shmrpc.{worker_name}.0.fifo", f"/dev/shm/shmrpc.{worker_name}.1.link"
    target = tmp_path / "target"
    target.write_bytes(b"\0" * 4096)
    os.mkfifo(fifo, 0o666)
    os.symlink(target, link)
    try:
        for name in (fifo, link):
            with pytest.raises(OSError, match="not a regular file|symbolic link"):
                read_superblock(name.removeprefix("/dev/shm"))
        lines: list[str] = []
        doctor(region_nbytes=1 << 20, out=lines.append)  # (a hang here fails the test by its timeout)
        assert sum(worker_name in ln and "superblock unreadable" in ln for ln in lines) == 2, lines
        worker = subprocess.Popen([sys.executable, "-m", "shmrpc.server", "serve", "--name", worker_name, "--slots",
                                   "64K:2", "--lease", "1", "--backend", "numpy", "--no-mlock", "--log-level",
                                   "WARNING"], stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout is not None
            ready, _, _ = select.select([worker.stdout], [], [], 30)
            assert ready and "ready" in worker.stdout.readline(), "the worker did not start beside a planted FIFO"
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.communicate(timeout=30)  # (also closes its stdout)
            assert worker.returncode == 0
    finally:
        for name in (fifo, link):  # (the worker's start removes what its uid left under its name: these, here)
            if os.path.lexists(name):
                os.unlink(name)


def test_a_runtime_directory_too_long_for_a_socket_is_one_line_at_start_and_a_problem_for_doctor(
        tmp_path: Path, worker_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the start failed with a bare "OSError: AF_UNIX path too long" (no path, no remedy) and doctor called the
    # directory healthy
    rdir = tmp_path / ("d" * (100 - len(str(tmp_path))))  # 100 bytes: no name fits
    rdir.mkdir(mode=0o700)
    env = dict(os.environ, SHMRPC_RUNTIME_DIR=str(rdir))
    got = subprocess.run([sys.executable, "-m", "shmrpc.cli", "serve", "--name", worker_name, "--slots", "64K:4",
                          "--no-mlock", "--backend", "numpy"], env=env, capture_output=True, text=True, timeout=60)
    assert got.returncode == 1, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shmrpc serve: the socket path {rdir / worker_name}.attach is "), lines
    assert "SHMRPC_RUNTIME_DIR" in lines[0] and "(names of up to 0 bytes fit this one)" in lines[0], lines
    assert list(rdir.iterdir()) == []
    monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(rdir))
    out: list[str] = []
    assert doctor(region_nbytes=1 << 20, out=out.append) == 1
    assert [ln for ln in out if ln.startswith("PROBLEM")] == [
        f"PROBLEM runtime dir {rdir}: its path leaves 0 bytes for a worker's name in a Unix socket's path (107 "
        "bytes at most): point SHMRPC_RUNTIME_DIR at a shorter directory"], out
