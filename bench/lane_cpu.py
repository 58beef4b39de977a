"""What a 64 B request through a lane costs in CPU on each side and in time, A/B between trees, rounds interleaved.

    python bench/lane_cpu.py --calls 20000 --rounds 4 --tree base=PATH --tree new= [--cpus 2:10] \\
        --out bench/results/lane-cpu-2026-12-02.json

Per round and tree, a child process with that tree on ``PYTHONPATH`` (empty: this checkout) starts a worker
(``shmrpc serve``, NumPy backend, the same tree) and sends ``--calls`` 64 B in-place ``vector_add`` round trips from
one loan, through a blocking lane (``--lane block``, the default) or a spinning one, after 500 to warm up. It reads
its own user+system CPU seconds (``getrusage``, all its threads) and the worker's (``/proc/<pid>/stat``) before
and after, and times each round trip. ``--cpus S:C`` pins the worker to CPU S and the client to CPU C. Printed and
written: the client's and the worker's CPU µs per request and the p50 round trip, medians over the rounds. A
change that moves a wake-up moves the round trip and where the CPU goes; this says both, on the same requests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from worker_cpu import ab_parser, ab_rounds, tree_env  # (bench/, beside this program)

_CHILD = r"""
import json, os, resource, secrets, signal, statistics, sys, time
import numpy as np
from shmrpc.client import Client

calls, lane, cpus = int(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, sys.argv[4])  # bench/, for worker_cpu.start_worker
from worker_cpu import start_worker
tick = 1.0 / os.sysconf("SC_CLK_TCK")


def worker_cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * tick


def own_cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


name = f"lcpu-{os.getpid()}-{secrets.token_hex(3)}"
w = start_worker(name)
try:
    if cpus:
        s, c = cpus.split(":")
        os.sched_setaffinity(w.pid, {int(s)})
        os.sched_setaffinity(0, {int(c)})
    with Client(name, timeout_s=30, lane=lane) as cl, cl.loan(4096) as req:
        x = np.arange(16, dtype=np.float32)
        req.array("x", (16,), np.float32)[...] = x
        req.array("y", (16,), np.float32)[...] = x
        for _ in range(500):
            req.send("vector_add", in_place=True)
        times = [0.0] * calls
        clock = time.perf_counter
        c0, w0 = own_cpu(), worker_cpu(w.pid)
        for i in range(calls):
            t0 = clock()
            req.send("vector_add", in_place=True)
            times[i] = clock() - t0
        c1, w1 = own_cpu(), worker_cpu(w.pid)
    print(json.dumps({"client_cpu_us": (c1 - c0) / calls * 1e6, "worker_cpu_us": (w1 - w0) / calls * 1e6,
                      "p50_us": statistics.median(times) * 1e6}))
finally:
    w.send_signal(signal.SIGTERM)
    w.communicate(timeout=30)
"""


def _one(label: str, pythonpath: str, calls: int, lane: str, cpus: str) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(calls), lane, cpus, os.path.dirname(os.path.abspath(__file__))],
                          env=tree_env(pythonpath),
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{label}: the child failed:\n{proc.stderr}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def main() -> int:
    ap = ab_parser(__doc__)
    ap.add_argument("--lane", choices=("block", "spin"), default="block")
    ap.add_argument("--cpus", default="", metavar="S:C", help="pin the worker to CPU S and the client to CPU C")
    args = ap.parse_args()
    ab_rounds(f"lane-cpu-{args.lane}", args.tree, args.rounds, args.calls,
              lambda label, path: _one(label, path, args.calls, args.lane, args.cpus), "µs per request", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
