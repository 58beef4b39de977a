"""The client's ZeroMQ side: DEALER socket, handshake, and a pump that routes replies.

The handshake (verifying the worker, HELLO, WELCOME with the regions' fds) is
:mod:`._attach`'s; this module then connects the DEALER with the session token as
its routing id. A DEALER receives replies interleaved: DONE for requests in flight
(matched by request_id), and the JSON control replies (GRANT, MANAGED, ERROR, STATE),
which the client matches by the ``id`` of the ACQUIRE or MANAGE they answer. The pump also watches the worker's
pidfd, so a worker that dies fails every waiter at once instead of after its
timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from shmrpc.schema import messages as m
from shmrpc.schema.control import ErrorReply
from shmrpc.schema.errors import (
    RequestError,
    Timeout,
    WorkerGoneError,
    from_wire,
)
from shmrpc.schema.naming import endpoint
from shmrpc.schema.proc import process_start_ticks

from ._attach import handshake
from ._lane import ClientLane

__all__ = ["Connection"]

_POLLIN = int(zmq.POLLIN)


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
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        if self.lane is not None:  # a lane's answer wakes a pump waiting on ZeroMQ too
            self._poller.register(self.lane.fd, zmq.POLLIN)
        try:
            self.sock.connect(endpoint(name, worker_uid))
            self._watch_worker()
        except BaseException:
            self.close(bye=False)
            raise

    def _watch_worker(self) -> None:
        try:
            self.pidfd = os.pidfd_open(self.worker_pid)
        except (AttributeError, OSError):
            self.pidfd = None
        if self.pidfd is not None:
            if process_start_ticks(self.worker_pid) != self.welcome.get("worker_start_ticks"):
                raise WorkerGoneError(f"worker {self.name!r} exited during the handshake")
            self._poller.register(self.pidfd, zmq.POLLIN)

    def send(self, frame: bytes) -> None:
        """Send one frame (never blocks for long: the worker's queue is large)."""
        if self.gone:
            raise WorkerGoneError(self.gone)
        self.sock.send(frame, copy=True)

    def pump(self, deadline: float | None, on_done: Callable[[int, int, int, int], None],
             on_control: Callable[[bytes], None], until: Callable[[], bool]) -> None:
        """Receive and route replies until ``until()`` is true.

        Raises:
            Timeout: ``deadline`` (time.monotonic) passed first.
            WorkerGoneError: the worker process exited.
        """
        sock, pidfd, lane = self.sock, self.pidfd, self.lane
        while not until():
            if self.gone:
                raise WorkerGoneError(self.gone)
            if lane is not None and lane.busy:  # the request in the lane may have been answered meanwhile
                rid = lane.busy
                done = lane.answer()
                if done is not None:
                    on_done(*lane_done(done, rid))
                    continue
            ready = int(sock.getsockopt(zmq.EVENTS)) & _POLLIN
            if not ready and self.spin_s:
                end = time.perf_counter() + self.spin_s  # spin_us: no sleep while the answer is near
                while not ready and time.perf_counter() < end:
                    ready = int(sock.getsockopt(zmq.EVENTS)) & _POLLIN
            if not ready:  # nothing queued: wait for the socket or the pidfd
                wait_ms = -1 if deadline is None else max(0, int((deadline - time.monotonic()) * 1000) + 1)
                events = dict(self._poller.poll(wait_ms))
                if pidfd is not None and pidfd in events:
                    self.gone = f"worker {self.name!r} (pid {self.worker_pid}) exited"
                    raise WorkerGoneError(self.gone)
                if lane is not None and lane.fd in events:
                    try:
                        os.eventfd_read(lane.fd)
                    except BlockingIOError:
                        pass
                if sock not in events:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise Timeout(f"no answer from worker {self.name!r} in time")
                    continue
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                continue
            if frame[:1] == m.DONE:
                on_done(*m.unpack_done(frame))
            else:
                on_control(frame)

    def worker_alive(self) -> bool:
        """False once the worker process is known to have exited."""
        if self.gone:
            return False
        if self.pidfd is not None and self.pidfd in dict(self._poller.poll(0)):
            self.gone = f"worker {self.name!r} (pid {self.worker_pid}) exited"
            return False
        return True

    def close(self, bye: bool = True) -> None:
        """Say BYE (when the worker lives) and close the socket and any region fd not mapped yet."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        if bye and not self.gone:
            try:
                self.sock.send(m.BYE, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.sock.close(linger=100 if bye else 0)
        if self.lane is not None:
            self.lane.close()
            self.lane = None
        self._ctx.term()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def lane_done(frame: bytes, request_id: int) -> tuple[int, int, int, int]:
    """The DONE a lane's page holds for ``request_id`` (region, slot, request_id, status).

    Raises:
        RequestError: the page holds no DONE for this request (the page is shared: never trust it).
    """
    try:
        done = m.unpack_done(frame)
    except Exception:  # noqa: BLE001
        raise RequestError("the lane's answer is not a DONE frame", field="lane") from None
    if done[2] != request_id:
        raise RequestError(f"the lane's answer is for request {done[2]}, not {request_id}", field="lane")
    return done


def control_error(reply: ErrorReply) -> RequestError:
    """The error an ERROR control reply carries."""
    return from_wire(reply.code, reply.message, field=reply.field, op=reply.op or "", tensor=reply.tensor or "",
                     step=-1 if reply.step is None else reply.step)
