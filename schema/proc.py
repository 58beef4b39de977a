"""The process identity both sides read from ``/proc``: HELLO's ``start_ticks`` is field 22 of ``/proc/<pid>/stat``."""

from __future__ import annotations

__all__ = ["read_stat", "process_start_ticks"]


def read_stat(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after the command name), or None when there is no such process."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and ')'; everything after the last ')' is plain.
    return data.rpartition(b")")[2].decode("ascii", "replace").split()


def process_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of ``/proc/<pid>/stat``), or None if no such process.

    Example:
        >>> import os
        >>> process_start_ticks(os.getpid()) > 0
        True
    """
    fields = read_stat(pid)
    if not fields or len(fields) < 20:
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None
