"""The ``/dev/shm`` side: listing POSIX shm segments by name prefix and who owns them."""

from __future__ import annotations

import os

__all__ = ["SHM_DIR", "list_segments", "owned_by_us"]

SHM_DIR = "/dev/shm"


def list_segments(prefix: str = "shmrpc.", shm_dir: str = SHM_DIR) -> list[str]:
    """POSIX shm names (with the leading ``/``) of the ``shm_dir`` entries starting with ``prefix``, sorted.

    Example:
        >>> list_segments("shmrpc.myworker.")
        []
    """
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    return sorted("/" + e for e in entries if e.startswith(prefix))


def owned_by_us(region: str) -> bool:
    """Whether the /dev/shm entry of ``region`` belongs to our euid."""
    try:
        return os.stat(SHM_DIR + region).st_uid == os.geteuid()
    except OSError:
        return False
