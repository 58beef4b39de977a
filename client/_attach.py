"""The client's handshake: make sure the worker is the worker, before a byte is written.

In order, each refusal a :class:`ConnectError` naming the path, what was found, and the remedy::

    runtime directory   a directory owned by the worker's uid; group and others may not read or
                        write it (0700, or 0711 for a worker started with --allow-uid)
    <NAME>.attach       a socket owned by the worker's uid (a missing one fails at once)
    connect             SOCK_SEQPACKET; SO_PEERCRED: the process listening runs as the worker's uid
    HELLO               protocol, schema hash, our pid, uid, start time (the worker checks them
                        against what the kernel says of us)
    WELCOME             one packet, its regions' fds beside it (SCM_RIGHTS); worker_pid equal
                        to the pid the kernel gave; one fd per region

The fds are checked by :mod:`._region` before they are mapped. The worker's uid is ours,
unless the caller names another (``Client(..., worker_uid=N)``, for a worker started
with ``--allow-uid``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shmrpc.schema import SCHEMA_HASH
from shmrpc.schema import messages as m
from shmrpc.schema.control import ErrorReply, Hello, MessageError, Welcome
from shmrpc.schema.errors import ClientLimitError, ConnectError, ProtocolMismatchError
from shmrpc.schema.naming import attach_path, runtime_dir
from shmrpc.schema.proc import process_start_ticks

__all__ = ["Handshake", "handshake", "set_dumpable"]

_CRED = struct.Struct("3i")
_PR_SET_DUMPABLE = 4
_MAX_FDS = 8


@dataclass
class Handshake:
    """What the handshake established: the WELCOME, its region fds (ours to close), the worker's pid from the kernel."""

    welcome: dict[str, Any]
    fds: list[int]
    worker_pid: int
    worker_uid: int


def set_dumpable(dumpable: bool) -> None:
    """``prctl(PR_SET_DUMPABLE)`` for this whole process; raises OSError when the kernel refuses."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, int(dumpable), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_DUMPABLE): {os.strerror(err)}")


def _lstat(path: Path, name: str) -> os.stat_result:
    """``lstat`` of a path on the way to worker ``name``; a missing or unreachable one is a ConnectError."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        raise ConnectError(f"no worker named {name!r}: {path} does not exist (start one with "
                           f"`shmrpc serve --name {name}`, or check SHMRPC_RUNTIME_DIR)", path=str(path)) from None
    except PermissionError:
        raise ConnectError(f"cannot reach {path} as uid {os.getuid()}: the worker does not admit this user "
                           f"(its owner can start it with --allow-uid {os.getuid()})", path=str(path)) from None


def _check_dir(rdir: Path, name: str, worker_uid: int) -> None:
    st = _lstat(rdir, name)
    if not stat.S_ISDIR(st.st_mode):
        raise ConnectError(f"runtime directory {rdir} is not a directory: remove it, or set SHMRPC_RUNTIME_DIR "
                           "to a directory of the worker's user", path=str(rdir), owner_uid=st.st_uid)
    if st.st_uid != worker_uid:
        raise ConnectError(f"runtime directory {rdir} is owned by uid {st.st_uid}, not by the worker's uid "
                           f"{worker_uid}: another user may have made it to impersonate the worker; refusing to "
                           f"connect. Remove it (as root or uid {st.st_uid}) and restart the worker, or set "
                           "SHMRPC_RUNTIME_DIR to a directory of the worker's user", path=str(rdir),
                           owner_uid=st.st_uid)
    if st.st_mode & 0o066:
        raise ConnectError(f"runtime directory {rdir} (uid {st.st_uid}) has mode {stat.S_IMODE(st.st_mode):04o}: "
                           f"other users could replace the worker's socket; refusing to connect. Run chmod 700 "
                           f"{rdir} (as uid {st.st_uid}) and restart the worker", path=str(rdir), owner_uid=st.st_uid)


def _check_socket(path: Path, name: str, worker_uid: int) -> None:
    st = _lstat(path, name)
    if not stat.S_ISSOCK(st.st_mode):
        raise ConnectError(f"{path} is not a socket (owner uid {st.st_uid}): remove it and restart the worker",
                           path=str(path), owner_uid=st.st_uid)
    if st.st_uid != worker_uid:
        raise ConnectError(f"{path} is owned by uid {st.st_uid}, not by the worker's uid {worker_uid}: it is not "
                           f"your worker's socket; refusing to connect. Remove it (as root or uid {st.st_uid}) "
                           "and restart the worker", path=str(path), owner_uid=st.st_uid)


def _peer(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid


def handshake(name: str, deadline: float, worker_uid: int | None = None,
              lease: tuple[int, ...] | None = None, lane: bool = False) -> Handshake:
    """Verify the worker ``name`` (see the module docstring), say HELLO, and return the WELCOME with its fds.

    Raises:
        ConnectError: the worker could not be verified, reached, or refused us (the message says why).
        ProtocolMismatchError: the worker speaks another protocol or schema.
    """
    uid = os.getuid() if worker_uid is None else worker_uid
    rdir = runtime_dir(uid)
    path = attach_path(name, uid)
    _check_dir(rdir, name, uid)
    _check_socket(path, name, uid)
    sock: socket.socket | None = None
    fds: list[int] = []
    try:
        delay = 0.001
        while True:  # a worker flooded with connections closes some before their HELLO: connect again, in time
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
            try:
                worker_pid, frame, fds, flags = _hello(sock, path, name, uid, deadline, lease, lane)
                if frame:
                    break
                why = "it closed the connection before answering"
            except (BlockingIOError, ConnectionResetError, BrokenPipeError) as e:
                why = e.strerror or type(e).__name__
            sock.close()
            sock = None
            if deadline - time.monotonic() <= delay:
                raise ConnectError(f"worker {name!r} did not take the connection in time ({why}): it is loaded, or "
                                   f"flooded with connections; `shmrpc status --name {name}` says whether it serves",
                                   path=str(path))
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or not frame:
            raise ConnectError(f"worker {name!r} answered HELLO with a truncated or empty packet")
        if frame[:1] == m.ERROR:
            try:
                err = ErrorReply.decode(frame)
            except MessageError as e:
                raise ConnectError(f"worker {name!r} answered HELLO with a malformed ERROR ({e})") from None
            cls = {"protocol_mismatch": ProtocolMismatchError,
                   "too_many_clients": ClientLimitError}.get(err.kind, ConnectError)
            raise cls(f"worker {name!r} refused the connection: {err.message}"
                      + (f" (field {err.field})" if err.field else ""), path=str(path), field=err.field)
        if frame[:1] != m.WELCOME:
            raise ConnectError(f"worker {name!r} answered HELLO with {frame[:1]!r}")
        try:
            body = json.loads(bytes(frame[1:]).decode())
            Welcome.from_json(body)  # every field there with its type (unknown keys are the worker's to add)
        except (ValueError, RecursionError) as e:
            raise ConnectError(f"worker {name!r} answered HELLO with a malformed WELCOME ({e})") from None
        if body.get("protocol") != m.PROTOCOL_VERSION or body.get("schema_hash") != SCHEMA_HASH:
            raise ProtocolMismatchError("the worker's protocol or schema differs from this client's: install the "
                                        "same shmrpc version on both sides")
        if body.get("worker_pid") != worker_pid:
            raise ConnectError(f"worker {name!r} says it is pid {body.get('worker_pid')} but the kernel says pid "
                               f"{worker_pid}: refusing it")
        n_lane = 3 if lane and body.get("lane") is True else 0  # page, worker's eventfd, ours (schema/lane.py)
        if len(fds) != len(body.get("regions", ())) + n_lane:
            raise ConnectError(f"worker {name!r} sent {len(fds)} fds for {len(body.get('regions', ()))} regions"
                               + (" and a lane" if n_lane else ""))
        out = Handshake(body, fds, worker_pid, uid)
        fds = []
        return out
    finally:
        for fd in fds:
            os.close(fd)
        if sock is not None:
            sock.close()


def _hello(sock: socket.socket, path: Path, name: str, uid: int, deadline: float, lease: tuple[int, ...] | None,
           lane: bool) -> tuple[int, bytes, list[int], int]:
    """Connect ``sock`` to the attach socket at ``path``, check who answers, say HELLO; returns (the worker's pid, the
    answer, its fds, recvmsg's flags); an empty answer when the worker closed the connection unanswered.

    Raises:
        ConnectError: nobody listens, this uid is not admitted, another uid answers, or no answer in time.
        BlockingIOError, ConnectionResetError, BrokenPipeError: the worker's queue of connections is full, or it
            closed this one (the caller connects again).
    """
    sock.settimeout(max(0.001, deadline - time.monotonic()))
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        raise ConnectError(f"no worker listens on {path} (left by a worker that died?): start one with "
                           f"`shmrpc serve --name {name}`, or remove stale files with `shmrpc doctor --clean`",
                           path=str(path)) from None
    except PermissionError:
        raise ConnectError(f"cannot connect to {path} as uid {os.getuid()}: the worker does not admit this user "
                           f"(its owner can start it with --allow-uid {os.getuid()})", path=str(path)) from None
    except TimeoutError:
        raise ConnectError(f"worker {name!r} did not accept the connection in time (loaded, or flooded with "
                           "connections)", path=str(path)) from None
    worker_pid, peer_uid = _peer(sock)
    if peer_uid != uid:
        raise ConnectError(f"the process answering on {path} (pid {worker_pid}) runs as uid {peer_uid}, not as "
                           f"the worker's uid {uid}: it is not your worker; refusing to send it anything. Remove "
                           f"{path} (as root or uid {peer_uid}) and restart the worker", path=str(path),
                           owner_uid=peer_uid)
    pid = os.getpid()
    # lease: slots wanted per size class (the worker caps them by --lease-max)
    hello = Hello(m.PROTOCOL_VERSION, SCHEMA_HASH, pid, os.getuid(), process_start_ticks(pid),
                  None if lease is None else list(lease), True if lane else None)
    try:
        sock.send(hello.encode())
    except (BrokenPipeError, ConnectionResetError):
        # the worker answers a uid it does not admit before its HELLO, and closes: that answer may wait here
        try:
            frame, fds, flags, _ = socket.recv_fds(sock, m.ATTACH_MAX_NBYTES, _MAX_FDS, socket.MSG_DONTWAIT)
        except OSError:
            frame = b""
        if frame:
            return worker_pid, frame, fds, flags
        raise
    try:
        frame, fds, flags, _ = socket.recv_fds(sock, m.ATTACH_MAX_NBYTES, _MAX_FDS)
    except TimeoutError:
        raise ConnectError(f"worker {name!r} (pid {worker_pid}) did not answer HELLO in time; is it alive? "
                           "(shmrpc status / shmrpc doctor)") from None
    return worker_pid, frame, fds, flags
