"""The client's slot pool: free slots (own and borrowed), parked ones, and the two moves between them.

::

    free ──take_free──▶ in use (a Loan; in flight or not) ──release──▶ free, or RELEASE to the worker (borrowed)
      ▲                                                        │
      └── unpark: no view left and no request in flight ◀── parked (views alive, or still in flight)

Loans, futures, the sync and the async clients use it through :meth:`SlotPool.take_free`,
:meth:`SlotPool.adopt` and :meth:`SlotPool.release`; it holds its own lock, and never waits.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable

from shmrpc.schema import messages as m

from ._region import AttachedRegion
from ._slot import _open, _Slot, _try_release

__all__ = ["SlotPool"]


def _by_nbytes(s: _Slot) -> int:
    return s.nbytes


class SlotPool:
    """Free and parked slots of one client; borrowed slots go back with RELEASE through ``send``."""

    def __init__(self, regions: dict[int, AttachedRegion], leased: list[_Slot], send: Callable[[bytes], None],
                 linger_s: float) -> None:
        self.lock = threading.RLock()
        self._regions, self._send, self.linger_s = regions, send, linger_s
        self._free: list[_Slot] = sorted(leased, key=_by_nbytes)
        self._n_borrowed_free = 0  # borrowed slots kept in _free (linger_s): none, so nothing to give back
        self._parked: list[_Slot] = []
        self.closed = False

    def __len__(self) -> int:
        return len(self._free)

    @property
    def maybe_free(self) -> bool:
        """Whether a slot may be free or come free at the next take (a hint, read without the lock)."""
        return bool(self._free or self._parked)

    @property
    def free(self) -> list[_Slot]:
        """The free slots, smallest first (a snapshot, for tests and status)."""
        with self.lock:
            return list(self._free)

    def take_free(self, nbytes: int) -> _Slot | None:
        """A free slot of at least ``nbytes``, opened for use, or None (never waits)."""
        with self.lock:
            self._unpark()
            self._return_idle_borrowed()
            free = self._free
            for i in range(bisect.bisect_left(free, nbytes, key=_by_nbytes), len(free)):
                s = free[i]
                if s.nbytes >= nbytes:
                    del free[i]
                    if s.borrowed:
                        self._n_borrowed_free -= 1
                    _open(s, self._regions[s.region])
                    return s
            return None

    def adopt(self, s: _Slot) -> _Slot:
        """Open a slot the worker just granted (borrowed) for use."""
        with self.lock:
            _open(s, self._regions[s.region])
        return s

    def release(self, s: _Slot) -> None:
        """End one use of a slot: free it now, or park it while views are alive or a request is in flight."""
        with self.lock:
            if s.in_flight is None and _try_release(s):
                self._give_back(s)
            else:
                s.parked = True
                self._parked.append(s)

    def unpark(self) -> None:
        """Give back the parked slots that may go now (a parked slot's request was answered: a borrowed slot is
        not held from the worker's pool until this client's next take)."""
        with self.lock:
            self._unpark()

    def _unpark(self) -> None:
        if not self._parked:
            return
        for s in list(self._parked):
            if s.in_flight is None and _try_release(s):
                s.parked = False
                self._parked.remove(s)
                self._give_back(s)

    def _give_back(self, s: _Slot) -> None:
        s.idle_since = time.monotonic()
        if s.borrowed and self.linger_s <= 0 and not self.closed:
            self._send(m.SLOT_STRUCT.pack(m.RELEASE, s.region, s.index))
            return
        bisect.insort(self._free, s, key=_by_nbytes)  # smallest first; O(log n) with a lease of hundreds
        if s.borrowed:
            self._n_borrowed_free += 1

    def _return_idle_borrowed(self) -> None:
        if not self._n_borrowed_free:
            return
        now = time.monotonic()
        for s in [s for s in self._free if s.borrowed and now - s.idle_since > self.linger_s]:
            self._free.remove(s)
            self._n_borrowed_free -= 1
            self._send(m.SLOT_STRUCT.pack(m.RELEASE, s.region, s.index))
