"""The floors a Python round trip between two processes sits on, on this host (issue #12's lanes).

    python bench/gpu/floor_probe.py [--iters 20000] [--out FILE.json]

Measures, between two processes of this interpreter (a fork), with no shmrpc code at all:

* ``spin``: a seq word in a shared page, each side spinning on the other's (``ctypes.c_uint64``
  loads and stores, as the lanes do): the floor of a spinning lane in Python;
* ``eventfd``: each side blocking in ``select.poll`` on its eventfd, the other writing it (the
  lanes' blocking wake-up, one each way): the floor of a blocking lane in Python; and the same
  waiting in a level-triggered epoll set (then reading the eventfd), or edge-triggered without
  reading it back (how a lane's client waits);
* and, in one process, the cost of the calls a lane round trip makes: ``eventfd_write`` with no
  waiter, ``zmq.Poller.poll(0)`` over the worker loop's kind of poll set, ``select.poll(0)``; and of the
  Python pieces both sides' hot paths are made of (a clock read, a lock taken and let go, an empty
  method call, a header unpacked from a memoryview, a 368-byte descriptor copied out of one, a 64 B
  ``numpy.add`` into its output), each timed over batches of 1000 calls (p50 / p99 of the batches).

Prints a table of p50 / p99 in µs and writes JSON (date, host, command) to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import select
import sys
import time
from typing import Any


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6


def spin(iters: int) -> list[float]:
    page = mmap.mmap(-1, 4096)
    ping, pong = ctypes.c_uint64.from_buffer(page, 0), ctypes.c_uint64.from_buffer(page, 128)
    pid = os.fork()
    if pid == 0:
        seen = 0
        while seen < iters + 100:
            v = ping.value
            if v != seen:
                seen = v
                pong.value = v
        os._exit(0)
    out = []
    for i in range(1, iters + 101):
        t0 = time.perf_counter()
        ping.value = i
        while pong.value != i:
            pass
        if i > 100:
            out.append(time.perf_counter() - t0)
    os.waitpid(pid, 0)
    del ping, pong
    page.close()
    return out


def _waiter(fd: int, how: str) -> Any:
    """A wait for one write to ``fd``: poll + read (``poll``), level-triggered epoll + read (``epoll``), or
    edge-triggered epoll with the counter never read back (``epoll-et``, the lane client's wait)."""
    if how == "poll":
        p: Any = select.poll()
        p.register(fd, select.POLLIN)
    else:
        p = select.epoll()
        p.register(fd, select.EPOLLIN | (select.EPOLLET if how == "epoll-et" else 0))
    if how == "epoll-et":
        return lambda: p.poll(-1)

    def wait() -> None:
        p.poll(-1)
        os.eventfd_read(fd)
    return wait


def eventfd(iters: int, how: str = "poll") -> list[float]:
    a, b = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)
    pid = os.fork()
    if pid == 0:
        wait_a = _waiter(a, how)
        for _ in range(iters + 100):
            wait_a()
            os.eventfd_write(b, 1)
        os._exit(0)
    wait_b = _waiter(b, how)
    out = []
    for i in range(iters + 100):
        t0 = time.perf_counter()
        os.eventfd_write(a, 1)
        wait_b()
        if i >= 100:
            out.append(time.perf_counter() - t0)
    os.waitpid(pid, 0)
    for fd in (a, b):
        os.close(fd)
    return out


def calls(iters: int) -> dict[str, list[float]]:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://@floor-probe-{os.getpid()}")
    fds = [os.eventfd(0, os.EFD_NONBLOCK) for _ in range(3)]
    zp = zmq.Poller()
    zp.register(sock, zmq.POLLIN)
    for fd in fds:
        zp.register(fd, zmq.POLLIN)
    sp = select.poll()
    for fd in fds:
        sp.register(fd, select.POLLIN)
    nowaiter = os.eventfd(0, os.EFD_NONBLOCK)
    res: dict[str, list[float]] = {"eventfd_write, no waiter": [], "zmq.Poller.poll(0), socket + 3 fds": [],
                                   "select.poll(0), 3 fds": []}
    for _ in range(iters):
        t0 = time.perf_counter()
        os.eventfd_write(nowaiter, 1)
        t1 = time.perf_counter()
        zp.poll(0)
        t2 = time.perf_counter()
        sp.poll(0)
        t3 = time.perf_counter()
        res["eventfd_write, no waiter"].append(t1 - t0)
        res["zmq.Poller.poll(0), socket + 3 fds"].append(t2 - t1)
        res["select.poll(0), 3 fds"].append(t3 - t2)
    sock.close(0)
    ctx.term()
    for fd in [*fds, nowaiter]:
        os.close(fd)
    return res


def python_costs(iters: int) -> dict[str, list[float]]:
    import mmap
    import struct
    import threading

    import numpy as np

    class _O:
        def m(self, a: int, b: int) -> None:
            pass

    page = mmap.mmap(-1, 4096)
    mv = memoryview(page)
    header = struct.Struct("<IHIHI")
    x, y = np.ones(16, np.float32), np.ones(16, np.float32)
    lock, o, add, n = threading.Lock(), _O(), np.add, 1000

    def locked() -> None:
        with lock:
            pass

    pieces: dict[str, Any] = {
        "time.perf_counter()": time.perf_counter,
        "time.monotonic_ns()": time.monotonic_ns,
        "a Lock taken and let go (with), in a call": locked,
        "an empty method call, 2 arguments": lambda: o.m(1, 2),
        "a 16 B header unpacked from a memoryview": lambda: header.unpack_from(mv, 0),
        "368 B copied out of a memoryview (bytes)": lambda: bytes(mv[16:384]),
        "numpy.add of 16 float32 into its output": lambda: add(x, y, x),
    }
    empty = lambda: None  # noqa: E731 - what the lambda around each piece costs, taken off
    res: dict[str, list[float]] = {k: [] for k in pieces}
    for i in range(1 + max(5, iters // n)):  # the first round warms up and is not kept
        t0 = time.perf_counter()
        for _ in range(n):
            empty()
        base = (time.perf_counter() - t0) / n
        for k, fn in pieces.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            if i:
                res[k].append(max(0.0, (time.perf_counter() - t0) / n - base))
    mv.release()
    page.close()
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows: dict[str, list[float]] = {"round trip, spinning on a shared seq word": spin(args.iters),
                                    "round trip, blocking on eventfds": eventfd(args.iters),
                                    "the same, level-triggered epoll + read": eventfd(args.iters, "epoll"),
                                    "the same, edge-triggered epoll, no read": eventfd(args.iters, "epoll-et")}
    rows.update(calls(args.iters))
    rows.update(python_costs(args.iters * 5))
    table: dict[str, dict[str, float]] = {}
    print(f"{'what':<44} {'p50 µs':>8} {'p99 µs':>8}")
    for k, v in rows.items():
        table[k] = {"p50_us": round(_pct(v, 0.5), 2), "p99_us": round(_pct(v, 0.99), 2)}
        print(f"{k:<44} {table[k]['p50_us']:8.2f} {table[k]['p99_us']:8.2f}")
    if args.out:
        doc: dict[str, Any] = {"mode": "floor-probe", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "commit": os.environ.get("SHMRPC_COMMIT", "unknown"), "iters": args.iters,
                               "host": {"cores": os.cpu_count(), "python": platform.python_version(),
                                        "os": platform.platform()},
                               "command": " ".join(["python", "bench/gpu/floor_probe.py", *sys.argv[1:]]),
                               "results": table}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
