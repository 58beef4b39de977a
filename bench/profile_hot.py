"""Profile the small-request hot path: a worker under cProfile and a client loop under cProfile.

    python bench/profile_hot.py --calls 20000 --out bench/out/profile

Starts ``shmrpc serve`` (NumPy backend) under ``python -m cProfile``, runs ``--calls`` 64 B
``vector_add`` loan round trips (and ``call()`` ones) in this process under cProfile, stops the
worker with SIGTERM and prints both profiles' top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import secrets
import signal
import subprocess
import sys
import time

import numpy as np


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--out", default="bench/out/profile")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--lane", choices=("block", "spin"), help="the client asks for a lane (Client(lane=...))")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    name = f"prof-{os.getpid()}-{secrets.token_hex(3)}"
    wprof = os.path.join(args.out, "worker.prof")
    worker = subprocess.Popen([sys.executable, "-m", "cProfile", "-o", wprof, "-m", "shmrpc.server", "serve",
                               "--name", name, "--backend", "numpy", "--no-mlock", "--log-level", "WARNING", *(["--spin-us", "200"] if args.lane == "spin" else [])])
    from shmrpc.client import Client
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                c = Client(name, connect_timeout_s=1.0, **({"lane": args.lane} if args.lane else {}))
                break
            except Exception:
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise
                time.sleep(0.05)
        with c:
            x = np.arange(16, dtype=np.float32)
            prof = cProfile.Profile()
            with c.loan(4096) as req:
                req.array("x", (16,), np.float32)[...] = x
                req.array("y", (16,), np.float32)[...] = x
                for _ in range(200):
                    req.send("vector_add", in_place=True)
                t0 = time.perf_counter()
                prof.enable()
                for _ in range(args.calls):
                    req.send("vector_add", in_place=True)
                prof.disable()
                loan_us = (time.perf_counter() - t0) / args.calls * 1e6
            prof.dump_stats(os.path.join(args.out, "client-loan.prof"))
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.enable()
            for _ in range(args.calls // 2):
                c.call("vector_add", x=x, y=x)
            prof.disable()
            call_us = (time.perf_counter() - t0) / (args.calls // 2) * 1e6
            prof.dump_stats(os.path.join(args.out, "client-call.prof"))
    finally:
        worker.send_signal(signal.SIGINT)
        worker.wait(30)
    print(f"mean under the profiler: loan {loan_us:.1f} µs, call {call_us:.1f} µs per round trip")
    summary(wprof, os.path.join(args.out, "client-loan.prof"), args.calls)
    for label, path in (("worker", wprof), ("client loan", os.path.join(args.out, "client-loan.prof")),
                        ("client call", os.path.join(args.out, "client-call.prof"))):
        print(f"\n===== {label}: top {args.top} by own time")
        pstats.Stats(path).sort_stats("tottime").print_stats(args.top)
    return 0


#: (label, file suffix, function name): the steps of the hot path whose cumulative time per request is summarised
_STEPS = (
    ("worker: wait for a wake-up (poll)", "server/_poll.py", "poll"),
    ("worker: one CALL, doorbell to DONE sent", "server/_calls.py", "_on_call"),
    ("worker:   decode + validate + plan (cache misses)", "server/_dispatch.py", "prepare"),
    ("worker:   run the op (views, backend)", "server/_dispatch.py", "run"),
    ("worker:   metrics, DONE, lease end", "server/_runs.py", "_done_sent"),
    ("worker:   ZeroMQ send", "zmq/sugar/socket.py", "send_multipart"),
    ("client: write descriptor + header, ring", "client/_loan.py", "_post"),
    ("client: wait for the answer", "client/_loan.py", "_wait"),
    ("client: read the response", "client/_loan.py", "_response"),
)


def summary(worker_prof: str, client_prof: str, calls: int) -> None:
    """Per-request cumulative µs of the hot path's steps (under the profiler: inflated, compare between runs)."""
    print(f"\n===== per request (cumulative µs under cProfile, {calls} loan round trips)")
    stats = {"worker": pstats.Stats(worker_prof).stats, "client": pstats.Stats(client_prof).stats}  # type: ignore[attr-defined]
    for label, suffix, func in _STEPS:
        side = stats["worker" if label.startswith("worker") else "client"]
        hits = [(v[1], v[3]) for (path, _, name), v in side.items() if name == func and path.endswith(suffix)]
        if not hits:
            print(f"  {label:<52} -")
            continue
        n, cum = max(hits)
        print(f"  {label:<52} {cum / max(1, n) * 1e6:8.1f} µs x {n}")


if __name__ == "__main__":
    sys.exit(main())
