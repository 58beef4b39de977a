"""Which end of a request got slower between two trees: the worker of one tree, the clients of another.

    python3 bench/gpu/mixed_trees.py --pair bb=SITE_A:SITE_A --pair ab=SITE_B:SITE_A \\
        --pair ba=SITE_A:SITE_B --pair aa=SITE_B:SITE_B --clients 8 --calls 2000 --rounds 3 --out FILE.json

Each ``--pair LABEL=WORKER_SITE:CLIENT_SITE`` starts ``shmrpc serve`` with ``WORKER_SITE`` first on its
``PYTHONPATH`` and ``--clients`` client processes with ``CLIENT_SITE`` first (the rest of this process's
``PYTHONPATH`` follows both: pyzmq, posix_ipc). Every client fills one loan with a ``gemm`` of
16x256 @ 256x256 (``--dtype``), sends it 300 times, waits for the others, then sends it ``--calls``
times over ZeroMQ. Per pair and round: requests per second of all clients together, and the CPU the
worker and the clients spent per request (``/proc``, all threads). Rounds alternate the pairs' order.
The two trees must speak one protocol (a client of another protocol is refused at HELLO).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

_CLIENT = r"""
import sys, time
import numpy as np
from shmrpc.client import Client
name, calls, dt = sys.argv[1], int(sys.argv[2]), np.dtype(sys.argv[3])
with Client(name, timeout_s=60) as c:
    with c.loan(2 * (16 * 256 + 256 * 256) * dt.itemsize + 16384) as req:
        req.array("x", (16, 256), dt)[...] = 1
        req.array("w", (256, 256), dt)[...] = 1
        for _ in range(300):
            req.send("gemm")
        sys.stdout.write("ready\n"); sys.stdout.flush(); sys.stdin.readline()
        p = time.process_time()
        for _ in range(calls):
            req.send("gemm")
        print(time.process_time() - p)
"""


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _one(wsite: str, csite: str, a: argparse.Namespace) -> dict[str, float]:
    rest = os.environ.get("PYTHONPATH", "")
    name = f"mixed-{os.getpid()}-{secrets.token_hex(3)}"
    worker = subprocess.Popen(
        [sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--backend", a.backend, "--no-mlock",
         "--log-level", "WARNING", "--max-clients-per-uid", str(a.clients + 4)],
        env=dict(os.environ, PYTHONPATH=f"{wsite}:{rest}"), stdout=subprocess.PIPE, text=True)
    clients: list[subprocess.Popen[str]] = []
    try:
        if worker.stdout is None or "ready" not in worker.stdout.readline():
            raise SystemExit("the worker did not start")
        clients = [subprocess.Popen([sys.executable, "-c", _CLIENT, name, str(a.calls), a.dtype],
                                    env=dict(os.environ, PYTHONPATH=f"{csite}:{rest}"), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True) for _ in range(a.clients)]
        for c in clients:
            if c.stdout is None or c.stdout.readline().strip() != "ready":
                raise SystemExit("a client did not get ready")
        w0, t0 = _cpu_s(worker.pid), time.perf_counter()
        for c in clients:
            assert c.stdin is not None
            c.stdin.write("go\n")
            c.stdin.flush()
        spent = [float(c.stdout.readline()) for c in clients if c.stdout is not None]
        t1, w1 = time.perf_counter(), _cpu_s(worker.pid)
        n = a.clients * a.calls
        return {"rps": n / (t1 - t0), "worker_cpu_us": (w1 - w0) / n * 1e6, "client_cpu_us": sum(spent) / n * 1e6}
    finally:
        for c in clients:  # done after their figure: they close their client; stuck ones are killed
            try:
                c.wait(10)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait(30)
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", action="append", required=True, help="LABEL=WORKER_SITE:CLIENT_SITE")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="cupy")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--out")
    a = ap.parse_args()
    pairs = [(p.split("=", 1)[0], *p.split("=", 1)[1].split(":", 1)) for p in a.pair]
    rounds: dict[str, list[dict[str, float]]] = {p[0]: [] for p in pairs}
    for r in range(a.rounds):
        for label, wsite, csite in pairs if r % 2 == 0 else pairs[::-1]:
            row = _one(wsite, csite, a)
            rounds[label].append(row)
            print(r, label, " ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    medians = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in rounds.items()}
    for k, v in medians.items():
        print(f"{k:<12} median " + " ".join(f"{m} {x:.1f}" for m, x in v.items()))
    if a.out:
        from shmrpc.bench._report import write_probe

        write_probe({"mode": "mixed-trees", "config": {k: v for k, v in vars(a).items() if k != "out"},
                     "rounds": rounds, "medians": medians}, None, a.out)


if __name__ == "__main__":
    main()
