"""Bytes this process has sent on its Unix stream sockets that their peers have not read yet (sock_diag).

A test that stops a worker (SIGSTOP) and sends it several CALLs waits, with :func:`wait_unread`,
until every one of them sits in the worker's socket buffer, so that the worker finds them all
in one turn when it continues: an ordering by observed state, not by a sleep. libzmq writes a
message from its own I/O thread, after ``send`` has returned, which is why the test cannot know
it otherwise. (A ZeroMQ connection must have finished its handshake, which needs the worker
running, before the worker is stopped: until then libzmq holds the messages itself.)

The kernel's sock_diag netlink interface (what ``ss -x`` uses) gives, for every Unix socket, its
peer's inode and the bytes in its receive queue; our sockets are the socket fds in
``/proc/self/fd`` (their inode, from ``fstat``).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import time

__all__ = ["unread_by_peers", "wait_unread"]

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_DONE, _NLMSG_ERROR = 3, 2
_UDIAG_SHOW_PEER, _UDIAG_SHOW_RQLEN = 0x4, 0x10
_UNIX_DIAG_PEER, _UNIX_DIAG_RQLEN = 2, 4
_TCP_ESTABLISHED = 1


def _own_inodes() -> set[int]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):  # fstat, not readlink: a non-dumpable process may not read the links
        try:
            st = os.fstat(int(fd))
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            out.add(st.st_ino)
    return out


def _unix_sockets() -> list[tuple[int, int, int]]:
    """(inode, peer inode, bytes in the receive queue) of every established Unix socket of this namespace."""
    req = struct.pack("=BBHIIIII", socket.AF_UNIX, 0, 0, 1 << _TCP_ESTABLISHED, 0,
                      _UDIAG_SHOW_PEER | _UDIAG_SHOW_RQLEN, 0xFFFFFFFF, 0xFFFFFFFF)
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0) + req
    out: list[tuple[int, int, int]] = []
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.sendto(msg, (0, 0))
        while True:
            data = nl.recv(1 << 16)
            off = 0
            while off + 16 <= len(data):
                length, kind = struct.unpack_from("=IH", data, off)
                if kind == _NLMSG_DONE:
                    return out
                if kind == _NLMSG_ERROR:
                    raise OSError("sock_diag refused the dump")
                body = off + 16
                ino = struct.unpack_from("=I", data, body + 4)[0]
                peer = rq = 0
                a = body + 16  # after struct unix_diag_msg
                while a + 4 <= off + length:
                    alen, atype = struct.unpack_from("=HH", data, a)
                    if alen < 4:
                        break
                    if atype == _UNIX_DIAG_PEER:
                        peer = struct.unpack_from("=I", data, a + 4)[0]
                    elif atype == _UNIX_DIAG_RQLEN:
                        rq = struct.unpack_from("=I", data, a + 4)[0]
                    a += (alen + 3) & ~3
                out.append((ino, peer, rq))
                off += (length + 3) & ~3


def unread_by_peers() -> int:
    """Bytes waiting in the receive queues of the peers of this process's Unix stream sockets."""
    own = _own_inodes()
    return sum(rq for ino, peer, rq in _unix_sockets() if peer in own and ino not in own)


def wait_unread(nbytes: int, timeout_s: float = 10.0) -> int:
    """Wait until at least ``nbytes`` sent by this process wait unread in their peers' queues; returns the count.

    Raises:
        TimeoutError: they did not, within ``timeout_s`` (a hang guard: the kernel sees them in microseconds).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        n = unread_by_peers()
        if n >= nbytes:
            return n
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {n} of {nbytes} bytes reached the peers' socket buffers")
        time.sleep(0.001)
