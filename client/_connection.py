"""The client's ZeroMQ side: DEALER socket, handshake, and a pump that routes replies.

The handshake (verifying the worker, HELLO, WELCOME with the regions' fds) is
:mod:`._attach`'s; this module then connects the DEALER with the session token as
its routing id. A DEALER receives replies interleaved: DONE for requests in flight
(matched by request_id), and the JSON control replies (GRANT, MANAGED, ERROR, STATE),
which the client matches by the ``id`` of the ACQUIRE or MANAGE they answer. The pump also watches the worker's
pidfd, so a worker that dies fails every waiter at once instead of after its
timeout.

ZeroMQ sockets are not thread-safe: every send and receive happens under
:attr:`Connection.lock`. Waiting is done outside it, on the socket's file
descriptor (``zmq.FD``) with ``select.poll``, so one thread can wait for answers
while others send. That descriptor only says "look at ``zmq.EVENTS``", and any
operation on the socket may consume its signal; so a send that finds a frame
queued wakes the waiter through an eventfd (:meth:`Connection.wake`), and no wait
lasts longer than :data:`_MAX_WAIT_MS`.
"""

from __future__ import annotations

import os
import select
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq

from shmrpc.schema import messages as m
from shmrpc.schema.control import ErrorReply
from shmrpc.schema.errors import (
    ClientClosedError,
    RequestError,
    WorkerGoneError,
    from_wire,
)
from shmrpc.schema.naming import endpoint
from shmrpc.schema.proc import process_start_ticks
from shmrpc.schema.zmqraw import EVENTS, NOBLOCK, POLLIN, RAW_GET, RAW_RECV, RAW_SEND

from ._attach import handshake
from ._lane import ClientLane

__all__ = ["Connection"]

_MAX_WAIT_MS = 100  # the longest sleep on the fd: a lost edge costs at most this, never a hang


def _drop_socket(sock: zmq.Socket[Any], ctx: zmq.Context[Any], pid: int, fds: tuple[int, ...]) -> None:
    """Close the socket, then its context, and its own fds, of a Connection collected unclosed (in the process that
    made them).

    Left to themselves, a collected Connection's context could go first: pyzmq's ``Context.__del__`` then
    finds no socket to close (the garbage collector has cleared its weak references) and ``term()`` waits for
    the still open socket forever, hanging the thread that collected it."""
    if os.getpid() != pid:  # a forked child's copy: the parent's sockets are not this process's to close
        return
    if not sock.closed:
        sock.close(linger=0)
    ctx.term()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass



class Connection:
    """The verified handshake with worker ``name``, then one DEALER connection under the session's token."""

    def __init__(self, name: str, connect_timeout_s: float, spin_us: int = 0, worker_uid: int | None = None,
                 lease: tuple[int, ...] | None = None, lane: str | None = None, lane_spin_us: int = 0) -> None:
        self.name = name
        self.spin_s = spin_us / 1e6
        deadline = time.monotonic() + connect_timeout_s
        hs = handshake(name, deadline, worker_uid, lease, lane is not None)
        self.welcome: dict[str, Any] = hs.welcome
        self.fds: list[int] = hs.fds  # the regions' fds, in WELCOME order; AttachedRegion closes each
        self.lane: ClientLane | None = None
        if lane is not None and self.welcome.get("lane") is True:  # the last three fds (schema/lane.py)
            page_fd, doorbell_fd, own_fd = self.fds[-3:]
            self.fds = self.fds[:-3]
            try:
                self.lane = ClientLane(page_fd, doorbell_fd, own_fd, hs.worker_uid, lane_spin_us / 1e6)
            except BaseException:
                for fd in (doorbell_fd, own_fd, *self.fds):
                    os.close(fd)
                self.fds = []
                raise
        self.worker_pid = hs.worker_pid
        self.worker_uid = hs.worker_uid
        self.pidfd: int | None = None
        self.gone: str | None = None
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # The worker acts only for routing ids it issued: nobody else's frames can speak in this session's name.
        self.sock.setsockopt(zmq.ROUTING_ID, str(self.welcome["token"]).encode())
        self.lock = threading.RLock()
        self.closed = False
        self.sleepers = 0  # threads in poll() on the fd now (a hint: a missed wake-up costs _MAX_WAIT_MS)
        self.watched = False  # an event loop watches the fd (AsyncClient): always wake it
        self._fd = int(self.sock.getsockopt(zmq.FD))
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._ospoll = select.poll()
        self._ospoll.register(self._fd, select.POLLIN)
        self._ospoll.register(self._wake_fd, select.POLLIN)
        try:
            self.sock.connect(endpoint(name, worker_uid))
            self._watch_worker()
        except BaseException:
            self.close(bye=False)
            raise
        own = (self._wake_fd,) if self.pidfd is None else (self._wake_fd, self.pidfd)
        self._finalizer: weakref.finalize[Any, Any] | None = weakref.finalize(
            self, _drop_socket, self.sock, self._ctx, os.getpid(), own)
        self._finalizer.atexit = False

    def _watch_worker(self) -> None:
        try:
            self.pidfd = os.pidfd_open(self.worker_pid)
        except (AttributeError, OSError):
            self.pidfd = None
        if self.pidfd is not None:
            if process_start_ticks(self.worker_pid) != self.welcome.get("worker_start_ticks"):
                raise WorkerGoneError(f"worker {self.name!r} exited during the handshake")
            self._ospoll.register(self.pidfd, select.POLLIN)

    def send(self, frame: bytes) -> None:
        """Send one frame (never blocks for long: the worker's queue is large); any thread."""
        if self.gone:
            raise WorkerGoneError(self.gone)
        with self.lock:
            if self.closed:
                raise ClientClosedError("the Client is closed")
            RAW_SEND(self.sock, frame, 0)
            # the send may have eaten the fd's signal: make sure a thread sleeping on the fd looks
            # (a lone caller is not asleep: it looks at the socket before it sleeps)
            queued = (self.sleepers or self.watched) and RAW_GET(self.sock, EVENTS) & POLLIN
        if queued:
            self.wake()

    def wake(self) -> None:
        """Make a thread sleeping in :meth:`drain` look at the socket now."""
        try:
            os.eventfd_write(self._wake_fd, 1)
        except OSError:
            pass

    def read_wake(self) -> None:
        """Read the wake eventfd back (it said so: it stays readable until read)."""
        try:
            os.eventfd_read(self._wake_fd)
        except OSError:
            pass

    def _recv_all(self) -> list[bytes]:
        if self.closed:
            raise ClientClosedError("the Client is closed")
        sock, frames = self.sock, []
        while RAW_GET(sock, EVENTS) & POLLIN:
            try:
                frames.append(RAW_RECV(sock, NOBLOCK))
            except zmq.Again:
                break
        return frames

    def _recv_woken(self) -> list[bytes]:
        """After the socket's fd woke a lone waiter: its first frame, taken without asking ``zmq.EVENTS`` first (a
        system call in libzmq; a receive that finds its pipe idle processes the socket's commands itself); the rest,
        if any, at the next :meth:`drain`, which asks before any wait. With another thread asleep on the fd or an
        event loop watching it, everything queued, as :meth:`_recv_all`."""
        if self.sleepers or self.watched:
            return self._recv_all()
        if self.closed:
            raise ClientClosedError("the Client is closed")
        try:
            return [RAW_RECV(self.sock, NOBLOCK)]
        except zmq.Again:
            return []

    def _exited(self) -> WorkerGoneError:
        self.gone = f"worker {self.name!r} (pid {self.worker_pid}) exited"
        return WorkerGoneError(self.gone)

    def drain_now(self, route: Callable[[list[bytes]], Any], limit: int, woken: bool = False) -> tuple[Any, bool]:
        """Receive up to ``limit`` queued frames (never waiting) and hand them to ``route``; for an event loop's
        reader, which routes in small batches so that no turn of the loop runs long. ``woken``: the wake eventfd
        said so (it is read back here; a look for another reason leaves it, as :meth:`drain` does).

        The first frame is taken without asking ``zmq.EVENTS`` first (as :meth:`_recv_woken`: a receive that finds
        nothing processes the socket's commands itself); after each frame the socket is asked, so that everything
        queued is taken or ``more`` says so.

        Returns:
            (what ``route`` returned or ``[]``, whether more frames are queued).
        """
        if woken:
            self.read_wake()
        with self.lock:
            if self.closed:
                return [], False
            sock, frames = self.sock, list[bytes]()
            try:
                frames.append(RAW_RECV(sock, NOBLOCK))
                while len(frames) < limit and RAW_GET(sock, EVENTS) & POLLIN:
                    frames.append(RAW_RECV(sock, NOBLOCK))
            except zmq.Again:
                pass
            more = len(frames) == limit and bool(RAW_GET(sock, EVENTS) & POLLIN)
            return (route(frames) if frames else []), more

    @property
    def watch_fds(self) -> tuple[int, int, int | None]:
        """(the socket's fd, the wake eventfd, the worker's pidfd or None): what an event loop watches."""
        return self._fd, self._wake_fd, self.pidfd

    def exited(self) -> WorkerGoneError:
        """Record that the worker exited (its pidfd became readable); returns the error waiters raise."""
        return self._exited()

    def drain(self, wait_s: float, route: Callable[[list[bytes]], Any]) -> Any:
        """Receive what is queued and hand it to ``route`` (called holding :attr:`lock`); when nothing is
        queued, spin (``spin_us``) then sleep up to ``wait_s`` (< 0: no limit) for the socket or the worker.

        Returns:
            What ``route`` returned, or ``[]`` when nothing came.

        Raises:
            WorkerGoneError: the worker process exited.
            ClientClosedError: the connection was closed meanwhile.
        """
        if self.gone:
            raise WorkerGoneError(self.gone)
        # NOTE: order is important here: count this thread as asleep *before* looking at the socket, so a
        # send by another thread from then on wakes it if it ate the fd's signal (see send)
        self.sleepers += 1
        try:
            with self.lock:
                frames = self._recv_all()
                if frames:
                    return route(frames)
            if self.spin_s:  # spin_us: no sleep while the answer is near
                end = time.perf_counter() + self.spin_s
                while time.perf_counter() < end:
                    with self.lock:
                        frames = self._recv_all()
                        if frames:
                            return route(frames)
            wait_ms = _MAX_WAIT_MS if wait_s < 0 else min(_MAX_WAIT_MS, int(wait_s * 1000) + 1)
            ready = self._ospoll.poll(wait_ms)
        finally:
            self.sleepers -= 1
        woken = False  # by the socket's fd alone
        for fd, _ in ready:
            if fd == self.pidfd:
                raise self._exited()
            if fd == self._wake_fd:
                self.read_wake()
            else:
                woken = True
        with self.lock:
            frames = self._recv_woken() if woken and len(ready) == 1 else self._recv_all()
            return route(frames) if frames else []

    def worker_alive(self) -> bool:
        """False once the worker process is known to have exited."""
        if self.gone:
            return False
        if self.pidfd is not None and select.select([self.pidfd], [], [], 0)[0]:
            self._exited()
            return False
        return True

    def close(self, bye: bool = True) -> None:
        """Say BYE (when the worker lives) and close the socket and any region fd not mapped yet."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        with self.lock:
            if self.closed:
                return
            self.closed = True
            if bye and not self.gone:
                try:
                    self.sock.send(m.BYE, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
            fin = getattr(self, "_finalizer", None)
            if fin is not None:
                fin.detach()
            self.sock.close(linger=100 if bye else 0)
            self._ctx.term()
            if self.pidfd is not None:
                os.close(self.pidfd)
                self.pidfd = None
            os.close(self._wake_fd)
            if self.lane is not None:
                self.lane.close()
                self.lane = None


def control_error(reply: ErrorReply) -> RequestError:
    """The error an ERROR control reply carries."""
    return from_wire(reply.code, reply.message, field=reply.field, op=reply.op or "", tensor=reply.tensor or "",
                     step=-1 if reply.step is None else reply.step)
