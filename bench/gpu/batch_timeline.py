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

and per window (device, answer, after) the calls and the time of each wrapped method that began in it: the
requests received (_on_call), the finish's synchronize, the answers (_done_sent, _ok_sent), the metrics fold, the waits and
spins, the lane scans, lone and synchronous runs (a nested call counts in its caller too). Medians and quartiles
of each over the batches of the timed part (the bench's scaling loop, the last clients x iters requests), with
requests/s.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemm_profile import gemm_client_args, gemm_clients  # noqa: E402

_WORKER = r"""
import atexit, json, runpy, sys, time
stamps = []
_ns = time.perf_counter_ns
def wrap(cls, name, tag, size=None):
    f = getattr(cls, name, None)
    if f is None:  # a tree without it
        return
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
from shmrpc.server._dispatch import Launched
from shmrpc.server._lanes import Lanes
from shmrpc.server._loop import Worker
from shmrpc.server.metrics import Metrics
wrap(Launched, "finish", "G")
wrap(Runs, "_done_sent", "D")
wrap(Runs, "_ok_sent", "O")
wrap(Metrics, "fold", "M")
wrap(Worker, "_wait", "W")
wrap(Runs, "_spin", "S")
wrap(Lanes, "scan", "N")
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


_PARTS = {"C": "on_call", "G": "finish (synchronize)", "D": "done_sent", "O": "ok_sent", "M": "metrics fold", "W": "wait",
          "S": "spin", "N": "lanes scan", "X": "lone complete", "R": "run_batch"}


def analyse(stamps: list[list[int | str]]) -> dict[str, object]:
    """The steps of each launched batch, from the stamps (µs); per window (the answer, the gap after it), the time
    of each wrapped method whose call began in it (nested calls are counted in their caller too: _spin serves
    requests itself, _wait may spin)."""
    iv: dict[str, list[tuple[int, int, int]]] = {}
    opened: dict[str, list[tuple[int, int]]] = {}
    for t, tag, n in stamps:
        t, tag, n = int(t), str(tag), int(n)
        if tag.isupper():
            opened.setdefault(tag, []).append((t, n))
            continue
        stack = opened.get(tag.upper())
        if not stack:
            continue
        start = stack.pop()
        iv.setdefault(tag.upper(), []).append((start[0], t, start[1] if tag != "l" else start[1] * n))
    launches = [(s, e, b) for s, e, b in iv.get("L", []) if b]
    finishes = iv.get("F", [])
    rows = []
    fi = 0
    idx = {tag: 0 for tag in _PARTS}
    for i in range(len(launches) - 1):
        s0, e0, b = launches[i]
        s1 = launches[i + 1][0]
        while fi < len(finishes) and finishes[fi][0] < e0:
            fi += 1
        if fi >= len(finishes) or finishes[fi][0] > s1:
            continue
        f0, f1 = finishes[fi][0], finishes[fi][1]
        row: dict[str, float] = {"B": b, "launch": (e0 - s0) / 1e3, "device": (f0 - e0) / 1e3, "answer": (f1 - f0) / 1e3,
                                 "after": (s1 - f1) / 1e3, "cycle": (s1 - s0) / 1e3}
        for tag, name in _PARTS.items():
            lst = iv.get(tag, [])
            j = idx[tag]
            while j < len(lst) and lst[j][0] < e0:
                j += 1
            idx[tag] = j
            for win, (a, z) in (("device", (e0, f0)), ("answer", (f0, f1)), ("after", (f1, s1))):
                n_, t_ = 0, 0
                k = j
                while k < len(lst) and lst[k][0] < z:
                    if lst[k][0] >= a:
                        n_ += 1
                        t_ += lst[k][1] - lst[k][0]
                    k += 1
                if n_:
                    row[f"{win}: {name} (calls)"] = n_
                    row[f"{win}: {name} (us)"] = t_ / 1e3
        rows.append(row)
    out: dict[str, object] = {"batches": len(rows)}
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    for key in keys:
        out[key] = _q([float(r.get(key, 0.0)) for r in rows])
    out["on_call_us"] = _q([(e - s) / 1e3 for s, e, _ in iv.get("C", [])])
    out["lone_complete_us"] = _q([(e - s) / 1e3 for s, e, _ in iv.get("X", [])])
    out["run_batch_us"] = _q([(e - s) / 1e3 for s, e, _ in iv.get("R", [])])
    out["requests"] = len(iv.get("C", []))
    out["lone_runs"] = len(iv.get("X", []))
    out["launched_requests"] = sum(b for _, _, b in launches)
    return out


def main() -> int:
    ap = gemm_client_args(__doc__)
    ap.add_argument("--worker-args", default="", help="more arguments for shmrpc serve, space-separated")
    ap.add_argument("--out", default="bench/out/gpu/batch-timeline.json")
    args = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    stamps_path = args.out + ".stamps"
    bench, elapsed, rates = gemm_clients([sys.executable, "-c", _WORKER, stamps_path], "btl", args.transport,
                                         args.clients, args.iters, args.backend, args.out + ".bench.json",
                                         tuple(args.worker_args.split()))
    with open(stamps_path) as f:
        stamps = json.load(f)
    # the scaling loop is the bench's last part: its requests are the last clients x iters ones received
    want = args.clients * args.iters
    call_starts = [t for t, tag, _ in stamps if tag == "C"]
    skip_from = call_starts[-want] if len(call_starts) >= want else (stamps[0][0] if stamps else 0)
    timed = [s for s in stamps if s[0] >= skip_from]
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": os.environ.get("SHMRPC_COMMIT", "unknown"),
              "cpu_count": os.cpu_count(), "command": " ".join(sys.argv), "clients": args.clients, "transport": args.transport,
              "worker_args": args.worker_args, "bench_exit": bench.returncode, "elapsed_s": round(elapsed, 1),
              "requests_per_s": rates, "steps_us": analyse(timed)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    os.unlink(stamps_path)
    st = result["steps_us"]
    assert isinstance(st, dict)
    print(f"{args.transport} x{args.clients} {args.worker_args!r}: (requests/s, mean batch) {rates}")
    for key, v in st.items():
        if isinstance(v, dict) and v.get("n"):
            print(f"  {key:40} p25 {v['p25']:8.2f}  p50 {v['p50']:8.2f}  p75 {v['p75']:8.2f}  (n {v['n']})")
    print(f"  requests {st['requests']}, launched {st['launched_requests']}, lone runs {st['lone_runs']}")
    if bench.returncode:
        print(bench.stdout[-2000:], bench.stderr[-2000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
