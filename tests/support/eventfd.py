"""Reading an eventfd's counter in tests of the lanes."""

from __future__ import annotations

import os

__all__ = ["writes"]


def writes(fd: int) -> int:
    """How many eventfd writes ``fd`` (non-blocking) got since it was last read, and reset it."""
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0
