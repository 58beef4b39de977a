"""The client's pump on a real DEALER socket: what a wake-up receives, and that nothing queued is left behind.

A lone waiter woken by the socket's fd takes the first frame without asking ``zmq.EVENTS`` first
(``Connection._recv_woken``); the rest waits for the next ``drain``, which asks before any wait.
The connection here is built around a DEALER/ROUTER pair of the test's own (no worker)."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from shmrpc.client._connection import Connection


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Connection, zmq.Socket, bytes]]:  # type: ignore[type-arg]
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    addr = f"ipc://{tmp_path / 'pump.sock'}"
    router.bind(addr)
    dealer.setsockopt(zmq.ROUTING_ID, b"me")
    dealer.connect(addr)
    c = Connection.__new__(Connection)
    c.name, c.spin_s, c.gone, c.closed, c.pidfd = "t", 0.0, None, False, None
    c.sock, c.lock, c.sleepers, c.watched = dealer, threading.RLock(), 0, False
    c._fd = int(dealer.getsockopt(zmq.FD))
    c._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    c._ospoll = select.poll()
    c._ospoll.register(c._fd, select.POLLIN)
    c._ospoll.register(c._wake_fd, select.POLLIN)
    dealer.send(b"hello")  # the ROUTER learns the peer
    assert router.recv_multipart() == [b"me", b"hello"]
    try:
        yield c, router, b"me"
    finally:
        os.close(c._wake_fd)
        router.close(0)
        dealer.close(0)
        ctx.term()


def _drain_until(c: Connection, want: int) -> list[list[bytes]]:
    calls: list[list[bytes]] = []
    got: list[bytes] = []
    while len(got) < want and len(calls) < 50:
        batch = c.drain(2.0, lambda frames: list(frames))
        calls.append(batch)
        got.extend(batch)
    return calls


def test_a_woken_waiter_takes_one_frame_and_the_next_drain_takes_the_rest(pair) -> None:  # type: ignore[no-untyped-def]
    c, router, peer = pair
    woke: list[list[bytes]] = []
    t = threading.Thread(target=lambda: woke.extend(_drain_until(c, 3)))
    t.start()
    while c.sleepers == 0:  # the waiter is asleep on the fd: what is sent now wakes it
        pass
    for i in range(3):
        router.send_multipart([peer, b"done %d" % i])
    t.join(10)
    assert not t.is_alive()
    assert [f for batch in woke for f in batch] == [b"done 0", b"done 1", b"done 2"]  # each once, in order
    assert woke[0] in ([b"done 0"], [b"done 0", b"done 1", b"done 2"], [b"done 0", b"done 1"])


def _queue(c: Connection, router: zmq.Socket, peer: bytes, frames: list[bytes]) -> None:  # type: ignore[type-arg]
    for f in frames:
        router.send_multipart([peer, f])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # until all of them are in the DEALER's pipe (ipc delivers in order)
        with c.lock:
            if c.sock.poll(0) and c.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                time.sleep(0.05)
                return
        time.sleep(0.01)
    raise AssertionError("the frames never arrived")


def test_a_lone_waiter_takes_one_frame_and_leaves_the_rest_for_the_next_drain(pair) -> None:  # type: ignore[no-untyped-def]
    c, router, peer = pair
    _queue(c, router, peer, [b"a", b"b", b"c"])
    assert c._recv_woken() == [b"a"]
    assert c.drain(0.01, lambda frames: list(frames)) == [b"b", b"c"]  # asked before any wait: not left behind


@pytest.mark.parametrize("flag", ["sleepers", "watched"])
def test_with_another_sleeper_or_a_watcher_a_wake_up_takes_everything_queued(pair, flag: str) -> None:  # type: ignore[no-untyped-def]
    # another thread asleep on the fd, or an event loop watching it, may need the frames: none is left behind
    c, router, peer = pair
    _queue(c, router, peer, [b"a", b"b", b"c"])
    setattr(c, flag, 1)
    assert c._recv_woken() == [b"a", b"b", b"c"]


def test_a_spurious_wake_up_receives_nothing_and_raises_nothing(pair) -> None:  # type: ignore[no-untyped-def]
    c, _, _ = pair
    assert c._recv_woken() == []
    assert c.drain(0.01, lambda frames: frames) == []
