"""``shmrpc doctor``: find (and with ``--clean`` remove) what crashed workers left behind, and check the host.

What it looks at, and when an item is stale:

==================  =====================================================  ===========================
item                owner                                                  stale when
==================  =====================================================  ===========================
``<NAME>.lock``     the flock holder; the pid in the JSON                  nobody holds the flock
``<NAME>.sock``,    the holder of ``<NAME>.lock``                          nobody holds that lock
``<NAME>.attach``
``/shmrpc.<NAME>.*``  superblock ``worker_pid``/``worker_start_ticks``,     owner dead (or superblock
                    or the holder of ``<NAME>.lock``                       unreadable) and no live lock
==================  =====================================================  ===========================

A live worker's files are never removed. Regions owned by another uid are
reported but left alone. Owners are judged by pid and start time, so ``--clean``
assumes the workers run in this pid namespace (or share the runtime directory,
whose locks are honoured across namespaces).
"""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shmrpc.schema.layout import DEFAULT_GEOMETRY
from shmrpc.schema.naming import REGION_PREFIX, runtime_dir

from .checks import (
    SOCKET_PATH_MAX,
    StartupError,
    check_memlock,
    check_memory,
    format_size_approx,
    has_ipc_lock,
    memlock_limit,
    memory_available_bytes,
    name_room,
)
from .lockfile import lock_is_held, read_lock_file, remove_stale_lock
from .procs import pid_alive
from .region import read_superblock, unlink_region
from .rundir import check_runtime_dir
from .shm import SHM_DIR, list_segments

__all__ = ["Finding", "scan", "doctor"]

_REGION_RE = re.compile(re.escape(REGION_PREFIX) + r"(?P<name>.+)\.(?P<index>\d+)\.[0-9a-f]{16}")


@dataclass
class Finding:
    """One thing ``doctor`` found.

    Attributes:
        kind: ``"region"``, ``"lock"`` or ``"socket"``.
        path: the POSIX shm name (regions) or the file path.
        worker: the worker name it belongs to (``""`` when it cannot be told).
        owner_pid: the owning pid, when known.
        alive: whether the owner is alive (or its lock is held).
        stale: whether it is safe to remove.
        detail: a short human note (size, why stale, why kept).
        removed: set by :func:`doctor` after removing it.
    """

    kind: str
    path: str
    worker: str
    owner_pid: int | None
    alive: bool
    stale: bool
    detail: str = ""
    removed: bool = False


def _worker_of_region(region: str) -> str:
    m = _REGION_RE.fullmatch(region.lstrip("/"))
    return m.group("name") if m else ""


def scan(shm_dir: str = SHM_DIR) -> list[Finding]:
    """Inventory shmrpc lock files, sockets and regions, with their owners and staleness.

    Returns:
        Findings, locks and sockets first, then regions, each group sorted by name.
    """
    findings: list[Finding] = []
    rdir = runtime_dir()
    held: dict[str, bool] = {}
    try:
        safe = check_runtime_dir(rdir) is None
    except FileNotFoundError:
        safe = False
    # only a runtime directory that is ours and private is looked into: one planted by another user (a directory of
    # theirs, or a symbolic link to any directory) would have --clean remove its *.sock, *.attach and *.lock files
    if safe:
        for lock in sorted(rdir.glob("*.lock")):
            worker = lock.name[: -len(".lock")]
            is_held = held[worker] = lock_is_held(lock)
            info = read_lock_file(lock) or {}
            pid = info.get("pid") if isinstance(info.get("pid"), int) else None
            ticks = info.get("start_ticks") if isinstance(info.get("start_ticks"), int) else None
            alive = is_held or (pid is not None and pid_alive(pid, ticks))
            detail = "lock held" if is_held else "lock free: the worker exited without cleaning up"
            findings.append(Finding("lock", str(lock), worker, pid, alive, not is_held, detail))
        for sock in sorted([*rdir.glob("*.sock"), *rdir.glob("*.attach")]):
            worker = sock.name.rsplit(".", 1)[0]
            is_held = held.get(worker, False)
            detail = "its worker holds the lock" if is_held else "no worker holds its lock"
            findings.append(Finding("socket", str(sock), worker, None, is_held, not is_held, detail))
    for region in list_segments(REGION_PREFIX, shm_dir):
        worker = _worker_of_region(region)
        lock_held = held.get(worker, False) if worker else False
        try:
            st = os.stat(shm_dir + region)
        except FileNotFoundError:
            continue  # unlinked while we looked
        size = format_size_approx(st.st_size)
        try:
            sb = read_superblock(region)
        except (OSError, ValueError) as exc:
            pid, owner_alive, why = None, False, f"superblock unreadable ({exc})"
        else:
            pid = sb.worker_pid
            owner_alive = pid_alive(sb.worker_pid, sb.worker_start_ticks)
            why = f"owner pid {pid} {'alive' if owner_alive else 'dead'}"
        alive = owner_alive or lock_held
        stale = not alive
        detail = f"{size}, {why}" + (", lock held" if lock_held else "")
        if stale and st.st_uid != os.geteuid():
            stale = False
            detail += f"; owned by uid {st.st_uid}, left alone (remove it as that user)"
        findings.append(Finding("region", region, worker, pid, alive, stale, detail))
    return findings


def _remove(f: Finding) -> bool:
    if f.kind == "region":
        return unlink_region(f.path)
    if f.kind == "lock":
        return remove_stale_lock(Path(f.path))  # False when a worker took it since we looked
    try:
        os.unlink(f.path)
    except FileNotFoundError:
        return False
    return True


def doctor(clean: bool = False, region_nbytes: int | None = None, out: Callable[[str], object] = print,
           shm_dir: str = SHM_DIR, what_for: str = "") -> int:
    """Report shmrpc leftovers and host limits; with ``clean``, remove the stale leftovers.

    Args:
        clean: remove stale regions, lock files and sockets (never a live worker's).
        region_nbytes: region size to check the available memory and RLIMIT_MEMLOCK against,
            as ``shmrpc serve`` does at start (default: the default geometry's); ``what_for`` says what they are
            in a refusal (serve's words: the pool with one client's own region, ``checks.WITH_FIRST_CLIENT``).
        out: where to write lines.
        shm_dir: the POSIX shared-memory directory, searched for regions left by older versions.

    Returns:
        0 when healthy, 1 when a problem remains (stale items not removed, a failed check,
        an unsafe runtime directory).

    Example:
        >>> code = doctor(clean=True)
    """
    nbytes = DEFAULT_GEOMETRY.region_nbytes if region_nbytes is None else region_nbytes
    problems = 0

    rdir = runtime_dir()
    try:
        unsafe = check_runtime_dir(rdir)
    except FileNotFoundError:
        out(f"runtime dir {rdir}: absent (created by the first worker)")
    else:
        if unsafe:
            problems += 1
            out(f"PROBLEM {unsafe} (its files are left alone)")
        else:
            out(f"runtime dir {rdir}: ok (0700, ours)")
    room = name_room(rdir)
    if room < 16:  # a worker whose sockets do not fit is refused at its start
        problems += 1
        out(f"PROBLEM runtime dir {rdir}: its path leaves {max(0, room)} bytes for a worker's name in a Unix "
            f"socket's path ({SOCKET_PATH_MAX} bytes at most): point SHMRPC_RUNTIME_DIR at a shorter directory")

    findings = scan(shm_dir)
    if not findings:
        out("no shmrpc regions, locks or sockets found")
    for f in findings:
        state = "STALE" if f.stale else ("live" if f.alive else "kept")
        line = f"{f.kind:<6} {f.path}  worker={f.worker or '?'}  {state}: {f.detail}"
        if f.stale and clean:
            f.removed = _remove(f)
            line += " -> removed" if f.removed else " -> gone or taken meanwhile"
            if not f.removed and f.kind == "lock":
                problems += 1
        elif f.stale:
            problems += 1
        out(line)
    n_stale = sum(f.stale and not f.removed for f in findings)
    if n_stale and not clean:
        out(f"{n_stale} stale item(s): run shmrpc doctor --clean to remove them")

    # serve's start checks (server/_loop.py), with the same functions: regions are memfds, charged to the host's
    # (or the container's) memory and never to /dev/shm, which no worker or client uses
    avail = memory_available_bytes()
    try:
        check_memory(nbytes, available_bytes=avail, what_for=what_for)
        if avail < 0:
            out(f"memory: MemAvailable unreadable, room for a {format_size_approx(nbytes)} region not checked")
        else:
            out(f"memory: {format_size_approx(avail)} available, room for a {format_size_approx(nbytes)} region: ok")
    except StartupError as exc:
        problems += 1
        out(f"PROBLEM {exc}")
    try:
        check_memlock(nbytes, what_for=what_for)
        lim = memlock_limit()
        why = "CAP_IPC_LOCK" if has_ipc_lock() else ("unlimited" if lim == resource.RLIM_INFINITY else format_size_approx(lim))
        out(f"RLIMIT_MEMLOCK: {why}: ok")
    except StartupError as exc:
        problems += 1
        out(f"PROBLEM {exc}")

    out("healthy" if not problems else f"{problems} problem(s)")
    return 0 if not problems else 1
