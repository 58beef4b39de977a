"""LoopPoll, the worker loop's wait: the ZeroMQ socket through its fd, asked for its events only after it was used."""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from shmrpc.server._poll import LoopPoll

_LONG_MS = 5000  # a wait that would end only by its timeout if a message were missed


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any]]:
    ctx = zmq.Context()
    addr = f"inproc://poll-{secrets.token_hex(4)}"
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(addr)
    dealer.connect(addr)
    try:
        yield router, dealer
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()


def _queued(router: Any) -> None:
    """Wait until the router holds a message, asking it for its events: that takes its fd's signal, as a send or a
    receive of the worker's own does."""
    end = time.monotonic() + 5
    while not router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        assert time.monotonic() < end, "the message never arrived"
        time.sleep(0.001)


def test_a_message_whose_signal_a_use_of_the_socket_took_is_reported_at_once(pair: tuple[Any, Any]) -> None:
    router, dealer = pair
    p = LoopPoll(router)
    dealer.send(b"call")
    _queued(router)
    p.used = True  # the worker sent or received since it last asked
    t0 = time.monotonic()
    events = p.poll(_LONG_MS)
    assert router in events and time.monotonic() - t0 < _LONG_MS / 2000
    assert router.recv_multipart()[1] == b"call"


def test_a_message_that_comes_while_the_loop_waits_wakes_it_through_the_fd(pair: tuple[Any, Any]) -> None:
    router, dealer = pair
    p = LoopPoll(router)
    assert p.poll(0) == {} and not p.used  # asked once; a turn that does not use the socket asks no more
    sender = threading.Timer(0.05, dealer.send, (b"later",))
    sender.start()
    try:
        t0 = time.monotonic()
        events = p.poll(_LONG_MS)
        assert router in events and time.monotonic() - t0 < _LONG_MS / 2000
    finally:
        sender.join()
    assert router.recv_multipart()[1] == b"later"


def test_other_fds_are_reported_under_their_number_and_unregistered_ones_are_not(pair: tuple[Any, Any]) -> None:
    router, _ = pair
    p = LoopPoll(router)
    a, b = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)
    try:
        p.register(a)
        p.register(b)
        os.eventfd_write(a, 1)
        os.eventfd_write(b, 1)
        assert set(p.poll(0)) == {a, b}
        p.unregister(b)
        p.unregister(b)  # twice: harmless (a closed client's pidfd may already be gone)
        assert set(p.poll(0)) == {a}
    finally:
        os.close(a)
        os.close(b)
