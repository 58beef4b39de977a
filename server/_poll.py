"""The loop's wait: one ``select.poll`` set over every fd the worker watches, the ZeroMQ socket through its fd.

``zmq.Poller`` rebuilds libzmq's poll items from Python on every call and asks the socket for its
events before and after the system call; on the lanes' path (no ZeroMQ traffic at all) that was
part of every wake-up. Here a wake-up is one ``poll(2)`` over an fd array built once. (An epoll set
woke slower on the GPU host: 15.5 against 13.8 µs for a round trip of two wake-ups in
``bench/gpu/floor_probe.py``, and a blocking lane's 64 B round trip 4-5 µs longer; docs/benchmarks.md.)

The ZeroMQ socket's fd (``zmq.FD``) is not a readiness flag: it turns readable when the socket's
state may have changed, and a send or a receive on the socket may consume that signal. So after the
socket was used (:attr:`LoopPoll.used`, set by the worker's send and receive), the next wait first
asks the socket itself (``zmq.EVENTS``): a message already queued makes the wait a poll(0), and a
message queued later makes the fd readable. A wait after a turn that did not touch the socket (a
lane's request) skips that question: it costs 1.5 µs of the loop's tail, and the tail is part of
the next request's round trip where the client is woken on the worker's core.

With lanes whose answers said the worker polls them until some time (the awake words,
schema/lane.py), a wait never sleeps past that time without reading every lane after it: a
client that rang within the time may have skipped the doorbell.
"""

from __future__ import annotations

import select
import time
from typing import TYPE_CHECKING, Any

import zmq

# the loop calls libzmq through pyzmq's Cython socket with plain ints (here and in ._calls; schema.zmqraw says why)
from shmrpc.schema.zmqraw import EVENTS, POLLIN, RAW_GET

if TYPE_CHECKING:
    from ._lanes import Lanes

__all__ = ["LoopPoll"]



class LoopPoll:
    """What the worker's loop waits on: its ZeroMQ socket and file descriptors. :meth:`poll` answers
    ``{sock: POLLIN, fd: mask, ...}`` like ``dict(zmq.Poller().poll(ms))`` did."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        self._zfd = int(sock.getsockopt(zmq.FD))
        self._fds = select.poll()
        self._fds.register(self._zfd, select.POLLIN)
        self.used = True  # the socket was sent or received on since it was last asked for its events
        self._lanes: Lanes | None = None

    def watch_lanes(self, lanes: Lanes) -> None:
        """Wait on the lanes' doorbell, and keep the promise of their awake words (see the module's text)."""
        self._lanes = lanes
        self.register(lanes.doorbell_fd)

    def register(self, fd: int) -> None:
        """Watch ``fd`` for input."""
        self._fds.register(fd, select.POLLIN)

    def unregister(self, fd: int) -> None:
        try:
            self._fds.unregister(fd)
        except KeyError:
            pass

    def poll(self, timeout_ms: int) -> dict[Any, int]:
        """The fds with input (and the socket, under its own key, when it may have a message), waiting up to
        ``timeout_ms`` (0: not at all) for the first."""
        sock = self._sock
        queued = 0
        if self.used:
            self.used = False
            queued = RAW_GET(sock, EVENTS) & POLLIN
        lanes = self._lanes
        found = False
        if timeout_ms and lanes is not None and lanes.awake_until_ns:  # (ready() reads after the clock: in order)
            left_ns = lanes.awake_until_ns - time.monotonic_ns()
            if left_ns > 0:  # a sleep would pass the time the lanes were told: wake just after it instead
                cap_ms = left_ns // 1_000_000 + 1
                timeout_ms = cap_ms if timeout_ms < 0 else min(timeout_ms, cap_ms)
            else:  # past it: every lane read once more before sleeping (a client may have rung without the doorbell)
                lanes.awake_until_ns = 0
                found = lanes.ready()
        got = self._fds.poll(0 if queued or found else timeout_ms)
        events: dict[Any, int] = dict(got) if got else {}
        if found and lanes is not None:
            events[lanes.doorbell_fd] = select.POLLIN
        if events.pop(self._zfd, 0) or queued:  # the reader asks the socket again before it receives
            events[sock] = POLLIN
        return events
