"""`shmrpc serve --io-threads N`: the worker's libzmq context has N I/O threads, and several client processes
sending over ZeroMQ at once (their connections spread over those threads) each get their own answers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from .conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CLIENT = '''
import sys
import numpy as np
from shmrpc.client import Client

name, k, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with Client(name, timeout_s=30, lane=None) as c:
    assert c._t.lane is None
    for i in range(n):
        x = np.full(16, k * 1000 + i, np.float32)
        out = c.call("vector_add", x=x, y=np.ones(16, np.float32))["out"]
        assert (out == x + 1).all(), (k, i, out)
print("ok", k, n, flush=True)
'''


def _io_threads(pid: int, want: int) -> int:
    """How many libzmq I/O threads process ``pid`` runs (libzmq names them ZMQbg/IO/<n>), looked at until there are
    ``want`` or 10 s have passed (each thread names itself once it runs, which a loaded machine may delay)."""
    deadline = time.monotonic() + 10
    while True:
        names = []
        for t in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{t}/comm") as f:
                    names.append(f.read().strip())
            except FileNotFoundError:  # a thread that ended meanwhile
                pass
        n = sum(name.startswith("ZMQbg/IO/") for name in names)
        if n == want or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def test_the_default_is_one_io_thread(worker: WorkerProc) -> None:
    assert _io_threads(worker.pid, 1) == 1


def test_clients_over_several_io_threads_each_get_their_own_answers(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--io-threads", "3")
    assert _io_threads(w.pid, 3) == 3
    n = 300
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, w.name, str(k), str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for k in range(4)]
    try:
        for k, p in enumerate(procs):
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
            assert out.split() == ["ok", str(k), str(n)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    assert w.proc.poll() is None  # still serving
