"""Startup checks a worker runs before it creates or maps a region.

Each check either returns or raises :class:`StartupError` with a one-line
message that says what is wrong and how to fix it::

    RLIMIT_MEMLOCK is 8.0 MiB but the region needs 988.0 MiB: raise it (ulimit -l unlimited,
    docker --ulimit memlock=-1, systemd LimitMEMLOCK=infinity) or run with --no-mlock (pages
    may then be swapped, and GPU copies get slower)

The inputs a check reads from the system (free bytes, the memlock limit, the
capability bit) can be injected, so the messages are testable anywhere.
:mod:`shmrpc.server.region` raises the same messages when the kernel refuses
space or locking later (``posix_fallocate`` or ``mlock`` failing).
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

from shmrpc.schema.errors import ShmrpcError
from shmrpc.schema.layout import format_size_approx

__all__ = [
    "StartupError",
    "SHM_MARGIN_NBYTES",
    "CAP_IPC_LOCK",
    "check_shm_space",
    "check_memory",
    "memory_available_bytes",
    "cgroup_memory_room",
    "memory_error",
    "check_memlock",
    "shm_free_bytes",
    "memlock_limit",
    "has_ipc_lock",
    "shm_space_error",
    "memlock_error",
    "format_size_approx",  # re-exported from schema.layout
]

#: Headroom asked of /dev/shm beyond the region itself (other processes use it too).
SHM_MARGIN_NBYTES = 1 << 20

#: Bit of CAP_IPC_LOCK in the capability sets of /proc/<pid>/status.
CAP_IPC_LOCK = 14


class StartupError(ShmrpcError):
    """The worker cannot start; the message says why and what to do.

    Attributes:
        needed_nbytes: bytes the worker asked for (0 when not about size).
        available_nbytes: bytes the system offered (-1 when unknown or unlimited).
    """

    def __init__(self, message: str, *, needed_nbytes: int = 0, available_nbytes: int = -1) -> None:
        super().__init__(message)
        self.message = message
        self.needed_nbytes = needed_nbytes
        self.available_nbytes = available_nbytes


def shm_free_bytes(shm_dir: str = "/dev/shm") -> int:
    """Bytes an unprivileged process may still allocate in ``shm_dir`` (``statvfs`` ``f_bavail``).

    Raises:
        StartupError: ``shm_dir`` does not exist or cannot be inspected.
    """
    try:
        st = os.statvfs(shm_dir)
    except OSError as exc:
        raise StartupError(
            f"cannot inspect {shm_dir} ({exc.strerror}): mount a tmpfs there (docker does by default) "
            "or run on a host with POSIX shared memory"
        ) from exc
    return st.f_bavail * st.f_frsize


def shm_space_error(free_nbytes: int, nbytes: int, shm_dir: str = "/dev/shm") -> StartupError:
    """The :class:`StartupError` for ``nbytes`` not fitting in ``free_nbytes`` of ``shm_dir``."""
    return StartupError(
        f"{shm_dir} has {format_size_approx(free_nbytes)} free but the region needs {format_size_approx(nbytes)}: "
        "give the container more (docker --shm-size=2g), free space in /dev/shm "
        "(shmrpc doctor --clean removes stale segments), or pass a smaller --slots",
        needed_nbytes=nbytes,
        available_nbytes=free_nbytes,
    )


def check_shm_space(nbytes: int, shm_dir: str = "/dev/shm", *, free_bytes: int | None = None) -> None:
    """Check that ``shm_dir`` can hold ``nbytes`` more (plus :data:`SHM_MARGIN_NBYTES`).

    Args:
        nbytes: bytes of the region(s) about to be created.
        shm_dir: the tmpfs that backs POSIX shared memory.
        free_bytes: free bytes to assume instead of asking ``statvfs`` (tests).

    Raises:
        StartupError: not enough space; the message names the remedies.

    Example:
        >>> check_shm_space(1 << 20, free_bytes=1 << 30)
    """
    free = shm_free_bytes(shm_dir) if free_bytes is None else free_bytes
    if free < nbytes + SHM_MARGIN_NBYTES:
        raise shm_space_error(free, nbytes, shm_dir)


def memory_available_bytes(meminfo_path: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup",
                           proc_cgroup: str = "/proc/self/cgroup") -> int:
    """What memfd regions may draw on, in bytes (-1 when it cannot be read): the host's ``MemAvailable``, or less
    where this process's memory cgroup (a container's ``--memory``, a systemd ``MemoryMax=``) leaves less.

    A memfd's pages are shared memory but are not charged to /dev/shm's size; they are charged to the memory
    cgroup of the process that touches them first (the worker, which pre-faults and locks them), and a region
    past that cgroup's limit gets the worker killed by the kernel's OOM killer rather than refused.
    """
    avail = -1
    try:
        with open(meminfo_path) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    room = cgroup_memory_room(cgroup_root, proc_cgroup)
    return room if room >= 0 and (avail < 0 or room < avail) else avail


#: cgroup v2 and v1: (the /proc/self/cgroup line's prefix, the controller's directory under the mount, the limit's
#: file, its "no limit" value, the usage's file, memory.stat's keys of the page cache the kernel can reclaim)
_CGROUP_FILES = (("0::", "", "memory.max", "max", "memory.current", ("active_file", "inactive_file")),
                 ("", "memory", "memory.limit_in_bytes", "", "memory.usage_in_bytes",
                  ("total_active_file", "total_inactive_file")))


def cgroup_memory_room(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> int:
    """Bytes this process's memory cgroup and its ancestors let it add: the smallest of their limits less what each
    uses (its page cache counted as free), or -1 when no limit is set or none can be read. cgroup v2, else v1; a
    cgroup path that the mount does not show (a container without its own cgroup namespace) is looked for from the
    mount's root."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return -1
    for prefix, sub, limit_file, unlimited, usage_file, cache_keys in _CGROUP_FILES:
        base = os.path.join(root, sub)
        path = next((ln.split(":", 2)[2] for ln in lines if (ln.startswith(prefix) if prefix else
                                                              "memory" in ln.split(":", 2)[1].split(","))), None)
        if path is None or not os.path.exists(os.path.join(base, limit_file if not prefix else "cgroup.controllers")):
            continue
        rel = path.strip("/")
        while rel and not os.path.isdir(os.path.join(base, rel)):
            rel = rel.partition("/")[2]  # the mount's root is a cgroup further down the host's tree
        room = -1
        while True:
            here = os.path.join(base, rel)
            try:
                with open(os.path.join(here, limit_file)) as f:
                    text = f.read().strip()
                limit = -1 if text == unlimited else int(text)
                if 0 <= limit < 1 << 62:  # (v1 writes "no limit" as a page-rounded 2**63 - 1)
                    with open(os.path.join(here, usage_file)) as f:
                        used = int(f.read())
                    with open(os.path.join(here, "memory.stat")) as f:
                        stat = dict(ln.split() for ln in f if ln.count(" ") == 1)
                    used -= sum(int(stat.get(k, 0)) for k in cache_keys)
                    left = max(0, limit - max(0, used))
                    room = left if room < 0 else min(room, left)
            except (OSError, ValueError):
                pass
            if not rel:
                return room
            rel = os.path.dirname(rel)
    return -1


#: What the start checks count when a client gets a region of its own (``--isolation client``): the pool and one
#: client's region at the default ``--lease`` (its HELLO creates and locks it).
WITH_FIRST_CLIENT = "the pool region with one client's own region (default --lease)"


def memory_error(available_nbytes: int, nbytes: int, what_for: str = "") -> StartupError:
    """The :class:`StartupError` for a region of ``nbytes`` not fitting in the available memory (``what_for``: what
    those bytes are, default "the region")."""
    return StartupError(
        f"{format_size_approx(max(available_nbytes, 0))} of memory is available (the host's, or its memory cgroup's "
        f"limit less its use) but {what_for or 'the region'} needs "
        f"{format_size_approx(nbytes)}: free memory, give the container more, or pass a smaller --slots",
        needed_nbytes=nbytes,
        available_nbytes=available_nbytes,
    )


def check_memory(nbytes: int, *, available_bytes: int | None = None, what_for: str = "") -> None:
    """Check that ``nbytes`` more of shared memory fit in the available memory (plus :data:`SHM_MARGIN_NBYTES`).

    Args:
        nbytes: bytes of the region(s) about to be created.
        available_bytes: available bytes to assume instead of reading ``/proc/meminfo`` (tests).

    Raises:
        StartupError: not enough memory; the message names the remedies.

    Example:
        >>> check_memory(1 << 20, available_bytes=1 << 30)
    """
    avail = memory_available_bytes() if available_bytes is None else available_bytes
    if 0 <= avail < nbytes + SHM_MARGIN_NBYTES:
        raise memory_error(avail, nbytes, what_for)


def memlock_limit() -> int:
    """The soft ``RLIMIT_MEMLOCK`` in bytes (``resource.RLIM_INFINITY`` when unlimited)."""
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]


def has_ipc_lock(status_path: str = "/proc/self/status") -> bool:
    """Whether this process has CAP_IPC_LOCK in its effective set (so no memlock limit applies)."""
    try:
        with open(status_path) as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool((int(line.split()[1], 16) >> CAP_IPC_LOCK) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def memlock_error(limit: int, nbytes: int, *, what: str = "", what_for: str = "") -> StartupError:
    """The :class:`StartupError` for ``nbytes`` not lockable under a memlock ``limit``.

    ``what`` replaces the opening ("RLIMIT_MEMLOCK is 8.0 MiB") when the kernel
    refused ``mlock`` for another reason (e.g. ``"mlock failed (ENOMEM)"``); ``what_for`` names what ``nbytes``
    is (default "the region").
    """
    head = what or f"RLIMIT_MEMLOCK is {format_size_approx(limit)}"
    return StartupError(
        f"{head} but {what_for or 'the region'} needs {format_size_approx(nbytes)}: raise it (ulimit -l unlimited, "
        "docker --ulimit memlock=-1, systemd LimitMEMLOCK=infinity) or run with --no-mlock "
        "(pages may then be swapped, and GPU copies get slower)",
        needed_nbytes=nbytes,
        available_nbytes=limit,
    )


def check_memlock(nbytes: int, *, limit: int | None = None, has_cap: bool | None = None, what_for: str = "") -> None:
    """Check that ``nbytes`` can be locked in memory (``mlock``).

    Passes when the process has CAP_IPC_LOCK, when the soft limit is unlimited,
    or when it is at least ``nbytes``.

    Args:
        nbytes: bytes to lock (the regions together).
        limit: soft ``RLIMIT_MEMLOCK`` to assume instead of ``getrlimit`` (tests).
        has_cap: CAP_IPC_LOCK to assume instead of reading ``/proc/self/status`` (tests).

    Raises:
        StartupError: the limit is too low; the message names the remedies.

    Example:
        >>> check_memlock(1 << 30, limit=resource.RLIM_INFINITY, has_cap=False)
    """
    cap = has_ipc_lock() if has_cap is None else has_cap
    if cap:
        return
    lim = memlock_limit() if limit is None else limit
    if lim == resource.RLIM_INFINITY or lim < 0:
        return
    if lim < nbytes:
        raise memlock_error(lim, nbytes, what_for=what_for)


#: The most bytes of a Unix socket's path (``sun_path`` holds 108 with its terminating NUL).
SOCKET_PATH_MAX = 107
#: The longest suffix of a worker's socket files (``NAME.attach``; ``NAME.sock`` is shorter).
_LONGEST_SUFFIX = ".attach"


def name_room(rdir: Path) -> int:
    """How many bytes a worker's name may have for its sockets in ``rdir`` to fit a Unix socket's path."""
    return SOCKET_PATH_MAX - len(os.fsencode(str(rdir))) - 1 - len(_LONGEST_SUFFIX)


def check_socket_paths(name: str, rdir: Path) -> None:
    """Worker ``name``'s sockets in ``rdir`` fit a Unix socket's path.

    Raises:
        StartupError: naming the path, its length, and the remedy (a bind failed with a bare "AF_UNIX path too long").
    """
    path = rdir / f"{name}{_LONGEST_SUFFIX}"
    n = len(os.fsencode(str(path)))
    if n > SOCKET_PATH_MAX:
        raise StartupError(f"the socket path {path} is {n} bytes, over the {SOCKET_PATH_MAX} a Unix socket allows: "
                           f"point SHMRPC_RUNTIME_DIR at a shorter directory (names of up to "
                           f"{max(0, name_room(rdir))} bytes fit this one), or use a shorter --name")
