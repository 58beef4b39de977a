"""Client side of a region: attach by name, check the superblock, hand out slot memoryviews."""

from __future__ import annotations

import mmap
import os

import posix_ipc

from shmrpc.schema import SCHEMA_HASH
from shmrpc.schema.errors import ConnectError, ProtocolMismatchError
from shmrpc.schema.layout import Geometry, Superblock

__all__ = ["AttachedRegion"]


class AttachedRegion:
    """A worker's region mapped read-write into this process (the worker alone creates and unlinks it)."""

    def __init__(self, name: str, index: int, nbytes: int, geometry: Geometry, worker_pid: int) -> None:
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise ConnectError(f"region {name} named by the worker does not exist; is the worker restarting?") from None
        except posix_ipc.PermissionsError:
            raise ConnectError(f"no permission to open region {name}: the worker runs as another user") from None
        try:
            if os.fstat(shm.fd).st_size != nbytes:
                raise ConnectError(f"region {name} is not {nbytes} bytes as the worker said")
            self._mmap = mmap.mmap(shm.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            shm.close_fd()
        self.name, self.index, self.nbytes, self.geometry = name, index, nbytes, geometry
        self.buf = memoryview(self._mmap)
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
        """Unmap, unless views handed out are still alive (then the mapping goes when they do)."""
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            pass  # live numpy views still use the mapping; it is unmapped when the last one goes
