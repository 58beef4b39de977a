"""What one launched batch costs the host: ``CupyBackend.launch_batch`` in pieces, in process.

    python bench/gpu/batch_launch_probe.py [--batch 8] [--calls 2000] [--out FILE.json]

gemm x=16x256 @ w=256x256 float16 over B requests whose views are in page-locked memory (as the worker's
region is), served by a graph of gathered batches (``kernels/_cuda_gather.py``). Times, per call (µs,
median of ``--calls``): the whole ``launch_batch``, the device's part (spinning on ``done()`` from its
return), ``finish``; then the pieces of ``launch_batch`` alone: the plan checks, ``_prepare`` (each
request's remembered checks, the batch plan, the address columns), ``GatherGraphs.start`` and its
``finish`` inside the device scope, the device scope alone; last a cProfile of the whole, top by own time.
The items are the worker's ``ItemViews`` (``--pairs``: plain (inputs, outputs) pairs, checked view by view).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_probe import _gemm_views, timed  # noqa: E402


def med_us(fn: Callable[[], Any], n: int) -> float:
    """The median of ``n`` calls of ``fn`` after a warm-up (tiny_probe's ``timed``), in µs."""
    return float(np.median(timed(fn, n))) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--pairs", action="store_true",
                    help="items as plain (inputs, outputs) pairs, not as the worker's ItemViews")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import cupy as cp

    from shmrpc import kernels
    from shmrpc.kernels import _cupy_runs as runs
    from shmrpc.kernels._batch import batchable

    be: Any = kernels.select_backend("cupy")
    be.warmup()
    m, k, n, size = 16, 256, 256, args.batch
    plan = be.plan([kernels.StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "o"})],
                   {"x": kernels.TensorSpec((m, k), "float16"), "w": kernels.TensorSpec((k, n), "float16")}, ["o"])
    mem = cp.cuda.alloc_pinned_memory(size * (2 * (m * k + k * n + m * n) + 3 * 4096))
    items: list[Any] = _gemm_views(np.frombuffer(mem, np.uint8), size, m, k, n, np.random.default_rng(0))
    if not args.pairs:  # the worker's form: one ItemViews per slot's request, kept
        from shmrpc.kernels._backend_base import ItemViews
        items = [ItemViews(i, o) for i, o in items]
    gg = be._gather_graphs
    for _ in range(5):  # the gathered graph of (plan, B) captured
        h = be.launch_batch(plan, items)
        if h is None:
            be.run_batch(plan, items)
        else:
            h.finish()
    h = be.launch_batch(plan, items)
    assert h is not None, "no launched batch: the gathered graph was not captured"
    h.finish()
    cp.cuda.Device().synchronize()
    # the whole: launch, the device (spin on done()), finish
    launch_t, device_t, finish_t = [], [], []
    for i in range(args.calls + 50):
        t0 = time.perf_counter_ns()
        h = be.launch_batch(plan, items)
        t1 = time.perf_counter_ns()
        while not h.done():
            pass
        t2 = time.perf_counter_ns()
        h.finish()
        t3 = time.perf_counter_ns()
        if i >= 50:
            launch_t.append(t1 - t0)
            device_t.append(t2 - t1)
            finish_t.append(t3 - t2)
    rows: dict[str, float] = {
        "launch_batch": float(np.median(launch_t)) / 1e3,
        "device (spin on done)": float(np.median(device_t)) / 1e3,
        "finish": float(np.median(finish_t)) / 1e3,
    }
    rows["plan checks (eligible, plan_bytes, batchable)"] = med_us(
        lambda: (gg.eligible(plan), runs.plan_bytes(plan), batchable(plan)), args.calls)
    rows["_prepare"] = med_us(lambda: runs._prepare(be, plan, items, True), args.calls)
    rows["checked.item x B"] = med_us(lambda: [be._checked.item(plan, it, be._host_io) for it in items], args.calls)
    rows["_lookup_resident"] = med_us(lambda: be._lookup_resident(plan), args.calls)
    rows["_batch_plan"] = med_us(lambda: runs._batch_plan(be, plan, size), args.calls)
    got, resident, bp, addrs = runs._prepare(be, plan, items, True)
    rows["_columns"] = med_us(lambda: runs._columns(be, got), args.calls)

    def start_finish() -> None:
        with be._dev:
            s = gg.start(plan, bp, addrs, resident)
        s.finish()
    rows["GatherGraphs.start + finish (in the device scope)"] = med_us(start_finish, args.calls)

    def dev_scope() -> None:
        with be._dev:
            pass
    rows["device scope enter/exit"] = med_us(dev_scope, args.calls)
    from shmrpc.kernels._cuda_gather import _gather_key

    g = gg._claim(_gather_key(plan, bp, resident))
    if g is not None:
        try:
            rows["rows fill"] = med_us(lambda: g.fill(addrs), args.calls)

            def graph_launch() -> None:
                g.graph.launch(gg._sh.stream)
                g.event.record(gg._sh.stream)
                g.event.synchronize()
            rows["graph.launch + event record + synchronize"] = med_us(graph_launch, args.calls)

            def graph_launch_only() -> None:
                g.graph.launch(gg._sh.stream)
                g.event.record(gg._sh.stream)
            ts = []
            for _ in range(args.calls):
                t0 = time.perf_counter_ns()
                graph_launch_only()
                ts.append(time.perf_counter_ns() - t0)
                g.event.synchronize()
            rows["graph.launch + event record"] = float(np.median(ts)) / 1e3
        finally:
            g.pending = False
            g.lock.release()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(args.calls):
        be.launch_batch(plan, items).finish()
    pr.disable()
    text = io.StringIO()
    pstats.Stats(pr, stream=text).sort_stats("tottime").print_stats(28)
    print(f"B = {size}, gemm 16x256 @ 256x256 float16, items as {'pairs' if args.pairs else 'ItemViews'}, "
          f"µs per call (median of {args.calls}):")
    for key, v in rows.items():
        print(f"  {key:52} {v:8.2f}")
    prof = text.getvalue()
    print(prof[prof.find("ncalls"):][:5000])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": " ".join(sys.argv),
                       "commit": os.environ.get("SHMRPC_COMMIT", "unknown"), "cpu_count": os.cpu_count(),
                       "cupy": cp.__version__, "batch": size, "items": "pairs" if args.pairs else "ItemViews", "us": rows, "profile": prof}, f, indent=1)
    be.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
