"""A slot as the client sees it, and the two operations that start and end one use of it."""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from shmrpc.schema.descriptor import ResponseDesc, decode_response
from shmrpc.schema.header import Flag
from shmrpc.schema.messages import NO_RESPONSE

from ._caches import CACHE_ENTRIES
from ._region import AttachedRegion

__all__ = ["Resident", "NO_RESPONSE", "forked_since"]

_FORKS = [0]  # bumped in every child right after fork(): cheaper than a getpid() syscall per call


def _after_fork_in_child() -> None:
    _FORKS[0] += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked_since(generation: int) -> bool:
    """True in a process forked after :func:`fork_generation` returned ``generation``."""
    return _FORKS[0] != generation


def fork_generation() -> int:
    """The current fork generation of this process (see :func:`forked_since`)."""
    return _FORKS[0]

_IN_PLACE = int(Flag.IN_PLACE)
_KEEP = int(Flag.KEEP)
_GUESS = int(Flag.GUESS)
_RESPONSE = int(Flag.RESPONSE)


@dataclass(frozen=True)
class Resident:
    """A reference to the worker's resident tensor ``name``, passed in place of an array.

    Example: ``client.call("vector_add", x=a, y=Resident("bias"))``.
    """

    name: str


@dataclass(eq=False)
class _Slot:
    region: int
    index: int
    nbytes: int
    generation: int
    borrowed: bool
    mv: memoryview | None = None
    buf: Any = None  # ctypes array over mv: the base of every NumPy view of this use
    in_flight: int | None = None  # request_id
    status: int | None = None  # DONE status once it came
    idle_since: float = 0.0
    parked: bool = False  # released while its request was in flight or views of it lived (SlotPool._parked)


@lru_cache(maxsize=CACHE_ENTRIES)
def _decode(payload: bytes) -> ResponseDesc:
    return decode_response(payload)


def _open(s: _Slot, region: AttachedRegion) -> None:
    """Start one use of a slot: a fresh memoryview and the ctypes buffer every NumPy view is built on."""
    s.mv = region.slot(s.index)
    s.buf = (ctypes.c_char * s.nbytes).from_buffer(s.mv)


def _try_release(s: _Slot) -> bool:
    """End one use of a slot; False while NumPy views of it are alive.

    NumPy keeps no buffer export on what an array was built from, only a reference (through
    the memoryview it makes of it), so the ctypes buffer's reference count says whether views live.
    """
    if s.mv is None:
        return True
    if sys.getrefcount(s.buf) > 2:  # s.buf itself + the argument of getrefcount
        return False
    s.buf = None
    s.mv.release()
    s.mv = None
    return True

