"""ACQUIRE waiters: FIFO per size class, bounded per client, deadlines from a heap, no rescans."""

from __future__ import annotations

import pytest

from shmrpc.schema.errors import BusyError
from shmrpc.server._waiters import Waiter, Waiters

SIZES = [64 << 10, 1 << 20, 16 << 20]


def test_fifo_per_class_largest_class_first() -> None:
    ws = Waiters(SIZES, per_client=4)
    a = ws.add(1, b"a", 100, 10.0)
    b = ws.add(2, b"b", 2 << 20, 10.0)
    c = ws.add(1, b"c", 200, 10.0)
    assert (a.cls, b.cls, c.cls) == (0, 2, 0)
    served: list[Waiter] = []
    ws.serve(lambda w: served.append(w) is None)
    assert served == [b, a, c] and len(ws) == 0


def test_a_queue_whose_head_cannot_be_served_waits() -> None:
    ws = Waiters(SIZES, per_client=4)
    a = ws.add(1, b"a", 100, 10.0)
    ws.add(1, b"b", 100, 10.0)
    tried: list[Waiter] = []
    ws.serve(lambda w: tried.append(w) and False)
    assert tried == [a] and len(ws) == 2


def test_bound_per_client() -> None:
    ws = Waiters(SIZES, per_client=2)
    ws.add(1, b"a", 1, 10.0)
    ws.add(1, b"a", 1, 10.0)
    with pytest.raises(BusyError) as e:
        ws.add(1, b"a", 1, 10.0)
    assert e.value.field == "nbytes" and "--client-max-waiters" in e.value.message
    ws.add(2, b"b", 1, 10.0)  # another client is not affected
    ws.cancel(1)
    assert len(ws) == 1
    ws.add(1, b"a", 1, 10.0)


def test_deadlines() -> None:
    ws = Waiters(SIZES, per_client=8)
    late = ws.add(1, b"a", 1, 30.0)
    early = ws.add(2, b"b", 1, 10.0)
    assert ws.next_deadline() == 10.0
    assert list(ws.expired(20.0)) == [early]
    assert ws.next_deadline() == 30.0
    ws.serve(lambda w: True)
    assert ws.next_deadline() is None and list(ws.expired(99.0)) == [] and late.live is False


def test_served_entries_do_not_pile_up_in_the_heap() -> None:
    ws = Waiters(SIZES, per_client=1)
    for i in range(10_000):
        ws.add(1, b"a", 1, 3600.0 + i)
        ws.serve(lambda w: True)
    assert len(ws._heap) <= 130
