"""ACQUIREs waiting for a slot: one FIFO queue per size class, a deadline heap, a bound per client.

A waiter sits in the queue of the smallest class its ``nbytes`` fits. When slots free, the
worker offers them queue by queue (largest class first), head first; a queue whose head
cannot be served is left until the next free. The loop's cost per pass is therefore the
number of classes, not the number of waiters, and the next deadline is the heap's top::

    queues[c]  deque: w1 -> w2 -> ...      (FIFO, served head first)
    heap       (deadline, seq, waiter)     (expiry; entries of served waiters are skipped,
                                            the heap is rebuilt when they outnumber the live)
    per client count <= client_max_waiters (over it: BusyError at once, nothing queued)
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shmrpc.schema.errors import BusyError

__all__ = ["Waiter", "Waiters"]


@dataclass(eq=False)
class Waiter:
    """An ACQUIRE waiting for a slot to free."""

    client: int
    identity: bytes
    nbytes: int
    deadline: float
    cls: int = 0
    live: bool = True
    #: The ACQUIRE's ``id``, echoed in its GRANT or ERROR.
    request_id: int | None = None


class Waiters:
    """The waiting ACQUIREs of all clients.

    Args:
        sizes: slot bytes of each size class, smallest first.
        per_client: most waiters one client may have at once (0: none may wait).
    """

    def __init__(self, sizes: list[int], per_client: int) -> None:
        self._sizes = sizes
        self._per_client = per_client
        self._queues: list[deque[Waiter]] = [deque() for _ in sizes]
        self._heap: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()
        self._count: Counter[int] = Counter()

    def __len__(self) -> int:
        return sum(self._count.values())

    def add(self, client: int, identity: bytes, nbytes: int, deadline: float,
            request_id: int | None = None) -> Waiter:
        """Queue an ACQUIRE of ``nbytes`` (which fits the largest class).

        Raises:
            BusyError: the client already has ``per_client`` ACQUIREs waiting.
        """
        if self._count[client] >= self._per_client:
            raise BusyError(f"this client already has {self._count[client]} ACQUIREs waiting, the most one may "
                            "(--client-max-waiters); wait for one to be answered", field="nbytes")
        w = Waiter(client, identity, nbytes, deadline, bisect.bisect_left(self._sizes, nbytes),
                   request_id=request_id)
        self._queues[w.cls].append(w)
        heapq.heappush(self._heap, (deadline, next(self._seq), w))
        self._count[client] += 1
        return w

    def _drop(self, w: Waiter, from_queue: bool = True) -> None:
        w.live = False
        if from_queue:
            self._queues[w.cls].remove(w)  # bounded: at most per_client x clients waiters are live
        self._count[w.client] -= 1
        if self._count[w.client] <= 0:
            del self._count[w.client]
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self):
            self._heap = [e for e in self._heap if e[2].live]
            heapq.heapify(self._heap)

    def cancel(self, client: int) -> None:
        """Forget every waiter of ``client`` (its lease ended)."""
        if client not in self._count:
            return
        for q in self._queues:
            for w in [w for w in q if w.client == client]:
                self._drop(w)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a live waiter, or None."""
        while self._heap and not self._heap[0][2].live:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None

    def expired(self, now: float) -> Iterator[Waiter]:
        """Remove and yield the waiters whose deadline has passed."""
        while self._heap and self._heap[0][0] <= now:
            _, _, w = heapq.heappop(self._heap)
            if w.live:
                self._drop(w)
                yield w

    def serve(self, grant: Callable[[Waiter], bool]) -> None:
        """Offer free slots to the queue heads, largest class first.

        ``grant(w)`` returns True when ``w`` got a slot (or was answered otherwise and must leave
        the queue), False when no slot fits it now (the queue then waits for the next free).
        """
        for q in reversed(self._queues):
            while q:
                w = q[0]
                if not grant(w):
                    break
                q.popleft()
                self._drop(w, from_queue=False)
