"""Where an event loop's turns go while ``AsyncClient`` has 1 000 calls in flight: time per handle kind.

Wraps ``asyncio.Handle._run`` and the loop's ``_run_once`` with a timer (CPython's pure-Python loop)
and runs ``shmrpc bench async``'s loaded phase (64 B ``echo``) against a NumPy worker it starts;
prints, and writes as JSON, per kind of callback its count, mean and max, and the turns' lengths.
The timers add their own cost: compare kinds with each other, not with unprofiled runs.

Usage::

    .venv/bin/python bench/async_loop_profile.py --out bench/results/bench-async-cpu-2026-11-30-loop-profile.json
"""

from __future__ import annotations

import argparse
import asyncio
import asyncio.base_events as base_events
import asyncio.events as events
import collections
import datetime as dt
import json
import os
import sys
import time
from typing import Any

from shmrpc.bench._concurrency import _shmrpc_async
from shmrpc.bench._report import machine_facts
from shmrpc.bench._shm import WorkerProcess, plan_slots

__all__ = ["main"]


def _kind(cb: Any) -> str:
    name = getattr(cb, "__qualname__", None)
    if name is None:
        name = type(getattr(cb, "__self__", cb)).__name__ + "." + getattr(cb, "__name__", "?")
    return str(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", type=int, default=20000)
    ap.add_argument("--in-flight", type=int, default=1000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stats: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    turns: list[float] = []
    run, once = events.Handle._run, base_events.BaseEventLoop._run_once

    def timed_run(self: events.Handle) -> None:
        t0 = time.perf_counter()
        run(self)
        s = stats[_kind(self._callback)]  # type: ignore[attr-defined]
        dt_s = time.perf_counter() - t0
        s[0] += 1
        s[1] += dt_s
        s[2] = max(s[2], dt_s)

    def timed_once(self: base_events.BaseEventLoop) -> None:
        t0 = time.perf_counter()
        once(self)  # type: ignore[attr-defined]
        turns.append(time.perf_counter() - t0)

    events.Handle._run = timed_run  # type: ignore[method-assign]
    base_events.BaseEventLoop._run_once = timed_once  # type: ignore[attr-defined]
    try:
        with WorkerProcess(plan_slots([64], min(args.in_flight, 1024), 1), "numpy") as w:
            w.wait_ready()
            row = asyncio.run(_shmrpc_async(w.name, 64, 200, args.in_flight, args.total))
    finally:
        events.Handle._run = run  # type: ignore[method-assign]
        base_events.BaseEventLoop._run_once = once  # type: ignore[attr-defined]
    kinds = {k: {"count": int(n), "mean_us": tot / n * 1e6, "max_us": mx * 1e6}
             for k, (n, tot, mx) in sorted(stats.items(), key=lambda kv: -kv[1][1])[:12]}
    ts = sorted(turns)
    turn_us = {"count": len(ts), "p50": ts[len(ts) // 2] * 1e6, "p99": ts[int(len(ts) * 0.99)] * 1e6,
               "max": ts[-1] * 1e6}
    for k, v in kinds.items():
        print(f"{k[:56]:56s} n={v['count']:7d} mean={v['mean_us']:8.1f} µs max={v['max_us']:9.1f} µs")
    print("turns (µs):", {k: round(v) for k, v in turn_us.items()})
    doc = {"mode": "async-loop-profile", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python bench/async_loop_profile.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine_facts(), "load_average": os.getloadavg(),
           "config": {"in_flight": args.in_flight, "total": args.total, "nbytes": 64, "backend": "numpy"},
           "handles": kinds, "turn_us": turn_us, "loaded": {k: row[k] for k in ("calls_per_s", "loop_lag_us")}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print("JSON:", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
