"""Startup checks: injected limits give one-line errors that carry their remedies."""

from __future__ import annotations

import resource

import pytest

from shmrpc.server.checks import (
    SHM_MARGIN_NBYTES,
    StartupError,
    check_memlock,
    check_shm_space,
    format_size_approx,
    has_ipc_lock,
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
