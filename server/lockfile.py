"""The per-worker lock file, and cleaning up after a crashed predecessor.

One worker per name: :class:`WorkerLock` holds ``flock`` on ``<runtime>/<NAME>.lock``
while the worker lives. The file holds JSON telling a successor what to clean::

    {"pid": 4242, "start_ticks": 918273, "socket": "/run/user/1000/shmrpc/w.sock",
     "regions": ["/shmrpc.w.0.9f2c4e1a7b3d5c60"]}

Life of the lock file:

==========================  ==========================================================
state                       what :meth:`WorkerLock.acquire` does
==========================  ==========================================================
absent                      create it (0600), lock it, write our JSON
present, lock held          raise :class:`WorkerAlreadyRunning` naming the holder's pid
present, lock free          the predecessor died: unlink its listed regions (only
                            ``/shmrpc.<NAME>.*``), any unlisted ``/shmrpc.<NAME>.*``
                            region whose owner is dead, and the socket; then as above
==========================  ==========================================================

:meth:`WorkerLock.release` unlinks the file *while still holding the lock*, then
unlocks. ``acquire`` checks after locking that the path still names the inode it
locked (else it retries), so two workers never both believe they hold a name.

Process identity is ``(pid, start_ticks)``: field 22 of ``/proc/<pid>/stat``, so a
reused pid is not mistaken for the worker that died.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from shmrpc.schema.naming import lock_path, region_prefix, socket_path, validate_name
from shmrpc.schema.proc import process_start_ticks

from .checks import StartupError
from .procs import pid_alive
from .region import read_superblock, unlink_region
from .rundir import ensure_runtime_dir, remove_socket
from .shm import list_segments, owned_by_us

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_IN_ATTRIB, _IN_MOVE_SELF, _IN_DELETE_SELF = 0x4, 0x800, 0x400  # <sys/inotify.h>: a link count change is IN_ATTRIB

__all__ = ["WorkerAlreadyRunning", "WorkerLock", "read_lock_file", "lock_is_held", "remove_stale_lock"]

_BUSY_TRIES = 5

_BUSY_WAIT_S = 0.01


class WorkerAlreadyRunning(StartupError):
    """Another live process holds the lock of this worker name.

    Attributes:
        name: the worker name.
        pid: the holder's pid from its lock file (``None`` when unreadable).
    """

    def __init__(self, name: str, pid: int | None, path: Path) -> None:
        who = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(
            f"a worker named {name!r} is already running ({who}, lock {path}): stop it first, or start this one "
            "with another --name"
        )
        self.name = name
        self.pid = pid


def read_lock_file(path: Path) -> dict[str, Any] | None:
    """The JSON of a lock file, or None when it is missing, empty or not a JSON object."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def lock_is_held(path: Path) -> bool:
    """Whether some process holds ``flock`` on the lock file ``path`` (False when it is missing)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops our probe lock too
    return False


def remove_stale_lock(path: Path) -> bool:
    """Unlink the lock file ``path`` if nobody holds it; returns whether it was removed.

    Unlinks while holding the lock, the same protocol as :meth:`WorkerLock.release`, so a
    worker starting at that moment notices and retries on a fresh file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            if os.fstat(fd).st_ino != os.stat(path).st_ino:
                return False
            os.unlink(path)
        except FileNotFoundError:
            return False
        return True
    finally:
        os.close(fd)


class WorkerLock:
    """The exclusive claim of a worker name, held while the worker lives.

    Use :meth:`acquire`; release with :meth:`release` or a ``with`` block.

    Attributes:
        name: the worker name.
        path: the lock file.
        cleaned: what was removed after a dead predecessor (region names, socket path),
            for the worker to log.
        regions: region names last written with :meth:`set_regions`.

    Example:
        >>> with WorkerLock.acquire("w0") as lock:
        ...     lock.set_regions(["/shmrpc.w0.0.0123456789abcdef"])
    """

    def __init__(self, name: str, path: Path, fd: int, cleaned: list[str]) -> None:
        self.name = name
        self.path = path
        self.cleaned = cleaned
        self.regions: list[str] = []
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, name: str, *, shared: bool = False, clean: bool = True) -> WorkerLock:
        """Take the lock of worker ``name``, cleaning up after a dead predecessor.

        Args:
            name: the worker name (validated).
            shared: the runtime directory may be 0711 (``--allow-uid``).
            clean: remove what a dead predecessor left (False: a running worker taking its removed lock file
                again, whose sockets are its own).

        Returns:
            The held lock, its JSON written with this process's pid and no regions.

        Raises:
            WorkerAlreadyRunning: a live process holds the lock.
            StartupError: the runtime directory is unsafe.
        """
        validate_name(name)
        ensure_runtime_dir(shared=shared)
        path = lock_path(name)
        busy_tries = 0
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as e:  # no space or inodes left, a read-only file system
                raise StartupError(f"cannot create the lock file {path}: {e.strerror or e}; free space in (or fix) "
                                   f"{Path(path).parent}, or point SHMRPC_RUNTIME_DIR elsewhere") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                busy_tries += 1
                if busy_tries < _BUSY_TRIES:  # a doctor probe holds it for microseconds; a worker for good
                    time.sleep(_BUSY_WAIT_S)
                    continue
                info = read_lock_file(path) or {}
                pid = info.get("pid")
                raise WorkerAlreadyRunning(name, pid if isinstance(pid, int) else None, path) from None
            except BaseException:
                os.close(fd)
                raise
            # NOTE: the holder we raced may have unlinked this inode before unlocking; retry on the new file.
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        try:
            os.fchmod(fd, 0o600)
            previous = _read_fd(fd)
            cleaned = _clean_predecessor(name, previous) if clean else []
            lock = cls(name, path, fd, cleaned)
            lock._write()
        except OSError as e:  # a full or read-only file system under the runtime directory
            with contextlib.suppress(OSError):
                os.unlink(path)  # ours (we hold its lock): not left for `shmrpc doctor` to report as stale
            os.close(fd)
            raise StartupError(f"cannot write the lock file {path}: {e.strerror or e}; free space in (or fix) "
                               f"{Path(path).parent}, or point SHMRPC_RUNTIME_DIR elsewhere") from None
        except BaseException:
            os.close(fd)
            raise
        return lock

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._fd is not None

    def watch(self) -> int:
        """An inotify fd that turns readable when the lock file's links or name change (its removal among them), for
        the loop to look at :meth:`lost` at once rather than at its next heartbeat; -1 where inotify is missing."""
        if self._fd is None:
            return -1
        fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return -1
        if _libc.inotify_add_watch(fd, os.fsencode(str(self.path)), _IN_ATTRIB | _IN_MOVE_SELF | _IN_DELETE_SELF) < 0:
            os.close(fd)
            return -1
        return int(fd)

    def lost(self) -> bool:
        """Whether the lock file at our path is gone or another (removed behind our back, e.g. by a tmp cleaner:
        a second worker of this name could then start)."""
        if self._fd is None:
            return False
        try:
            return os.fstat(self._fd).st_ino != os.stat(self.path).st_ino
        except FileNotFoundError:
            return True

    def set_regions(self, names: list[str]) -> None:
        """Record the worker's region names in the lock file (call after each create and unlink)."""
        self.regions = list(names)
        self._write()

    def _write(self) -> None:
        """Rewrite the JSON in place (the inode must stay the one we locked, so no rename)."""
        if self._fd is None:
            raise ValueError(f"lock of worker {self.name!r} was released; acquire it again")
        pid = os.getpid()
        data = json.dumps(
            {
                "pid": pid,
                "start_ticks": process_start_ticks(pid),
                "socket": str(socket_path(self.name)),
                "regions": self.regions,
            }
        ).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        """Delete the lock file and unlock; idempotent. The socket file is the event loop's to remove."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            # NOTE: order is important here: unlink while still locked, then unlock by closing.
            with contextlib.suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                    os.unlink(self.path)
        finally:
            os.close(fd)

    def __enter__(self) -> WorkerLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<WorkerLock {self.name!r} {'held' if self.held else 'released'}>"


def _read_fd(fd: int) -> dict[str, Any] | None:
    """The JSON object in the lock file behind ``fd``, or None."""
    size = os.fstat(fd).st_size
    if not size:
        return None
    try:
        obj = json.loads(os.pread(fd, size, 0))
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _clean_predecessor(name: str, previous: dict[str, Any] | None) -> list[str]:
    """Remove what a dead worker of ``name`` left behind; returns what was removed."""
    cleaned: list[str] = []
    prefix = "/" + region_prefix(name)
    listed = previous.get("regions") if previous else None
    if isinstance(listed, list):
        for region in listed:
            if isinstance(region, str) and region.startswith(prefix) and unlink_region(region):
                cleaned.append(region)
    # Regions created after the predecessor last wrote its lock file (it died in between).
    for region in list_segments(prefix[1:]):
        try:
            sb = read_superblock(region)
        except (OSError, ValueError):
            owner_alive = False  # never finished starting: no superblock yet
        else:
            owner_alive = pid_alive(sb.worker_pid, sb.worker_start_ticks)
        if not owner_alive and owned_by_us(region) and unlink_region(region):
            cleaned.append(region)
    if remove_socket(name):
        cleaned.append(str(socket_path(name)))
    return cleaned
