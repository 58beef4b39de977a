"""The worker's attach socket: where a client proves who it is and receives its regions.

``<runtime dir>/<NAME>.attach`` is an AF_UNIX SOCK_SEQPACKET socket (one packet is
one message, so neither side parses a stream). Life of one connection, on the loop
thread, never blocking it::

    accept (non-blocking)          SO_PEERCRED: pid, uid, gid of the connecting process, from the kernel
    wait for one packet            at most CONNECT_TIMEOUT_S, at most MAX_PENDING connections at once
    HELLO -> checks (Sessions)     every claim must equal what the kernel said (check_identity)
    reply: WELCOME + region fds    sendmsg with SCM_RIGHTS; or ERROR
    close                          the session lives on over ZeroMQ, under the WELCOME's token

The socket is 0600 (with ``--allow-uid``, plus an ACL entry for each allowed uid, so other uids cannot connect;
0666 where the file system keeps no ACLs, and the kernel's credentials at accept then refuse them).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import logging
import os
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shmrpc.schema.control import ErrorReply
from shmrpc.schema.errors import InvalidRequestError
from shmrpc.schema.messages import ATTACH_MAX_NBYTES
from shmrpc.schema.proc import process_start_ticks

from ._logs import RateLimited
from .checks import StartupError
from .rundir import admit_to_socket

__all__ = ["PeerCred", "peer_cred", "AttachListener", "check_identity", "set_dumpable", "CONNECT_TIMEOUT_S",
           "MAX_PENDING"]

log = logging.getLogger("shmrpc.server")

#: A connection that sends no HELLO within this long is closed.
CONNECT_TIMEOUT_S = 5.0
#: Connections waiting for their HELLO at once; the oldest is closed to make room.
MAX_PENDING = 64
#: After an accept failed (out of fds: the connection stays queued and the socket readable), the loop stops polling
#: the listening socket for this long (:attr:`AttachListener.paused_until`).
ACCEPT_BACKOFF_S = 0.25

_CRED = struct.Struct("3i")
_PR_SET_DUMPABLE = 4
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class PeerCred:
    """What the kernel says of the process at the other end of a Unix socket (as of its connect)."""

    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """``SO_PEERCRED`` of a connected Unix socket."""
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return PeerCred(pid, uid, gid)


def _prctl(option: int, arg: int, what: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl({what}): {os.strerror(err)}")


def set_dumpable(dumpable: bool) -> None:
    """``prctl(PR_SET_DUMPABLE)``: a non-dumpable process's /proc/<pid>/fd, /mem, /maps are closed to other
    non-root processes (and it writes no core dump). Raises OSError when the kernel refuses."""
    _prctl(_PR_SET_DUMPABLE, int(dumpable), "PR_SET_DUMPABLE")


def set_parent_death_signal(sig: int) -> None:
    """``prctl(PR_SET_PDEATHSIG)``: the kernel sends ``sig`` to this process when the thread that started it ends
    (its parent process dying, whatever the cause). Raises OSError when the kernel refuses."""
    _prctl(_PR_SET_PDEATHSIG, int(sig), "PR_SET_PDEATHSIG")


def _not_admitted(uid: int) -> str:
    return f"uid {uid} may not use this worker (the worker's owner can allow it with --allow-uid)"


def check_identity(hello: dict[str, Any], peer: PeerCred, allow_uids: tuple[int, ...]) -> tuple[str, str] | None:
    """Why a HELLO from ``peer`` is refused, as (message, field); None when its claims are the kernel's truth."""
    if peer.uid != os.geteuid() and peer.uid not in allow_uids:
        return _not_admitted(peer.uid), "uid"
    if peer.pid == os.getpid():
        return "the worker does not lease slots to itself", "pid"
    pid, uid, ticks = hello.get("pid"), hello.get("uid"), hello.get("start_ticks")
    if type(pid) is not int or pid != peer.pid:
        return f"HELLO names pid {pid!r} but the connecting process is pid {peer.pid}", "pid"
    if type(uid) is not int or uid != peer.uid:
        return f"HELLO names uid {uid!r} but the connecting process runs as uid {peer.uid}", "uid"
    actual = process_start_ticks(peer.pid)
    if type(ticks) is not int or actual is None or ticks != actual:
        return f"HELLO names start time {ticks!r} but process {peer.pid} started at {actual}", "start_ticks"
    return None


class AttachListener:
    """The listening attach socket and the connections that have not said HELLO yet.

    Example::

        listener = AttachListener(attach_path(name), shared=False)
        for conn in listener.accept():      # when listener.fileno() is readable
            ...
        got = listener.receive(fd)          # when a pending connection's fd is readable
    """

    def __init__(self, path: Path, *, shared: bool, admit: tuple[int, ...] = (),
                 on_refused: Callable[[PeerCred, str], None] | None = None) -> None:
        self.path = path
        self._on_refused = on_refused  # told of each connection refused at accept (its peer, why)
        # the uids whose connections wait for their HELLO (the worker's, root's for STATUS, --allow-uid's); any other
        # is answered at once with its refusal and closed, so connections of a uid the worker does not serve never
        # take a pending place of those it does
        self._admit = frozenset((os.geteuid(), 0, *admit))
        self._shared, self._admit_uids = shared, tuple(admit)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        #: whether only the admitted uids can connect (False: the socket is 0666, the file system keeps no ACLs)
        self.acl = True
        self._sock, self._ino = self._listen()
        self.pending: dict[int, tuple[socket.socket, float, int]] = {}  # fd -> (connection, deadline, peer uid)
        #: monotonic time until which the loop does not poll the listening socket (0: it does); set by a failed accept
        self.paused_until = 0.0
        self._failed = 0  # accepts failed since the last one that succeeded
        self._failures = RateLimited(log, rate_per_s=0.1, burst=1, level=logging.WARNING)

    def _listen(self) -> tuple[socket.socket, int]:
        """A listening socket bound at :attr:`path` (which must not exist), and the inode of its file."""
        path = self.path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        old = os.umask(0o077)
        try:
            sock.bind(str(path))
            if self._shared:  # --allow-uid: an ACL entry each (0666 where the file system keeps none)
                self.acl = admit_to_socket(path, self._admit_uids)
            else:
                os.chmod(path, 0o600)
            ino = os.stat(path).st_ino  # close() unlinks the path only while it is still this socket
            sock.listen(128)
        except OSError as e:  # no space or inodes left under the runtime directory, a read-only file system
            sock.close()
            raise StartupError(f"cannot create the attach socket {path}: {e.strerror or e}; free space in (or fix) "
                               f"{path.parent}, or point SHMRPC_RUNTIME_DIR elsewhere") from None
        except BaseException:
            sock.close()
            raise
        finally:
            os.umask(old)
        return sock, ino

    def rebind(self) -> None:
        """Listen on a new socket file at :attr:`path`, which was removed (a tmp cleaner): the connections waiting
        for their HELLO stay; the old listening socket is closed without touching the path. The fd changes.

        Raises:
            StartupError: the file could not be made (the old socket listens on).
        """
        sock, ino = self._listen()
        self._sock.close()
        self._sock, self._ino = sock, ino

    def gone(self) -> bool:
        """Whether the socket file at :attr:`path` is missing or another's."""
        try:
            return os.stat(self.path).st_ino != self._ino
        except FileNotFoundError:
            return True

    def fileno(self) -> int:
        """The listening socket's fd (readable: connections to accept)."""
        return self._sock.fileno()

    def accept(self) -> None:
        """Accept the waiting connections, at most :data:`MAX_PENDING` a turn (a flood of connects must not hold the
        loop); each then waits for its HELLO in :attr:`pending`."""
        for _ in range(MAX_PENDING):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: leave it queued, wait a while, say so once per burst
                # (the socket stays readable: polled at once again, the loop spun on it, a line per turn)
                self._failed += 1
                self.paused_until = time.monotonic() + ACCEPT_BACKOFF_S
                self._failures.log("attach socket: accept failed: %s; trying again every %.2f s", e,
                                   ACCEPT_BACKOFF_S, extra={"event": "attach_accept_failed"})
                return
            if self._failed:
                self._failures.log("attach socket: accepting again after %d failed accepts", self._failed,
                                   extra={"event": "attach_accept_failed"})
                self._failed = 0
            conn.setblocking(False)
            peer = peer_cred(conn)
            uid = peer.uid
            if uid not in self._admit:
                self.reply(conn, self._refusal(uid), [])
                if self._on_refused is not None:
                    self._on_refused(peer, _not_admitted(uid))
                continue
            with contextlib.suppress(OSError):  # a packet may be as large as this (the kernel caps it at wmem_max)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, ATTACH_MAX_NBYTES)
            if len(self.pending) >= MAX_PENDING:
                # room made at the cost of the uid holding the most places (one that floods the socket loses its
                # own connections, not another user's), its oldest connection
                held = collections.Counter(u for _, _, u in self.pending.values())
                most = max(held.values())
                oldest = min((fd for fd, e in self.pending.items() if held[e[2]] == most),
                             key=lambda fd: self.pending[fd][1])
                self.pending.pop(oldest)[0].close()
            self.pending[conn.fileno()] = (conn, time.monotonic() + CONNECT_TIMEOUT_S, uid)

    def receive(self, fd: int) -> tuple[socket.socket, bytes | None, PeerCred] | None:
        """The pending connection ``fd``, its HELLO packet (None: closed, truncated or unreadable) and its peer.

        None when ``fd`` is not pending or has nothing to read yet.
        """
        entry = self.pending.get(fd)
        if entry is None:
            return None
        conn = entry[0]
        try:
            data, _, flags, _ = conn.recvmsg(ATTACH_MAX_NBYTES)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            data, flags = b"", 0
        self.pending.pop(fd)
        cred = peer_cred(conn)
        if not data or flags & socket.MSG_TRUNC:
            return conn, None, cred
        return conn, data, cred

    @staticmethod
    def reply(conn: socket.socket, frame: bytes, fds: list[int]) -> bool:
        """Send one packet (with ``fds`` attached) and close the connection; whether it was sent."""
        try:
            if fds:
                socket.send_fds(conn, [frame], fds)
            else:
                conn.send(frame)
            return True
        except OSError as e:  # the client went away or its buffer is full: its loss
            log.debug("attach socket: could not answer: %s", e)
            return False
        finally:
            conn.close()

    @staticmethod
    def _refusal(uid: int) -> bytes:
        """The ERROR a connection of a uid the worker does not admit gets at once (what its HELLO would get)."""
        return ErrorReply(InvalidRequestError.code, "refused", _not_admitted(uid), "uid").encode()

    def expire(self, now: float) -> None:
        """Close connections that said nothing in time."""
        for fd in [fd for fd, (_, deadline, _) in self.pending.items() if deadline <= now]:
            self.pending.pop(fd)[0].close()

    def close(self) -> None:
        """Close everything and remove the socket file; idempotent."""
        for conn, _, _ in self.pending.values():
            conn.close()
        self.pending.clear()
        if self._sock.fileno() >= 0:
            self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == self._ino:  # (removed and made again by another worker: theirs)
                    os.unlink(self.path)

