"""LoopPoll, the worker loop's wait: the ZeroMQ socket through its fd, asked for its events only after it was used."""

from __future__ import annotations

import os
import secrets
import select
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from shmrpc.schema import lane as L
from shmrpc.server._lanes import Lanes
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


def _ring_without_doorbell(lane: Any) -> None:
    """What a client that skipped the doorbell leaves: a new call_seq in its page, nothing on the eventfd."""
    L.post(lane.page, lane._call_seq, L.CALL_SEQ, lane.seen + 1, b"x" * 16)


@pytest.fixture
def lanes() -> Iterator[Lanes]:
    ls = Lanes(spin_ns=1)
    try:
        yield ls
    finally:
        ls.close()


def test_a_wait_never_sleeps_past_the_time_the_lanes_were_told(pair: tuple[Any, Any], lanes: Lanes) -> None:
    # an answer said the worker polls the lanes until awake_until_ns: a client that rings before it may skip the
    # doorbell, so a long wait is cut short just after that time, and then every lane is read before sleeping
    router, _ = pair
    p = LoopPoll(router)
    p.watch_lanes(lanes)
    lane = lanes.open(b"client-1")
    assert p.poll(0) == {}
    lanes.awake_until_ns = time.monotonic_ns() + 30_000_000
    _ring_without_doorbell(lane)
    t0 = time.monotonic()
    assert p.poll(_LONG_MS) == {}  # woken just after the promised time, by the cut timeout
    assert 0.025 < time.monotonic() - t0 < 1.0
    events = p.poll(_LONG_MS)  # past it: the lanes are read, and the rung one is reported without sleeping
    assert events == {lanes.doorbell_fd: select.POLLIN} and time.monotonic() - t0 < 1.0
    assert lanes.awake_until_ns == 0
    assert [(seq, frame) for _, seq, frame in lanes.scan()] == [(1, b"x" * 16)]


def test_a_promise_kept_leaves_a_wait_of_its_own_length(pair: tuple[Any, Any], lanes: Lanes) -> None:
    router, _ = pair
    p = LoopPoll(router)
    p.watch_lanes(lanes)
    lanes.open(b"client-1")
    lanes.awake_until_ns = time.monotonic_ns() - 1  # past, nothing rung: the lanes are read once, then it sleeps
    t0 = time.monotonic()
    assert p.poll(200) == {}
    assert time.monotonic() - t0 >= 0.19 and lanes.awake_until_ns == 0


def test_an_answer_wakes_a_client_unless_its_awake_word_says_it_polls(lanes: Lanes) -> None:
    lane = lanes.open(b"client-1")
    try:
        client_awake = L.seq_word(lane._map, L.CLIENT_AWAKE)
        client_awake.value = time.monotonic_ns() + 10_000_000_000  # polling for 10 s more
        lanes.answer(lane, b"d" * 14, 1)
        with pytest.raises(BlockingIOError):
            os.eventfd_read(lane.client_fd)  # no write
        client_awake.value = time.monotonic_ns() + L.AWAKE_MARGIN_NS // 2  # within the margin: woken
        lanes.answer(lane, b"d" * 14, 2)
        client_awake.value = 0
        lanes.answer(lane, b"d" * 14, 3)
        assert os.eventfd_read(lane.client_fd) == 2
        # the worker's own word: until when it polls (spin_ns after the answer), kept as the lanes' latest
        assert L.seq_word(lane._map, L.WORKER_AWAKE).value == lanes.awake_until_ns > 0
        del client_awake
    finally:
        lanes.drop(b"client-1")
