"""Where a batch's turn goes in the worker under many small same-shape requests: the loop's steps stamped.

    python bench/gpu/batch_timeline.py --clients 8 --transport shmrpc-lane-spin --out bench/out/gpu/batch-timeline.json

Starts a CuPy worker (``shmrpc serve``, the arguments of ``gemm_profile.py``) in a process whose loop methods
are wrapped to stamp their start and end (``time.perf_counter_ns``, a list append each: well under a µs, unlike
cProfile), runs ``shmrpc bench lat`` against it (``--clients`` processes of gemm x=16x256 @ w=256x256 float16,
x and w sent with every request), stops the worker with SIGTERM and reads the stamps it wrote at exit.

Per launched batch (``Dispatcher.launch_batch`` answered a handle) the steps from one launch to the next:

    launch      launch_batch's own time (checks, rows, graph launch)
    device      from the launch's return to the loop's finish of it (the device's work, and the loop's delay in
                noticing it: it reads the lanes meanwhile)
    answer      _finish_launched: the finish (a synchronize that should find the event done) and the answers
    after       from the answers' end to the next launch (requests received, a lone request run, the turn's end)
    in after    the requests received (_on_call), their time, and the lone or synchronous runs in that gap

Medians and quartiles of each over the batches of the timed part (the bench's scaling loop), with requests/s.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time

_WORKER = r"""
import atexit, json, runpy, sys, time
stamps = []
_ns = time.perf_counter_ns
def wrap(cls, name, tag, size=None):
    f = getattr(cls, name)
    def w(self, *a, **k):
        stamps.append((_ns(), tag, size(self, a) if size else 0))
        r = None
        try:
            r = f(self, *a, **k)
            return r
        finally:
            stamps.append((_ns(), tag.lower(), int(r is not None)))
    setattr(cls, name, w)
from shmrpc.server._runs import Runs
from shmrpc.server._calls import Calls
from shmrpc.server._dispatch import Dispatcher
wrap(Calls, "_on_call", "C")
wrap(Runs, "_run_pending", "P", lambda s, a: len(s._pending))
wrap(Runs, "_finish_launched", "F")
wrap(Runs, "_complete", "X")
wrap(Dispatcher, "launch_batch", "L", lambda s, a: len(a[1]))
wrap(Dispatcher, "run_batch", "R", lambda s, a: len(a[1]))
out = sys.argv.pop(1)
atexit.register(lambda: json.dump(stamps, open(out, "w")))
sys.argv[0] = "shmrpc"
runpy.run_module("shmrpc.server", run_name="__main__")
"""


def _q(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    return {"n": len(xs), "p25": round(xs[len(xs) // 4], 2), "p50": round(statistics.median(xs), 2),
            "p75": round(xs[3 * len(xs) // 4], 2)}


def analyse(stamps: list[list[int | str]], skip_s: float) -> dict[str, object]:
    """The steps of each launched batch, from the stamps (µs)."""
    t_first = stamps[0][0] if stamps else 0
    ev = [(int(t), str(tag), int(n)) for t, tag, n in stamps if int(t) - int(t_first) >= skip_s * 1e9]
    launches = []  # (start, end, B)
    finishes = []  # (start, end)
    calls = []  # (start, end)
    syncs = []  # (start, end, kind, B)
    opened: dict[str, tuple[int, int]] = {}
    for t, tag, n in ev:
        if tag.isupper():
            opened[tag] = (t, n)
            continue
        start = opened.pop(tag.upper(), None)
        if start is None:
            continue
        if tag == "l" and n:
            launches.append((start[0], t, start[1]))
        elif tag == "f":
            finishes.append((start[0], t))
        elif tag == "c":
            calls.append((start[0], t))
        elif tag == "r":
            syncs.append((start[0], t, "run_batch", start[1]))
        elif tag == "x":
            syncs.append((start[0], t, "complete", 1))
    rows = []
    fi = ci = si = 0
    for i in range(len(launches) - 1):
        s0, e0, b = launches[i]
        s1 = launches[i + 1][0]
        while fi < len(finishes) and finishes[fi][0] < e0:
            fi += 1
        if fi >= len(finishes) or finishes[fi][0] > s1:
            continue
        f0, f1 = finishes[fi]
        while ci < len(calls) and calls[ci][0] < f1:
            ci += 1
        n_calls, t_calls = 0, 0
        j = ci
        while j < len(calls) and calls[j][0] < s1:
            n_calls += 1
            t_calls += calls[j][1] - calls[j][0]
            j += 1
        while si < len(syncs) and syncs[si][0] < f1:
            si += 1
        n_sync, t_sync = 0, 0
        k = si
        while k < len(syncs) and syncs[k][0] < s1:
            if syncs[k][2] == "run_batch" or syncs[k][3] == 1:
                n_sync += 1
                t_sync += syncs[k][1] - syncs[k][0]
            k += 1
        rows.append({"B": b, "launch": (e0 - s0) / 1e3, "device": (f0 - e0) / 1e3, "answer": (f1 - f0) / 1e3,
                     "after": (s1 - f1) / 1e3, "cycle": (s1 - s0) / 1e3, "calls_after": n_calls,
                     "calls_after_us": t_calls / 1e3, "sync_after": n_sync, "sync_after_us": t_sync / 1e3})
    out: dict[str, object] = {"batches": len(rows)}
    for key in ("B", "launch", "device", "answer", "after", "cycle", "calls_after", "calls_after_us", "sync_after",
                "sync_after_us"):
        out[key] = _q([float(r[key]) for r in rows])  # type: ignore[arg-type]
    call_us = [(e - s) / 1e3 for s, e in calls]
    out["on_call_us"] = _q(call_us)
    out["lone_complete_us"] = _q([(e - s) / 1e3 for s, e, kind, _ in syncs if kind == "complete"])
    out["run_batch_us"] = _q([(e - s) / 1e3 for s, e, kind, _ in syncs if kind == "run_batch"])
    out["requests"] = len(calls)
    out["lone_runs"] = sum(1 for s in syncs if s[2] == "complete")
    out["launched_requests"] = sum(b for _, _, b in launches)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--transport", default="shmrpc-lane-spin")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--backend", default="cupy")
    ap.add_argument("--worker-args", default="", help="more arguments for shmrpc serve, space-separated")
    ap.add_argument("--skip-s", type=float, default=0.0, help="leave out the stamps of the first seconds")
    ap.add_argument("--out", default="bench/out/gpu/batch-timeline.json")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    name = f"btl-{os.getpid()}-{secrets.token_hex(3)}"
    stamps_path = args.out + ".stamps"
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, stamps_path, "serve", "--name", name, "--backend",
                               args.backend, "--log-level", "WARNING", "--slots", "1M:64", "--lease", "4",
                               "--max-clients-per-uid", "20", *args.worker_args.split()],
                              stdout=subprocess.PIPE, text=True)
    bench_json = args.out + ".bench.json"
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()
        if "ready" not in line:
            raise SystemExit(f"the worker did not start: {line!r}")
        t0 = time.monotonic()
        bench = subprocess.run([sys.executable, "-m", "shmrpc.bench", "lat", "--name", name,
                                "--transports", args.transport, "--clients", str(args.clients),
                                "--iters", str(args.iters), "--warmup", "50", "--backend", args.backend,
                                "--op", "gemm", "--shape", "x=16x256", "--shape", "w=256x256",
                                "--dtype", "float16", "-q", "--out", bench_json],
                               capture_output=True, text=True, timeout=240)
        elapsed = time.monotonic() - t0
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    rates = {}
    with open(bench_json) as f:
        for r in json.load(f).get("scaling", []):
            rates[f"{r['transport']} x{r['clients']}"] = (round(r["calls_per_s"]), r.get("worker", {}).get("mean_batch"))
    with open(stamps_path) as f:
        stamps = json.load(f)
    # the scaling loop is the bench's last part: its requests are the last clients x iters ones received
    want = args.clients * args.iters
    call_starts = [t for t, tag, _ in stamps if tag == "C"]
    skip_from = call_starts[-want] if len(call_starts) >= want else (stamps[0][0] if stamps else 0)
    timed = [s for s in stamps if s[0] >= skip_from]
    result = {"command": " ".join(sys.argv), "clients": args.clients, "transport": args.transport,
              "worker_args": args.worker_args, "bench_exit": bench.returncode, "elapsed_s": round(elapsed, 1),
              "requests_per_s": rates, "steps_us": analyse(timed, args.skip_s)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    os.unlink(stamps_path)
    st = result["steps_us"]
    assert isinstance(st, dict)
    print(f"{args.transport} x{args.clients} {args.worker_args!r}: (requests/s, mean batch) {rates}")
    for key in ("B", "launch", "device", "answer", "after", "cycle", "calls_after", "calls_after_us", "sync_after",
                "sync_after_us", "on_call_us", "lone_complete_us", "run_batch_us"):
        print(f"  {key:16} {st[key]}")
    print(f"  requests {st['requests']}, launched {st['launched_requests']}, lone runs {st['lone_runs']}")
    if bench.returncode:
        print(bench.stdout[-2000:], bench.stderr[-2000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
