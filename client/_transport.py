"""The client's ZeroMQ side: DEALER socket, handshake, and a pump that routes replies.

A DEALER receives three kinds of reply, interleaved: DONE for requests in
flight (matched by request_id), GRANT/ERROR for the one control request that
may be outstanding, and nothing else. The pump also watches the worker's
pidfd, so a worker that dies fails every waiter at once instead of after its
timeout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from shmrpc.schema import SCHEMA_HASH
from shmrpc.schema import messages as m
from shmrpc.schema.errors import (
    ClientLimitError,
    ConnectError,
    ProtocolMismatchError,
    RequestError,
    Timeout,
    WorkerGoneError,
    from_wire,
)
from shmrpc.schema.naming import endpoint, socket_path

__all__ = ["Transport"]

_POLLIN = int(zmq.POLLIN)


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


class Transport:
    """One DEALER connection to worker ``name``."""

    def __init__(self, name: str, connect_timeout_s: float, spin_us: int = 0,
                 lease: tuple[int, ...] | None = None) -> None:
        self.name = name
        self.spin_s = spin_us / 1e6
        path: Path = socket_path(name)
        deadline = time.monotonic() + connect_timeout_s
        while not path.exists():
            if time.monotonic() >= deadline:
                raise ConnectError(f"no worker named {name!r}: {path} does not exist (start one with "
                                   f"`shmrpc serve --name {name}`, or check SHMRPC_RUNTIME_DIR)")
            time.sleep(0.01)
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint(name))
        self.pidfd: int | None = None
        self.worker_pid = 0
        self.gone: str | None = None
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        try:
            self.welcome = self._handshake(deadline, lease)
        except BaseException:
            self.close()
            raise

    def _handshake(self, deadline: float, lease: tuple[int, ...] | None) -> dict[str, Any]:
        pid = os.getpid()
        hello: dict[str, Any] = {"protocol": m.PROTOCOL_VERSION, "schema_hash": SCHEMA_HASH,
                                 "pid": pid, "uid": os.getuid(), "start_ticks": _start_ticks(pid)}
        if lease is not None:
            hello["lease"] = list(lease)
        self.sock.send(m.pack_json(m.HELLO, hello))
        remaining = max(0.0, deadline - time.monotonic())
        if not self.sock.poll(int(remaining * 1000) + 1):
            raise ConnectError(f"worker {self.name!r} did not answer HELLO in time; is it alive? (shmrpc doctor)")
        frame = self.sock.recv()
        body = m.unpack_json(frame)
        if frame[:1] == m.ERROR:
            kind = body.get("kind")
            cls = {"protocol_mismatch": ProtocolMismatchError, "too_many_clients": ClientLimitError}.get(kind, ConnectError)
            raise cls(f"worker {self.name!r} refused the connection: {body.get('message')}")
        if frame[:1] != m.WELCOME:
            raise ConnectError(f"worker {self.name!r} answered HELLO with {frame[:1]!r}")
        if body["protocol"] != m.PROTOCOL_VERSION or body["schema_hash"] != SCHEMA_HASH:
            raise ProtocolMismatchError("the worker's protocol or schema differs from this client's")
        self.worker_pid = int(body["worker_pid"])
        try:
            self.pidfd = os.pidfd_open(self.worker_pid)
        except (AttributeError, OSError):
            self.pidfd = None
        if self.pidfd is not None:
            if _start_ticks(self.worker_pid) != body.get("worker_start_ticks"):
                raise WorkerGoneError(f"worker {self.name!r} exited during the handshake")
            self._poller.register(self.pidfd, zmq.POLLIN)
        return body  # type: ignore[no-any-return]

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
        sock, pidfd = self.sock, self.pidfd
        while not until():
            if self.gone:
                raise WorkerGoneError(self.gone)
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
        """Say BYE (when the worker lives) and close the socket."""
        if bye and not self.gone:
            try:
                self.sock.send(m.BYE, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.sock.close(linger=100 if bye else 0)
        self._ctx.term()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def control_error(frame: bytes) -> RequestError:
    """The error an ERROR control reply carries."""
    body = m.unpack_json(frame)
    return from_wire(int(body.get("code", 0xFFFF)), str(body.get("message", "")), field=str(body.get("field", "")))
