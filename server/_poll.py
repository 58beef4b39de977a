"""The loop's wait: one epoll set over every fd the worker watches, the ZeroMQ socket through its fd.

``zmq.Poller`` rebuilds libzmq's poll items from Python on every call and asks the socket for its
events before and after the system call; on the lanes' path (no ZeroMQ traffic at all) that was
about 2 µs of every wake-up. Here a wake-up is one ``epoll_wait``, level-triggered for every fd
the loop reads or accepts from (the lanes' doorbell is read back before the scan: an edge-triggered
doorbell read after it would lose a ring that came in between, as epoll checks the fd again before
it reports an edge).

The ZeroMQ socket's fd (``zmq.FD``) is not a readiness flag: it turns readable when the socket's
state may have changed, and a send or a receive on the socket may consume that signal. So after the
socket was used (:attr:`LoopPoll.used`, set by the worker's send and receive), the next wait first
asks the socket itself (``zmq.EVENTS``): a message already queued makes the wait a poll(0), and a
message queued later makes the fd readable. A wait after a turn that did not touch the socket (a
lane's request) skips that question: it costs 1.5 µs of the loop's tail, and the tail is part of
the next request's round trip where the client is woken on the worker's core.
"""

from __future__ import annotations

import select
from typing import Any

import zmq

__all__ = ["LoopPoll"]

_ZMQ_SOCKET: Any = zmq.Socket.__mro__[1]  # zmq.backend's Socket: its get takes a plain int
_RAW_GET = _ZMQ_SOCKET.get
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_EPOLLIN = select.EPOLLIN


class LoopPoll:
    """What the worker's loop waits on: its ZeroMQ socket and file descriptors. :meth:`poll` answers
    ``{sock: POLLIN, fd: mask, ...}`` like ``dict(zmq.Poller().poll(ms))`` did."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._sock = sock
        self._zfd = int(sock.getsockopt(zmq.FD))
        self._ep = select.epoll()
        self._ep.register(self._zfd, _EPOLLIN)
        self.used = True  # the socket was sent or received on since it was last asked for its events

    def register(self, fd: int) -> None:
        """Watch ``fd`` for input (level-triggered)."""
        self._ep.register(fd, _EPOLLIN)

    def unregister(self, fd: int) -> None:
        try:
            self._ep.unregister(fd)
        except (OSError, ValueError):  # a closed fd leaves the set by itself
            pass

    def poll(self, timeout_ms: int) -> dict[Any, int]:
        """The fds with input (and the socket, under its own key, when it may have a message), waiting up to
        ``timeout_ms`` (0: not at all) for the first."""
        sock = self._sock
        queued = 0
        if self.used:
            self.used = False
            queued = _RAW_GET(sock, _EVENTS) & _POLLIN
        got = self._ep.poll(0 if queued else timeout_ms / 1000)
        events: dict[Any, int] = dict(got) if got else {}
        if events.pop(self._zfd, 0) or queued:  # the reader asks the socket again before it receives
            events[sock] = _POLLIN
        return events

    def close(self) -> None:
        self._ep.close()
