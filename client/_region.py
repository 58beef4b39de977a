"""Client side of a region: check the fd the worker handed over, map it, check the superblock, hand out slots.

Before mapping, the fd must be what a worker makes (:mod:`shmrpc.server.region`): a
regular shared-memory file owned by the worker's uid, mode 0600, of the size the
WELCOME announced, sealed against shrinking and growing (a memfd: nobody can cut it
short under our mapping). It is mapped with libc's ``mmap`` and the fd closed at once,
so this process holds no descriptor of it (Python's ``mmap`` would keep a duplicate,
a door through ``/proc/<pid>/fd`` for any process that may read our /proc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import stat

from shmrpc.schema import SCHEMA_HASH
from shmrpc.schema.errors import ConnectError, ProtocolMismatchError
from shmrpc.schema.layout import Geometry, Superblock

__all__ = ["AttachedRegion"]

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_PROT_RW = 0x1 | 0x2
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class _Mapping:
    """One mmap'ed range, unmapped when the last buffer over it is gone (it is kept alive by them)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.nbytes = address, nbytes

    def __del__(self) -> None:
        _libc.munmap(self.address, self.nbytes)


def _check_fd(fd: int, name: str, nbytes: int, worker_uid: int) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ConnectError(f"region {name} handed over by the worker is not a shared-memory file: refusing it",
                           path=name, owner_uid=st.st_uid)
    if st.st_uid != worker_uid or stat.S_IMODE(st.st_mode) != 0o600:
        raise ConnectError(f"region {name} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}, "
                           f"not by the worker's uid {worker_uid} with 0600: refusing to map it", path=name,
                           owner_uid=st.st_uid)
    if st.st_size != nbytes:
        raise ConnectError(f"region {name} is {st.st_size} bytes, not {nbytes} as the worker said: refusing it",
                           path=name)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & _SEALS != _SEALS:
        raise ConnectError(f"region {name} is not a sealed memfd (its size could change under the mapping): "
                           "refusing it; the worker must be of the same shmrpc version", path=name)


class AttachedRegion:
    """A worker's region mapped read-write into this process (the worker alone creates it)."""

    def __init__(self, fd: int, name: str, index: int, nbytes: int, geometry: Geometry, worker_pid: int,
                 worker_uid: int) -> None:
        """Check and map ``fd``; it is closed here, whatever happens."""
        try:
            _check_fd(fd, name, nbytes, worker_uid)
            address = _libc.mmap(None, nbytes, _PROT_RW, _MAP_SHARED, fd, 0)
            if address in (None, _MAP_FAILED):
                err = ctypes.get_errno()
                raise ConnectError(f"cannot map region {name}: {os.strerror(err)}")
        finally:
            os.close(fd)
        arr = (ctypes.c_char * nbytes).from_address(address)
        arr._mapping = _Mapping(address, nbytes)  # type: ignore[attr-defined]  # unmapped with the last buffer
        self.name, self.index, self.nbytes, self.geometry = name, index, nbytes, geometry
        self.buf: memoryview = memoryview(arr).cast("B")
        del arr
        try:
            sb = Superblock.unpack_from(self.buf)
        except ValueError as e:
            self.close()
            raise ConnectError(f"region {name}: {e}") from None
        if sb.schema_hash.hex() != SCHEMA_HASH:
            self.close()
            raise ProtocolMismatchError(f"region {name} was written with schema {sb.schema_hash.hex()}, this client "
                                        f"speaks {SCHEMA_HASH}: install the same shmrpc version on both sides")
        if sb.worker_pid != worker_pid or sb.geometry() != geometry:
            self.close()
            raise ConnectError(f"region {name} belongs to another worker than the one that answered")

    def slot(self, index: int) -> memoryview:
        """A fresh memoryview of slot ``index`` (released when its lease use ends)."""
        off = self.geometry.slot_offset(index)
        return self.buf[off:off + self.geometry.slot_nbytes(index)]

    def close(self) -> None:
        """Let go of the mapping: it is unmapped now, or when the last view handed out is gone."""
        try:
            self.buf.release()
        except BufferError:
            pass  # a buffer was exported from it directly; the mapping goes when that does
