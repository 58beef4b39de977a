"""Startup checks: injected limits give one-line errors that carry their remedies."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from shmrpc.server.checks import (
    SHM_MARGIN_NBYTES,
    StartupError,
    cgroup_memory_room,
    check_memlock,
    check_memory,
    check_shm_space,
    format_size_approx,
    has_ipc_lock,
    memory_available_bytes,
)

MiB = 1 << 20


def test_shm_space_enough() -> None:
    check_shm_space(100 * MiB, free_bytes=100 * MiB + SHM_MARGIN_NBYTES)


def test_shm_space_short_names_sizes_and_remedies() -> None:
    with pytest.raises(StartupError) as info:
        check_shm_space(988 * MiB, free_bytes=60 * MiB)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("/dev/shm has 60.0 MiB free but the region needs 988.0 MiB:")
    for remedy in ("--shm-size", "shmrpc doctor --clean", "--slots"):
        assert remedy in msg
    assert info.value.needed_nbytes == 988 * MiB
    assert info.value.available_nbytes == 60 * MiB


def test_shm_space_margin_counts() -> None:
    with pytest.raises(StartupError):
        check_shm_space(100 * MiB, free_bytes=100 * MiB)


def test_shm_space_real_dir() -> None:
    check_shm_space(4096)


def test_shm_space_missing_dir() -> None:
    with pytest.raises(StartupError, match="cannot inspect /nonexistent/shm"):
        check_shm_space(4096, "/nonexistent/shm")


def test_memlock_short_names_sizes_and_remedies() -> None:
    with pytest.raises(StartupError) as info:
        check_memlock(988 * MiB, limit=8 * MiB, has_cap=False)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("RLIMIT_MEMLOCK is 8.0 MiB but the region needs 988.0 MiB:")
    for remedy in ("ulimit -l unlimited", "--ulimit memlock=-1", "LimitMEMLOCK=infinity", "--no-mlock"):
        assert remedy in msg


@pytest.mark.parametrize(
    ("limit", "has_cap"),
    [(resource.RLIM_INFINITY, False), (1 << 30, False), (8 * MiB, True), (0, True)],
)
def test_memlock_passes(limit: int, has_cap: bool) -> None:
    check_memlock(988 * MiB, limit=limit, has_cap=has_cap)


def test_has_ipc_lock_parses_capeff(tmp_path) -> None:  # type: ignore[no-untyped-def]
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000004000\n")
    assert has_ipc_lock(str(status))
    status.write_text("Name:\tx\nCapEff:\t000001fffeffbfff\n")
    assert not has_ipc_lock(str(status))
    assert not has_ipc_lock(str(tmp_path / "missing"))


def test_format_size_approx() -> None:
    assert format_size_approx(60 * MiB) == "60.0 MiB"
    assert format_size_approx(3 << 30) == "3.0 GiB"
    assert format_size_approx(2048) == "2.0 KiB"
    assert format_size_approx(12) == "12 B"


def _cgroup_dir(d: Path, limit: str, used: int, cache: int, v1: bool = False) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(limit + "\n")
    (d / ("memory.usage_in_bytes" if v1 else "memory.current")).write_text(f"{used}\n")
    keys = ("total_active_file", "total_inactive_file") if v1 else ("active_file", "inactive_file")
    (d / "memory.stat").write_text(f"anon {used - cache}\n{keys[0]} {cache // 2}\n{keys[1]} {cache - cache // 2}\n")


def test_a_cgroup_v2_limit_below_memavailable_is_what_a_region_may_use(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n")  # 32 GiB
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    _cgroup_dir(root / "docker" / "abc", str(2 << 30), 600 * MiB, 100 * MiB)  # 2 GiB, 500 MiB not cache
    _cgroup_dir(root / "docker", "max", 10 << 30, 0)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/docker/abc\n")
    assert cgroup_memory_room(str(root), str(proc)) == (2 << 30) - 500 * MiB
    avail = memory_available_bytes(str(meminfo), str(root), str(proc))
    assert avail == (2 << 30) - 500 * MiB
    with pytest.raises(StartupError) as e:
        check_memory(1600 * MiB, available_bytes=avail)
    assert "of memory is available (the host's, or its memory cgroup's limit less its use)" in str(e.value)
    check_memory(1000 * MiB, available_bytes=avail)
    # a parent's tighter limit wins; no limit anywhere leaves MemAvailable
    _cgroup_dir(root / "docker", str(1 << 30), 900 * MiB, 0)
    assert cgroup_memory_room(str(root), str(proc)) == (1 << 30) - 900 * MiB
    _cgroup_dir(root / "docker", "max", 0, 0)
    _cgroup_dir(root / "docker" / "abc", "max", 0, 0)
    assert cgroup_memory_room(str(root), str(proc)) == -1
    assert memory_available_bytes(str(meminfo), str(root), str(proc)) == 32 << 30


def test_a_cgroup_v1_limit_is_found_from_a_containers_mount(tmp_path: Path) -> None:
    # a container without its own cgroup namespace: /proc/self/cgroup names the host's path, the mount shows the
    # container's cgroup as its root
    root = tmp_path / "cg"
    _cgroup_dir(root / "memory", str(512 * MiB), 200 * MiB, 50 * MiB, v1=True)
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_memory_room(str(root), str(proc)) == 512 * MiB - 150 * MiB
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_memory_room(str(root), str(proc)) == -1
    assert cgroup_memory_room(str(root), str(tmp_path / "absent")) == -1


def test_the_start_counts_one_clients_region_beside_the_pool(monkeypatch: pytest.MonkeyPatch,
                                                               worker_name: str) -> None:
    """A memlock limit that holds the pool but not the first client's own region refused every client while the
    worker said ready: the start now counts one client's region at the default --lease, and refuses to start."""
    from shmrpc.schema.layout import parse_geometry
    from shmrpc.server import checks
    from shmrpc.server._loop import Worker
    from shmrpc.server.config import WorkerConfig

    cfg = WorkerConfig(worker_name, geometry=parse_geometry("64K:32,1M:4"), lease=(2, 1))
    pool, first = cfg.geometry.region_nbytes, cfg.first_client_nbytes()
    assert first == cfg.private_geometry().region_nbytes > 0  # type: ignore[union-attr]
    assert WorkerConfig(worker_name, isolation="shared").first_client_nbytes() == 0
    monkeypatch.setattr(checks, "has_ipc_lock", lambda: False)
    monkeypatch.setattr(checks, "memlock_limit", lambda: pool + first // 2)
    with pytest.raises(StartupError) as info:
        Worker(cfg).start()
    assert str(info.value).startswith(f"RLIMIT_MEMLOCK is {format_size_approx(pool + first // 2)} but the pool region "
                                      f"with one client's own region (default --lease) needs "
                                      f"{format_size_approx(pool + first)}:")
    monkeypatch.setattr(checks, "memlock_limit", lambda: pool + first)
    checks.check_memlock(pool + first)  # (what start() checks passes at that limit)
