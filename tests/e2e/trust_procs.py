"""Processes of another uid for tests/e2e/test_trust.py: started as root, they become that uid and play a role.

    python trust_procs.py UID GID ROLE ARGS...

The interpreter may live where only root can read (a home directory), so everything a
role needs is imported first, as root; then the process drops to UID/GID for good and
makes itself dumpable again (the kernel clears that flag on a change of uid), exactly
like an ordinary process started by that user. Roles:

``worker NAME [serve options]``
    ``shmrpc serve`` in this process (SHMRPC_RUNTIME_DIR from the environment).
``client NAME [--non-dumpable] [--worker-uid N]``
    connect, make one checked call, print ``ready <pid>``, hold the connection until stdin closes.
``fake-worker DIR NAME``
    a fake worker: bind ``DIR/NAME.attach`` (making DIR first), print ``listening``, then
    for each connection print ``connected`` and, if any byte arrives, ``hello``.
``attacker WORKER_PID CLIENT_PID``
    try every door to the regions a same-uid process has without ptrace rights; print JSON.
``guess NAME WORKER_UID RESIDENT...``
    as a client admitted with ``--allow-uid``, name each RESIDENT in a request (past the client's own look-up) and
    drop it; print JSON: what each request and drop got, and the names MANAGE ``list`` shows.
``sock-flood COUNT PATH...``
    open COUNT stream connections to each socket PATH (sending nothing); print JSON: per path, the connections made
    and the errors by name; hold them until stdin closes.
``watch SECONDS``
    watch /dev/shm with inotify; print ``watching``, then (after SECONDS) a JSON list of
    the names created there.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import select
import socket
import struct
import sys
import time

import numpy as np

import shmrpc.kernels._backend_numpy  # noqa: F401 - imported before dropping to a uid that cannot read it
import shmrpc.server._loop  # noqa: F401
import shmrpc.server._plugins  # noqa: F401
import shmrpc.server.cli as cli
from shmrpc.client import Client, ConnectError
from shmrpc.schema.layout import parse_size  # noqa: F401

_PR_SET_DUMPABLE = 4
_IN_CREATE = 0x100
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def become(uid: int, gid: int) -> None:
    """Drop to uid/gid for good, then be dumpable as a process started by that user is."""
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if _libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl")


def _try(path: str, how: str = "open") -> str:
    """What happens when this process tries to use ``path``: "ok" or the error's name."""
    try:
        if how == "listdir":
            os.listdir(path)
        elif how == "readlinks":
            return json.dumps([os.readlink(f"{path}/{e}") for e in os.listdir(path)])
        else:
            os.close(os.open(path, os.O_RDWR))
        return "ok"
    except OSError as e:
        return type(e).__name__


def attacker(worker_pid: int, client_pid: int) -> None:
    out = {"shm": sorted(e for e in os.listdir("/dev/shm") if e.startswith("shmrpc.")), "worker": {}, "client": {}}
    for role, pid in (("worker", worker_pid), ("client", client_pid)):
        doors = out[role]
        doors["fd_dir"] = _try(f"/proc/{pid}/fd", "listdir")
        fds = []
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            pass
        links = []
        for fd in fds:
            try:
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        doors["memfd_links"] = [x for x in links if "memfd" in x or "shmrpc" in x]
        doors["opened_memfds"] = []
        for fd in fds:  # reopen through the magic link: the (b) door
            try:
                if "memfd" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                    os.close(os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR))
                    doors["opened_memfds"].append(fd)
            except OSError:
                continue
        doors["mem"] = _try(f"/proc/{pid}/mem")  # the (c) door
        doors["map_files_opened"] = []  # each mapping reopened through /proc/<pid>/map_files/<range>
        try:
            for e in os.listdir(f"/proc/{pid}/map_files"):
                try:
                    os.close(os.open(f"/proc/{pid}/map_files/{e}", os.O_RDONLY))
                    doors["map_files_opened"].append(e)
                except OSError:
                    continue
        except OSError:
            pass
        try:
            with open(f"/proc/{pid}/maps") as f:
                doors["maps_memfd"] = [line.split()[-1] for line in f if "memfd:shmrpc" in line]
        except OSError as e:
            doors["maps_memfd"] = type(e).__name__
    print(json.dumps(out), flush=True)


def watch(seconds: float) -> None:
    fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
    if fd < 0 or _libc.inotify_add_watch(fd, b"/dev/shm", _IN_CREATE) < 0:
        raise OSError(ctypes.get_errno(), "inotify")
    print("watching", flush=True)
    names = []
    end = time.monotonic() + seconds
    while True:
        left = end - time.monotonic()
        if left <= 0:
            break
        if select.select([fd], [], [], left)[0]:
            data = os.read(fd, 65536)
            pos = 0
            while pos < len(data):
                _, _, _, n = struct.unpack_from("iIII", data, pos)
                names.append(data[pos + 16:pos + 16 + n].rstrip(b"\0").decode())
                pos += 16 + n
    print(json.dumps([n for n in names if n.startswith("shmrpc.")]), flush=True)


def fake_worker(rdir: str, name: str) -> None:
    os.makedirs(rdir, mode=0o700, exist_ok=True)
    path = os.path.join(rdir, f"{name}.attach")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(path)
    os.chmod(path, 0o777)
    s.listen(8)
    print("listening", flush=True)
    while True:
        conn, _ = s.accept()
        print("connected", flush=True)
        conn.settimeout(2.0)
        try:
            if conn.recv(65536):
                print("hello", flush=True)
        except OSError:
            pass
        conn.close()


def client(name: str, non_dumpable: bool, worker_uid: int | None) -> None:
    try:
        c = Client(name, timeout_s=10, connect_timeout_s=10, non_dumpable=non_dumpable, worker_uid=worker_uid)
    except ConnectError as e:
        print(f"ConnectError {e}", flush=True)
        return
    except Exception as e:  # noqa: BLE001 - the test reads the class name
        print(f"{type(e).__name__} {e}", flush=True)
        return
    with c:
        out = c.call("scale", x=np.arange(4, dtype=np.float32), a=2.0)["out"]
        assert out.tolist() == [0.0, 2.0, 4.0, 6.0], out
        print(f"ready {os.getpid()}", flush=True)
        sys.stdin.read()


def guess(name: str, worker_uid: int, names: list[str]) -> None:
    from shmrpc.client import Resident
    from shmrpc.schema.errors import RequestError

    out: dict[str, object] = {"call": {}, "drop": {}}
    with Client(name, timeout_s=10, connect_timeout_s=10, worker_uid=worker_uid) as c:
        for n in names:
            c._specs[n] = ((4,), np.dtype(np.float32))  # as if the client had seen it: the worker alone decides
            try:
                out["call"][n] = c.call("scale", x=Resident(n), a=1.0)["out"].tolist()  # type: ignore[index]
            except RequestError as e:
                out["call"][n] = f"{type(e).__name__} {e.field}"  # type: ignore[index]
            try:
                c.drop(n)
                out["drop"][n] = "dropped"  # type: ignore[index]
            except RequestError as e:
                out["drop"][n] = f"{type(e).__name__} {e.field}"  # type: ignore[index]
        out["list"] = sorted(c.resident())
    print(json.dumps(out), flush=True)


def flood(path: str, seconds: float) -> None:
    """Connect to the attach socket at ``path`` as fast as it takes them for ``seconds``, keeping the last 200
    connections open and sending nothing (a flood that once kept every new client out); prints "flooding" once
    started and the connects made at the end."""
    held: list[socket.socket] = []
    made, end = 0, time.monotonic() + seconds
    print("flooding", flush=True)
    while time.monotonic() < end:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
        try:
            s.connect(path)
            made += 1
        except OSError:
            s.close()
            continue
        held.append(s)
        if len(held) > 200:
            held.pop(0).close()
    print(f"connects {made}", flush=True)


def sock_flood(count: int, paths: list[str]) -> None:
    held: list[socket.socket] = []
    out: dict[str, dict[str, object]] = {}
    for path in paths:
        made, errors = 0, {}  # type: ignore[var-annotated]
        for _ in range(count):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET if path.endswith(".attach") else socket.SOCK_STREAM)
            try:
                s.connect(path)
            except OSError as e:
                s.close()
                errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                continue
            made += 1
            held.append(s)
        out[path] = {"made": made, "errors": errors}
    print(json.dumps(out), flush=True)
    sys.stdin.read()


def main() -> None:
    uid, gid, role, *args = sys.argv[1:]
    become(int(uid), int(gid))
    if role == "worker":
        sys.exit(cli.main(["serve", "--name", args[0], *args[1:]]))
    elif role == "client":
        wuid = int(args[args.index("--worker-uid") + 1]) if "--worker-uid" in args else None
        client(args[0], "--non-dumpable" in args, wuid)
    elif role == "fake-worker":
        fake_worker(args[0], args[1])
    elif role == "attacker":
        attacker(int(args[0]), int(args[1]))
    elif role == "watch":
        watch(float(args[0]))
    elif role == "flood":
        flood(args[0], float(args[1]))
    elif role == "sock-flood":
        sock_flood(int(args[0]), args[1:])
    elif role == "guess":
        guess(args[0], int(args[1]), args[2:])
    elif role == "status":
        sys.exit(cli.main(["status", "--name", args[0]]))
    else:
        sys.exit(f"unknown role {role}")


if __name__ == "__main__":
    main()
