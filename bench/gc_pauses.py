"""The worker's garbage-collector pauses under new call signatures, A/B between trees, rounds interleaved.

    python bench/gc_pauses.py --calls 20000 --rounds 4 --tree base=PATH --tree new= \\
        --out bench/results/gc-pauses-DATE-COMMIT.json

A worker's loop thread stops for every collection of CPython's garbage collector, and every client waits for it.
Steady calls allocate little, but a caller whose signatures change (a new attribute value every call, as in
``bench/new_signature.py``'s ``new_attr``) makes the worker plan and cache a request each time, and the caches'
turnover brings collections of the older generations, which walk every object the process holds. Per round and tree
(``--tree LABEL=PYTHONPATH``, empty: this checkout) a NumPy worker of that tree runs under a wrapper that has CPython
report each collection, and one client sends ``--calls`` ``call("scale", x=16 float32, a=<new>)``; the worker
reports, per generation, the collections and their pause in ms (total and longest), and the figures are the medians
over rounds. The pauses are CPython's own (``gc.DEBUG_STATS``, 0.1 ms resolution); only collections while the client
calls count (not the worker's start-up collection, where the tree makes one, nor those of its stop). On a machine
with fewer cores than busy threads a collection's elapsed time includes any time the thread was preempted: read the
longest pauses there as upper bounds, the totals and counts as the figures.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
from worker_cpu import ab_parser, ab_rounds, tree_env  # (bench/, beside this program)

# The worker under a wrapper: while the client calls (a file it is told of exists), CPython's
# own statistics of each collection (gc.DEBUG_STATS: the generation, then its elapsed time, measured in C around the
# collection) go to stderr. (Timing from gc.callbacks would count other threads too: the interpreter may hand the GIL
# over between a callback's bytecodes, for up to the 5 ms switch interval.)
_WRAPPER = r"""
import gc, os, sys
flag = sys.argv.pop(1)

def stats(phase, info):  # on while the flag file exists (the client's calls), off before and after
    if phase == "start":
        on = os.path.exists(flag)
        if on != bool(gc.get_debug()):
            gc.set_debug(gc.DEBUG_STATS if on else 0)

gc.callbacks.append(stats)
from shmrpc.server.cli import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


def _collections(err: str) -> dict[str, float]:
    """Per generation, the collections in ``err`` (gc.DEBUG_STATS lines), their total and longest pause in ms."""
    out = {f"gen{g}_{k}": 0.0 for g in "012" for k in ("n", "total_ms", "max_ms")}
    gen = None
    for ln in err.splitlines():
        if ln.startswith("gc: collecting generation "):
            gen = ln.split()[-1].rstrip(".")
        elif gen is not None and ln.startswith("gc: done") and ln.endswith("s elapsed"):
            ms = float(ln.rsplit(" ", 2)[-2].rstrip("s")) * 1e3
            out[f"gen{gen}_n"] += 1
            out[f"gen{gen}_total_ms"] = round(out[f"gen{gen}_total_ms"] + ms, 2)
            out[f"gen{gen}_max_ms"] = max(out[f"gen{gen}_max_ms"], ms)
            gen = None
    return out


def _one(pythonpath: str, calls: int) -> dict[str, float]:
    from shmrpc.client import Client

    name = f"gcp-{os.getpid()}-{secrets.token_hex(3)}"
    flag = os.path.join(tempfile.gettempdir(), f"{name}.go")
    # the statistics go to a file: a pipe read only at the end would fill and stall the worker mid-run
    with tempfile.TemporaryFile("w+") as log:
        worker = subprocess.Popen([sys.executable, "-c", _WRAPPER, flag, "--name", name, "--backend", "numpy",
                                   "--no-mlock", "--log-level", "WARNING", "--slots", "64K:16", "--lease", "4"],
                                  env=tree_env(pythonpath), stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            if worker.stdout is None or "ready" not in worker.stdout.readline():
                raise SystemExit(f"worker {name} did not start")
            x = np.arange(16, dtype=np.float32)
            with Client(name, timeout_s=30) as c:
                c.call("scale", x=x, a=0.5, b=0.0)
                open(flag, "w").close()
                t = time.perf_counter()
                for i in range(calls):
                    c.call("scale", x=x, a=float(i) + 1.5, b=0.0)
                wall_us = (time.perf_counter() - t) / calls * 1e6
                os.unlink(flag)  # (the collections of the client's BYE and the worker's stop are not counted)
            worker.send_signal(signal.SIGTERM)
            worker.communicate(timeout=30)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.communicate(timeout=10)
            if os.path.exists(flag):
                os.unlink(flag)
        log.seek(0)
        return {"new_attr_us": round(wall_us, 2), **_collections(log.read())}


def main() -> int:
    args = ab_parser(__doc__).parse_args()
    ab_rounds("gc-pauses", args.tree, args.rounds, args.calls, lambda _, path: _one(path, args.calls),
              "per run: µs per call, collections, ms", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
