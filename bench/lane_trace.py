"""Where a lane's round trip goes: timestamps on both sides, one client, one worker.

    python bench/lane_trace.py [--calls 20000] [--lane spin|block] [--worker-spin-us N] [--call] [--out FILE.json]

Starts a NumPy worker (in a child process whose loop is instrumented; with ``--lane spin`` it spins
200 µs, ``--spin-us 200``, with ``--lane block`` it does not spin; ``--worker-spin-us`` sets it, e.g. 0 for a spinning
client next to a worker that only lingers, as ``shmrpc bench``'s spinning lane without ``--spin-us``) and a
``Client(lane=...)`` in this
process, sends ``--calls`` 64 B in-place ``vector_add`` loan round trips (``--call``: ``call()``s, inputs copied in
and the output copied out; "send" below is then the call) and stamps, with
``time.perf_counter`` (CLOCK_MONOTONIC: comparable between the processes): the client's ``send``
entry, its ring, the worker's lane scan that took the request, its ``_on_call`` entry, the DONE
written into the page, the client seeing it, ``send``'s return, and the worker's next wait after the
DONE (the loop's tail: where the client is woken on the worker's core, part of the next round trip).
Prints the median of each interval and of the round trip over the last 5 000 calls and writes them to
``--out``. The stamps cost a little themselves: compare runs of this script, not its figures with
untraced round trips. Run it with another tree's ``PYTHONPATH`` to trace that tree.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

# The end of a traced worker's program (``w``: its Worker, ``T``: its stamps): serve in a thread, say "ready", and on a
# line from stdin write the stamps to argv[2], say "done" and close (its sockets and regions go with it).
SERVE_STAMPED = '''
w.start()
t = threading.Thread(target=w.serve_forever, daemon=True)
t.start()
print("ready", flush=True)
sys.stdin.readline()
with open(sys.argv[2], "w") as f:
    json.dump(T, f)
print("done", flush=True)
w.stop()
t.join(10)
w.close()
'''

_WORKER = '''
import json, sys, threading, time
from shmrpc.server import _lanes
from shmrpc.server._loop import Worker
from shmrpc.server.config import WorkerConfig
pc = time.perf_counter
T = {"scan": [], "oncall": [], "answer": [], "wait": []}
o_scan, o_on, o_ans = _lanes.Lanes.scan, Worker._on_call, _lanes.Lanes.answer
try:  # the loop's wait: an epoll set (server/_poll.py), or zmq.Poller in trees before it
    from shmrpc.server._poll import LoopPoll as P
except ImportError:
    import zmq
    P = zmq.Poller
o_poll = P.poll
def poll(self, *a):
    T["wait"].append(pc())
    return o_poll(self, *a)
P.poll = poll
def scan(self):
    T["scan"].append(pc())
    yield from o_scan(self)
def on(self, *a, **k):
    T["oncall"].append(pc())
    return o_on(self, *a, **k)
def ans(self, *a):
    T["answer"].append(pc())
    return o_ans(self, *a)
_lanes.Lanes.scan, Worker._on_call, _lanes.Lanes.answer = scan, on, ans
w = Worker(WorkerConfig(name=sys.argv[1], backend="numpy", mlock=False, spin_us=int(sys.argv[3])))
''' + SERVE_STAMPED


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--lane", choices=("spin", "block"), default="spin")
    ap.add_argument("--call", action="store_true", help="time call()s instead of a loan's sends")
    ap.add_argument("--worker-spin-us", type=int, default=None,
                    help="the worker's --spin-us (default: 200 with --lane spin, 0 with --lane block)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from shmrpc.client import Client, _lane

    name = f"trace-{os.getpid()}-{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory(prefix="shmrpc-trace-") as tmp:
        stamps = os.path.join(tmp, "worker.json")
        wspin = args.worker_spin_us if args.worker_spin_us is not None else 200 if args.lane == "spin" else 0
        worker = subprocess.Popen([sys.executable, "-c", _WORKER, name, stamps, str(wspin)],
                                  stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout is not None and worker.stdin is not None
            assert worker.stdout.readline().strip() == "ready", "the worker did not start"
            pc, last = time.perf_counter, {}
            o_ring, o_wait = _lane.ClientLane.ring, _lane.ClientLane.wait

            def ring(self: object, *a: object) -> None:
                last["ring"] = pc()
                o_ring(self, *a)  # type: ignore[arg-type]

            def wait(self: object, *a: object) -> bytes:  # "seen": the lane's wait returns the DONE it read
                got = o_wait(self, *a)  # type: ignore[arg-type]
                last["seen"] = pc()
                return got

            _lane.ClientLane.ring, _lane.ClientLane.wait = ring, wait  # type: ignore[method-assign]
            rows = []
            with Client(name, timeout_s=30, lane=args.lane) as c, c.loan(4096) as req:
                req.array("x", (16,), np.float32)[...] = 1
                req.array("y", (16,), np.float32)[...] = 0
                x, y = np.ones(16, np.float32), np.zeros(16, np.float32)

                def send() -> object:
                    return req.send("vector_add", in_place=True)

                if args.call:
                    def send() -> object:
                        return c.call("vector_add", x=x, y=y, in_place=True)

                for _ in range(500):
                    send()
                for _ in range(args.calls):
                    t0 = pc()
                    send()
                    rows.append((t0, last["ring"], last["seen"], pc()))
                worker.stdin.write("\n")
                worker.stdin.flush()
                assert worker.stdout.readline().strip() == "done"
            with open(stamps) as f:
                w = json.load(f)
        finally:
            worker.wait(30)
    scan, oncall, answer, wait = w["scan"], w["oncall"], w["answer"], w["wait"]
    parts: dict[str, list[float]] = {k: [] for k in ("client: send to ring", "ring to the worker's scan",
                                                      "scan to _on_call", "_on_call to the DONE written",
                                                      "DONE written to the client seeing it",
                                                      "client: seen to send's return",
                                                      "worker: DONE written to its next wait", "round trip")}
    for t0, r, seen, t1 in rows[-5000:]:
        i = bisect.bisect_left(oncall, r)
        if i >= len(oncall) or i >= len(answer):
            continue
        j = bisect.bisect_right(scan, oncall[i]) - 1
        k_wait = bisect.bisect_left(wait, answer[i])
        if k_wait >= len(wait):
            continue
        for k, v in zip(parts, (r - t0, scan[j] - r, oncall[i] - scan[j], answer[i] - oncall[i], seen - answer[i],
                                t1 - seen, wait[k_wait] - answer[i], t1 - t0)):
            parts[k].append(v)
    med = {k: round(statistics.median(v) * 1e6, 2) for k, v in parts.items()}
    for k, v in med.items():
        print(f"{k:<40} {v:7.2f} µs")
    if args.out:
        from shmrpc.bench._report import write_probe

        write_probe({"mode": "lane-trace", "lane": args.lane, "call": args.call, "calls": args.calls,
                     "worker_spin_us": wspin, "median_us": med},
                    None, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
