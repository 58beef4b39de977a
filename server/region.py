"""The worker's shared-memory regions: the only code that creates or unlinks one.

A region is a memfd by default: shared memory with no name anywhere, which reaches a
client only as a file descriptor the worker hands over (``SCM_RIGHTS``).
:meth:`Region.create` does, in order (any failure closes or unlinks the new object,
so nothing leaks)::

    memfd_create(CLOEXEC|ALLOW_SEALING)  no name in /dev/shm; fchmod 0600
    (or shm_open(O_CREAT|O_EXCL, 0600)   memfd=False: name /shmrpc.<worker>.<index>.<16 hex>,
                                         for tools and tests)
    fstat: mode 0600, owner euid       umask can only narrow the mode; repair, then verify
    posix_fallocate(fd, 0, nbytes)     every page reserved now: no room is a clean error
                                       here, never a SIGBUS in a request later
    seals SHRINK|GROW|SEAL (memfd)     nobody holding the fd can shrink it under a mapping
                                       (a SIGBUS in the worker) or grow it
    mmap(MAP_SHARED, RW)               a memfd's fd is kept to hand over; a name's is closed
    mlock(base, nbytes)                keeps pages out of swap, and maps every page in
    or madvise(MADV_POPULATE_WRITE)    with mlock=False: map every page in (fallback: touch
                                       one byte a page); prefault=False skips it
    superblock at offset 0             magic, version, schema hash, geometry, pid, epoch

:meth:`Region.close` munlocks, releases the views it handed out, unmaps and closes
the fd or unlinks the name; it is idempotent. A ``cudaHostRegister`` of
:attr:`Region.address` must be undone by its owner *before* ``close``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import stat
import time
import warnings
import weakref
from types import TracebackType

import numpy as np
import posix_ipc

from shmrpc.schema.layout import PAGE, SUPERBLOCK_NBYTES, Geometry, Superblock
from shmrpc.schema.proc import process_start_ticks

from .checks import (
    StartupError,
    memlock_error,
    memlock_limit,
    memory_available_bytes,
    memory_error,
    shm_free_bytes,
    shm_space_error,
)
from .shm import SHM_DIR

__all__ = ["Region", "ReadonlyRegion", "attach_readonly", "read_superblock", "unlink_region", "MADV_POPULATE_WRITE",
           "REGION_SEALS"]

#: Linux >= 5.14; Python's mmap module does not always expose it.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mlock.restype = ctypes.c_int
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.restype = ctypes.c_int


def _address_of(mm: mmap.mmap) -> int:
    """Base address of a writable mmap (the temporary buffer export is dropped before returning)."""
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor


def _populate(mm: mmap.mmap, address: int, nbytes: int) -> None:
    """Map every page of the mapping in, writable, so no request takes a page fault (or SIGBUS)."""
    if _libc.madvise(address, nbytes, MADV_POPULATE_WRITE) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        raise OSError(err, os.strerror(err))
    # Kernel < 5.14: write one byte per page. Safe after posix_fallocate reserved the pages.
    pages = np.frombuffer(mm, dtype=np.uint8)
    try:
        pages[::PAGE] = 0
    finally:
        del pages


def _mlock(address: int, nbytes: int) -> None:
    """``mlock`` the range; raises StartupError with the remedy."""
    if _libc.mlock(address, nbytes) == 0:
        return
    err = ctypes.get_errno()
    raise memlock_error(memlock_limit(), nbytes, what=f"mlock failed ({errno.errorcode.get(err, err)})")


def _munlock(address: int, nbytes: int) -> None:
    _libc.munlock(address, nbytes)


def _allocate(fd: int, nbytes: int, *, named: bool = True) -> None:
    """Size the shm object and reserve its pages; ENOSPC becomes a StartupError with the remedy."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM) and not named:
            raise memory_error(memory_available_bytes(), nbytes) from exc
        if exc.errno == errno.ENOSPC:
            raise shm_space_error(shm_free_bytes(SHM_DIR), nbytes, SHM_DIR) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, nbytes)  # no fallocate on this filesystem: size only


#: Seals of a memfd region: its size is fixed for good (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL).
REGION_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def unlink_region(name: str) -> bool:
    """Unlink the shm object ``name`` (leading ``/``); returns False when it did not exist.

    Mappings of it stay valid until unmapped; only the name goes.
    """
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


class Region:
    """One shared-memory region of a worker: superblock plus slots, mapped read-write.

    Create with :meth:`create`; close with :meth:`close` or a ``with`` block.

    Attributes:
        name: ``memfd:shmrpc.<worker>.<index>`` (shown in ``/proc/<pid>/maps`` only; nothing to open),
            or the POSIX name with the leading ``/`` for a named region.
        fd: the memfd, kept open to hand over to clients (``None`` for a named region).
        index: the region's number within its worker.
        geometry: the slot layout.
        buf: the whole region, writable.
        address: base address of the mapping (for ``cudaHostRegister``).
        nbytes: size of the region.
        mlocked: whether the pages are locked in memory.
        superblock: what was written at offset 0.

    Example:
        >>> from shmrpc.schema.layout import parse_geometry
        >>> with Region.create("w0", parse_geometry("64K:4")) as region:
        ...     region.slot_view(0)[:4] = b"abcd"
    """

    name: str
    fd: int | None
    index: int
    geometry: Geometry
    buf: memoryview
    address: int
    nbytes: int
    mlocked: bool
    superblock: Superblock

    def __init__(self, *, name: str, index: int, geometry: Geometry, mm: mmap.mmap, address: int,
                 mlocked: bool, superblock: Superblock, fd: int | None = None) -> None:
        """Use :meth:`create`; this only gathers what ``create`` built."""
        self.name = name
        self.fd = fd
        self.index = index
        self.geometry = geometry
        self._mm: mmap.mmap | None = mm
        self.buf = memoryview(mm)
        self.address = address
        self.nbytes = geometry.region_nbytes
        self.mlocked = mlocked
        self.superblock = superblock
        # Slot views handed out, by id, so close() can release them (memoryviews are weak-referenceable
        # but not hashable when writable, hence no WeakSet).
        self._views: dict[int, weakref.ref[memoryview]] = {}

    @classmethod
    def create(cls, worker_name: str, geometry: Geometry, *, index: int = 0, mlock: bool = True,
               prefault: bool = True, epoch: int | None = None, memfd: bool = True) -> Region:
        """Create, reserve, map, pre-fault, lock and stamp a new region.

        Args:
            worker_name: the worker's name (the region name is derived from it).
            geometry: the slot layout; the region is ``geometry.region_nbytes`` long.
            index: the region's number within the worker.
            mlock: lock the pages in memory (``False`` for ``--no-mlock``).
            prefault: with ``mlock=False``, map every page in now (``mlock`` does it anyway).
            epoch: the worker's start time in ns for the superblock (default: now).
            memfd: a memfd with no name (default); ``False``: a named ``/dev/shm`` object (tools, tests).

        Returns:
            The open region.

        Raises:
            StartupError: no room (memory, or /dev/shm for a named one), ``mlock`` refused, or the object's mode is unsafe
                (the message names the remedy); the object is unlinked.
            ValueError: ``worker_name`` is invalid.
        """
        from shmrpc.schema.naming import new_region_name, validate_name

        nbytes = geometry.region_nbytes
        shm: posix_ipc.SharedMemory | None = None
        if memfd:
            name = f"memfd:shmrpc.{validate_name(worker_name)}.{index}"
            fd = os.memfd_create(name[len("memfd:"):], os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.fchmod(fd, 0o600)
        else:
            name = new_region_name(worker_name, index)
            shm = posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=0)
            fd = shm.fd
        mm: mmap.mmap | None = None
        address = 0
        locked = False
        try:
            _check_mode(fd, name)
            _allocate(fd, nbytes, named=not memfd)
            if memfd:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REGION_SEALS)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if shm is not None:
                shm.close_fd()
            address = _address_of(mm)
            if mlock:
                # mlock maps every page in as well (writable: tmpfs needs no write notification),
                # so it doubles as the pre-fault, and costs a third of MADV_POPULATE_WRITE after fallocate.
                _mlock(address, nbytes)
                locked = True
            elif prefault:
                try:
                    _populate(mm, address, nbytes)
                except OSError as exc:
                    raise StartupError(
                        f"could not pre-fault region {name} ({exc.strerror}): free memory or /dev/shm space, "
                        "or pass a smaller --slots"
                    ) from exc
            pid = os.getpid()
            sb = Superblock.for_geometry(
                geometry,
                worker_pid=pid,
                worker_start_ticks=process_start_ticks(pid) or 0,
                epoch=epoch if epoch is not None else time.time_ns(),
            )
            view = memoryview(mm)
            try:
                sb.pack_into(view)
            finally:
                view.release()
            return cls(name=name, index=index, geometry=geometry, mm=mm, address=address, mlocked=locked,
                       superblock=sb, fd=fd if memfd else None)
        except BaseException:
            if locked:
                _munlock(address, nbytes)
            if mm is not None:
                mm.close()
            if shm is None:
                os.close(fd)
            else:
                if shm.fd != -1:
                    shm.close_fd()
                unlink_region(name)
            raise

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._mm is None

    def _check_slot(self, slot: int) -> None:
        if self._mm is None:
            raise ValueError(f"region {self.name} is closed; create a new one")
        if not 0 <= slot < self.geometry.n_slots:
            raise IndexError(f"slot {slot} out of range: region {self.name} has {self.geometry.n_slots} slots")

    def slot_view(self, slot: int) -> memoryview:
        """A writable view of ``slot``'s bytes (``buf[offset : offset + slot_nbytes]``).

        Raises:
            IndexError: no such slot.
            ValueError: the region is closed.
        """
        self._check_slot(slot)
        off = self.geometry.slot_offset(slot)
        view = self.buf[off : off + self.geometry.slot_nbytes(slot)]
        views = self._views  # the callback must not hold self, or an unclosed region would never be collected
        key = id(view)
        views[key] = weakref.ref(view, lambda _ref: views.pop(key, None))
        return view

    def zero_slot(self, slot: int) -> None:
        """Fill ``slot`` with zeros (before it is leased to another client).

        Raises:
            IndexError: no such slot.
            ValueError: the region is closed.
        """
        self._check_slot(slot)
        ctypes.memset(self.address + self.geometry.slot_offset(slot), 0, self.geometry.slot_nbytes(slot))

    def close_fd(self) -> None:
        """Close the memfd kept for handing over (once the only client that gets it has it); the mapping stays."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    @property
    def named(self) -> bool:
        """Whether the region has a name in /dev/shm (``memfd=False``)."""
        return self.name.startswith("/")

    def close(self) -> None:
        """Munlock, release views, unmap and unlink the region; idempotent.

        If a caller still holds a buffer over the region (e.g. a numpy array), the
        name is unlinked anyway and the pages are unmapped when that buffer dies.
        """
        mm, self._mm = self._mm, None
        if mm is None:
            return
        try:
            if self.mlocked:
                _munlock(self.address, self.nbytes)
                self.mlocked = False
            for ref in list(self._views.values()):
                view = ref()
                if view is None:
                    continue
                try:
                    view.release()
                except BufferError:
                    pass  # something still exports it; the mapping outlives us
            self._views.clear()
            try:
                self.buf.release()
                mm.close()
            except BufferError:
                pass
        finally:
            fd, self.fd = self.fd, None
            if fd is not None:
                os.close(fd)
            if self.named:
                unlink_region(self.name)

    def __enter__(self) -> Region:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_mm", None) is not None:
            warnings.warn(f"region {self.name} was not closed; call Region.close()", ResourceWarning, source=self,
                          stacklevel=1)
            self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes} bytes, {self.geometry.n_slots} slots"
        return f"<Region {self.name} {state}>"


def _check_mode(fd: int, name: str) -> None:
    """Make sure the new object is 0600 and ours; raises StartupError otherwise."""
    st = os.fstat(fd)
    if stat.S_IMODE(st.st_mode) != 0o600:
        os.fchmod(fd, 0o600)  # the umask narrowed it (e.g. 0400); clients of our uid need rw
        st = os.fstat(fd)
    if stat.S_IMODE(st.st_mode) != 0o600 or st.st_uid != os.geteuid():
        raise StartupError(
            f"region {name} has mode {stat.S_IMODE(st.st_mode):04o} and owner uid {st.st_uid} instead of 0600 "
            f"and uid {os.geteuid()}: check what else manages {SHM_DIR} (it must be a plain tmpfs)"
        )


class ReadonlyRegion:
    """A read-only mapping of an existing region, for tools and tests.

    Attributes:
        name: the POSIX name.
        buf: the whole region, read-only.
        nbytes: its size.

    Example:
        >>> with attach_readonly(region.name) as att:
        ...     sb = att.superblock()
    """

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self._mm: mmap.mmap | None = mm
        self.buf = memoryview(mm)
        self.nbytes = len(mm)

    def superblock(self) -> Superblock:
        """The decoded superblock; raises ValueError when it is not a shmrpc region."""
        return Superblock.unpack_from(self.buf)

    def close(self) -> None:
        """Unmap; idempotent. Does not unlink."""
        mm, self._mm = self._mm, None
        if mm is not None:
            self.buf.release()
            mm.close()

    def __enter__(self) -> ReadonlyRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_existing(name: str) -> int:
    """An fd of region ``name``, read-only: a regular file, opened without following a link and without blocking
    (``/dev/shm`` is writable by every user: a FIFO or a link planted under a region's name must not hang or mislead
    the worker's start or ``shmrpc doctor``). The caller closes it.

    Raises:
        FileNotFoundError: no such region.
        PermissionError: not readable by this user.
        OSError: anything but a regular file there.
    """
    path = os.path.join(SHM_DIR, name.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError as exc:
        raise FileNotFoundError(errno.ENOENT, f"no region {name}") from exc
    except PermissionError as exc:
        raise PermissionError(errno.EACCES, f"region {name} is not readable by this user") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symbolic link, not a region") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a regular file, not a region")
    return fd


def attach_readonly(name: str) -> ReadonlyRegion:
    """Map the existing region ``name`` read-only.

    Raises:
        FileNotFoundError: no such region.
        OSError: it cannot be opened or mapped (permissions, size 0).
    """
    fd = _open_existing(name)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise OSError(errno.EINVAL, f"region {name} is empty")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    return ReadonlyRegion(name, mm)


def read_superblock(name: str) -> Superblock:
    """The superblock of region ``name``, read without mapping it.

    Raises:
        FileNotFoundError: no such region.
        OSError: it cannot be read.
        ValueError: it holds no valid superblock (not shmrpc, another layout, or not written yet).
    """
    fd = _open_existing(name)
    try:
        data = os.pread(fd, SUPERBLOCK_NBYTES, 0)
    finally:
        os.close(fd)
    return Superblock.unpack_from(data)

