"""Region: creation, permissions, superblock, slot views, cleanup on every failure path."""

from __future__ import annotations

import errno
import gc
import os
import stat

import numpy as np
import pytest

from shmrpc.schema.layout import PAGE, Superblock, parse_geometry
from shmrpc.schema.proc import process_start_ticks
from shmrpc.server import region as region_mod
from shmrpc.server.checks import StartupError
from shmrpc.server.region import Region, attach_readonly, read_superblock, unlink_region
from shmrpc.server.shm import list_segments

GEOMETRY = parse_geometry("64K:3,1M:2")


def _exists(name: str) -> bool:
    return os.path.exists("/dev/shm" + name)


def test_create_name_mode_superblock(worker_name: str) -> None:
    with Region.create(worker_name, GEOMETRY, index=2, epoch=1234, memfd=False) as region:
        assert region.name.startswith(f"/shmrpc.{worker_name}.2.")
        assert len(region.name.rsplit(".", 1)[1]) == 16
        assert region.index == 2
        assert region.nbytes == GEOMETRY.region_nbytes == len(region.buf)
        assert region.mlocked
        assert not region.buf.readonly
        st = os.stat("/dev/shm" + region.name)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
        assert st.st_size == region.nbytes
        sb = Superblock.unpack_from(region.buf)
        assert sb == region.superblock
        assert sb.worker_pid == os.getpid()
        assert sb.worker_start_ticks == process_start_ticks(os.getpid())
        assert sb.epoch == 1234
        assert sb.region_nbytes == region.nbytes
        assert sb.geometry() == GEOMETRY
        assert read_superblock(region.name) == sb
        assert region.address != 0
        assert list_segments(f"shmrpc.{worker_name}.") == [region.name]


def test_create_under_narrow_umask(worker_name: str) -> None:
    old = os.umask(0o277)
    try:
        with Region.create(worker_name, GEOMETRY, mlock=False, memfd=False) as region:
            assert stat.S_IMODE(os.stat("/dev/shm" + region.name).st_mode) == 0o600
    finally:
        os.umask(old)


def test_slot_views_and_zero(worker_name: str) -> None:
    with Region.create(worker_name, GEOMETRY, mlock=False, memfd=False) as region:
        offsets = [region.geometry.slot_offset(i) for i in range(GEOMETRY.n_slots)]
        assert offsets == [PAGE, PAGE + 65536, PAGE + 2 * 65536, PAGE + 3 * 65536, PAGE + 3 * 65536 + (1 << 20)]
        for slot in range(GEOMETRY.n_slots):
            view = region.slot_view(slot)
            assert len(view) == GEOMETRY.slot_nbytes(slot)
            view[0] = slot + 1
            view[-1] = 0xEE
        with attach_readonly(region.name) as other:  # another mapping sees the same pages
            assert other.buf.readonly
            assert other.superblock() == region.superblock
            for slot, off in enumerate(offsets):
                assert other.buf[off] == slot + 1
                assert other.buf[off + GEOMETRY.slot_nbytes(slot) - 1] == 0xEE
        region.zero_slot(3)
        arr = np.frombuffer(region.slot_view(3), dtype=np.uint8)
        assert not arr.any()
        del arr
        assert region.slot_view(2)[0] == 3  # neighbours untouched
        assert region.slot_view(4)[0] == 5
        with pytest.raises(IndexError):
            region.slot_view(GEOMETRY.n_slots)
        with pytest.raises(IndexError):
            region.slot_view(-1)


def test_close_unlinks_idempotent_and_releases_views(worker_name: str) -> None:
    region = Region.create(worker_name, GEOMETRY, memfd=False)
    view = region.slot_view(0)
    region.close()
    assert region.closed and not region.mlocked
    assert not _exists(region.name)
    with pytest.raises(ValueError):
        view[0]
    with pytest.raises(ValueError, match="closed"):
        region.slot_view(0)
    with pytest.raises(ValueError, match="closed"):
        region.zero_slot(0)
    region.close()


def test_close_with_live_numpy_view_still_unlinks(worker_name: str) -> None:
    region = Region.create(worker_name, GEOMETRY, mlock=False, memfd=False)
    arr = np.frombuffer(region.slot_view(1), dtype=np.uint8)
    region.close()
    assert not _exists(region.name)
    arr[0] = 7  # the mapping lives as long as the array
    assert arr[0] == 7


def test_unclosed_region_warns(worker_name: str) -> None:
    region = Region.create(worker_name, GEOMETRY, mlock=False, memfd=False)
    name = region.name
    with pytest.warns(ResourceWarning, match="not closed"):
        del region
        gc.collect()
    assert not _exists(name)


def test_populate_fallback(worker_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    class NoMadvise:
        def __getattr__(self, attr: str):  # type: ignore[no-untyped-def]
            return getattr(region_mod._libc, attr)

        def madvise(self, *args: object) -> int:
            import ctypes

            ctypes.set_errno(errno.EINVAL)
            return -1

    monkeypatch.setattr(region_mod, "_libc", NoMadvise())
    with Region.create(worker_name, GEOMETRY, mlock=False, memfd=False) as region:
        assert Superblock.unpack_from(region.buf).region_nbytes == region.nbytes


def test_no_space_unlinks(worker_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, nbytes: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(StartupError, match=r"/dev/shm has .* free but the region needs .*--shm-size"):
        Region.create(worker_name, GEOMETRY, memfd=False)
    assert list_segments(f"shmrpc.{worker_name}.") == []


def test_mlock_failure_unlinks(worker_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(address: int, nbytes: int) -> None:
        raise region_mod.memlock_error(8 << 20, nbytes, what="mlock failed (ENOMEM)")

    monkeypatch.setattr(region_mod, "_mlock", refuse)
    with pytest.raises(StartupError, match=r"mlock failed \(ENOMEM\).*--no-mlock"):
        Region.create(worker_name, GEOMETRY, memfd=False)
    assert list_segments(f"shmrpc.{worker_name}.") == []


def test_populate_failure_unlinks(worker_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(region_mod, "_populate", fail)
    with pytest.raises(StartupError, match="could not pre-fault"):
        Region.create(worker_name, GEOMETRY, mlock=False, memfd=False)
    assert list_segments(f"shmrpc.{worker_name}.") == []


def test_superblock_failure_unlinks(worker_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(Superblock, "pack_into", boom)
    with pytest.raises(RuntimeError, match="boom"):
        Region.create(worker_name, GEOMETRY, memfd=False)
    assert list_segments(f"shmrpc.{worker_name}.") == []


def test_read_superblock_errors(worker_name: str) -> None:
    with pytest.raises(FileNotFoundError):
        read_superblock(f"/shmrpc.{worker_name}.0.0000000000000000")
    assert not unlink_region(f"/shmrpc.{worker_name}.0.0000000000000000")


def test_invalid_worker_name() -> None:
    with pytest.raises(ValueError):
        Region.create("../x", GEOMETRY, memfd=False)


def test_memfd_region_has_no_name_and_a_fixed_size(worker_name: str) -> None:
    import fcntl

    from shmrpc.server.region import REGION_SEALS

    with Region.create(worker_name, GEOMETRY, mlock=False) as region:
        assert region.fd is not None and not region.named
        assert region.name == f"memfd:shmrpc.{worker_name}.0"
        assert list_segments(f"shmrpc.{worker_name}.") == []
        st = os.fstat(region.fd)
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid() and st.st_size == region.nbytes
        assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) & REGION_SEALS == REGION_SEALS
        with pytest.raises(PermissionError):  # sealed: nobody holding the fd can cut it short under a mapping
            os.ftruncate(region.fd, 4096)
        fd = region.fd
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the region
