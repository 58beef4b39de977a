"""AsyncClient under load, A/B in one run: the event loop's lag and calls/s with 1 000 calls in flight.

Each variant runs ``shmrpc bench async``'s loaded phase (64 B ``echo``, tasks each awaiting one call
after another, a 1 ms ticker measuring how late the loop wakes it) against the same NumPy worker, the
variants interleaved round by round so the machine's noise falls on all of them alike; the JSON keeps
every run and the medians. Variants:

- ``wrap_future,bN``: the asyncio future finished through ``asyncio.wrap_future`` (a
  ``call_soon_threadsafe`` per answer: a write to the loop's self-pipe and one more turn), N answers
  routed per turn of the loop (the client before the direct finish);
- ``direct,bN``: the client as shipped (``AsyncClient._bridge`` finishes the asyncio future on the
  loop's thread), N answers per turn.

Usage::

    .venv/bin/python bench/async_loop_ab.py --rounds 5 --out bench/results/bench-async-cpu-2026-11-30-loop-ab.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import sys
from typing import Any

from shmrpc.bench._concurrency import _shmrpc_async
from shmrpc.bench._report import machine_facts
from shmrpc.bench._shm import WorkerProcess, plan_slots
from shmrpc.client import AsyncClient

__all__ = ["main"]

_DIRECT = AsyncClient._bridge


def _wrap_future(self: AsyncClient, fut: Any, loop: asyncio.AbstractEventLoop) -> Any:
    return asyncio.wrap_future(fut, loop=loop)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="wrap_future,b4;direct,b4;direct,b2")
    ap.add_argument("--in-flight", type=int, default=1000)
    ap.add_argument("--total", type=int, default=20000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    variants = args.variants.split(";")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    plan = plan_slots([64], min(args.in_flight, 1024), 1)
    with WorkerProcess(plan, "numpy") as w:
        w.wait_ready()
        for r in range(args.rounds):
            for v in variants:
                how, batch = v.split(",")
                AsyncClient._bridge = _DIRECT if how == "direct" else _wrap_future  # type: ignore[method-assign]
                row = asyncio.run(_shmrpc_async(w.name, 64, 500, args.in_flight, args.total,
                                                route_batch=int(batch.lstrip("b"))))
                runs[v].append(row)
                lag = row["loop_lag_us"]
                print(f"round {r} {v:16s} lag p50 {lag['p50']:8.0f} µs  p99 {lag['p99']:8.0f} µs  "
                      f"{row['calls_per_s']:8.0f} calls/s", flush=True)
    AsyncClient._bridge = _DIRECT  # type: ignore[method-assign]
    medians = {v: {"loop_lag_p50_us": statistics.median(x["loop_lag_us"]["p50"] for x in rs),
                   "loop_lag_p99_us": statistics.median(x["loop_lag_us"]["p99"] for x in rs),
                   "calls_per_s": statistics.median(x["calls_per_s"] for x in rs),
                   "rtt_p50_us": statistics.median(x["rtt_us"]["p50"] for x in rs)} for v, rs in runs.items()}
    print(json.dumps(medians, indent=1))
    doc = {"mode": "async-loop-ab", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "command": "python bench/async_loop_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "machine": machine_facts(), "load_average": os.getloadavg(),
           "config": {"rounds": args.rounds, "in_flight": args.in_flight, "total": args.total, "nbytes": 64,
                      "backend": "numpy"},
           "medians": medians, "runs": runs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print("JSON:", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
