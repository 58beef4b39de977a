"""Whether a process is alive, and the same one: ``(pid, start_ticks)`` from ``/proc`` (``schema.proc``)."""

from __future__ import annotations

import os
import resource

from shmrpc.schema.proc import process_start_ticks, read_stat

__all__ = ["pid_alive", "process_start_ticks", "fds_open_and_limit"]


def fds_open_and_limit() -> tuple[int, int | None]:
    """(file descriptors this process has open, its soft RLIMIT_NOFILE or None for no limit). With none left to list
    ``/proc/self/fd`` (EMFILE), the limit counts as reached."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limit = None if soft == resource.RLIM_INFINITY else int(soft)
    try:
        n = len(os.listdir("/proc/self/fd"))
    except OSError:
        n = limit if limit is not None else 0
    return n, limit


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """Whether ``pid`` is a live process and, if ``start_ticks`` is given, the same one that started then.

    Zombies count as dead. Without ``/proc`` this falls back to ``kill(pid, 0)``
    and cannot tell a reused pid apart.
    """
    if pid <= 0:
        return False
    if not os.path.exists("/proc/self/stat"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = read_stat(pid)
    if not fields or len(fields) < 20:
        return False
    if fields[0] in ("Z", "X"):
        return False
    if start_ticks is None:
        return True
    try:
        return int(fields[19]) == start_ticks
    except ValueError:
        return False
