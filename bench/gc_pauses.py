"""The worker's garbage-collector pauses under new call signatures, A/B between trees, rounds interleaved.

    python bench/gc_pauses.py --calls 20000 --rounds 4 --tree base=PATH --tree new= \\
        --out bench/results/gc-pauses-DATE-COMMIT.json

A worker's loop thread stops for every collection of CPython's garbage collector, and every client waits for it.
Steady calls allocate little, but a caller whose signatures change (a new attribute value every call, as in
``bench/new_signature.py``'s ``new_attr``) makes the worker plan and cache a request each time, and the caches'
turnover brings collections of the older generations, which walk every object the process holds. Per round and tree
(``--tree LABEL=PYTHONPATH``, empty: this checkout) a NumPy worker of that tree runs under a wrapper that times each
collection (``gc.callbacks``), and one client sends ``--calls`` ``call("scale", x=16 float32, a=<new>)``; the worker
reports, per generation, the collections and their pause in ms (total and longest), and the figures are the medians
over rounds. The worker's own start-up collection (``gc.collect()`` before it serves, where the tree makes one) is
left out: only collections while the client calls count.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from worker_cpu import ab_parser, ab_rounds, tree_env  # (bench/, beside this program)

# The worker under a wrapper: gc.callbacks time every collection from the moment the client starts (a file it is
# told of appears) to SIGTERM, and the figures go to stderr as one JSON line at exit.
_WRAPPER = r"""
import atexit, gc, json, os, sys, time
flag = sys.argv.pop(1)
figures = {g: {"n": 0, "total_ms": 0.0, "max_ms": 0.0} for g in ("0", "1", "2")}
t0 = [0.0]

def timed(phase, info):
    if phase == "start":
        t0[0] = time.perf_counter()
        return
    if not os.path.exists(flag):  # start-up: not counted
        return
    ms = (time.perf_counter() - t0[0]) * 1e3
    f = figures[str(info["generation"])]
    f["n"] += 1
    f["total_ms"] += ms
    f["max_ms"] = max(f["max_ms"], ms)

gc.callbacks.append(timed)
atexit.register(lambda: print("GC " + json.dumps(figures), file=sys.stderr, flush=True))
from shmrpc.server.cli import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def _one(pythonpath: str, calls: int) -> dict[str, float]:
    from shmrpc.client import Client

    name = f"gcp-{os.getpid()}-{secrets.token_hex(3)}"
    flag = os.path.join(tempfile.gettempdir(), f"{name}.go")
    worker = subprocess.Popen([sys.executable, "-c", _WRAPPER, flag, "--name", name, "--backend", "numpy", "--no-mlock",
                               "--log-level", "WARNING", "--slots", "64K:16", "--lease", "4"],
                              env=tree_env(pythonpath), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if worker.stdout is None or "ready" not in worker.stdout.readline():
            raise SystemExit(f"worker {name} did not start: {worker.communicate(timeout=10)}")
        x = np.arange(16, dtype=np.float32)
        with Client(name, timeout_s=30) as c:
            c.call("scale", x=x, a=0.5, b=0.0)
            open(flag, "w").close()
            t = time.perf_counter()
            for i in range(calls):
                c.call("scale", x=x, a=float(i) + 1.5, b=0.0)
            wall_us = (time.perf_counter() - t) / calls * 1e6
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.communicate(timeout=10)
        if os.path.exists(flag):
            os.unlink(flag)
    line = next(ln for ln in err.splitlines() if ln.startswith("GC "))
    figures = json.loads(line[3:])
    out: dict[str, float] = {"new_attr_us": round(wall_us, 2)}
    for g, f in figures.items():
        out[f"gen{g}_n"] = f["n"]
        out[f"gen{g}_total_ms"] = round(f["total_ms"], 2)
        out[f"gen{g}_max_ms"] = round(f["max_ms"], 2)
    return out


def main() -> int:
    args = ab_parser(__doc__).parse_args()
    ab_rounds("gc-pauses", args.tree, args.rounds, args.calls, lambda _, path: _one(path, args.calls),
              "per run: µs per call, collections, ms", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
