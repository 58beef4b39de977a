"""The client's own CPU per small request, the worker's part replayed, A/B between trees, rounds interleaved.

    python bench/client_cpu.py --calls 20000 --rounds 4 --tree before=PATH --tree after= \\
        --out bench/results/client-cpu-2026-12-01.json

Starts one worker (NumPy backend, this checkout) for the handshakes. Per round and tree, a child process with
that tree on ``PYTHONPATH`` (empty: this checkout) connects with a blocking lane and sends a 64 B in-place
``vector_add`` from a loan, and then through ``call()``, once for real each. From then on it answers its own
requests: right after each ring it writes the worker's recorded response, header and DONE into the slot and the
lane's page, and the worker says it polls the lane so that no doorbell is written. What ``timeit`` then measures
per request (the best of 5 repeats of ``--calls``) is the client's own Python, with no wake-up and no worker in it,
plus the replay, which is timed alone too (``replay_us``) and is the same code for every tree. On a shared
machine the round trip moves by more than a change of a µs on one side; the CPU one side spends much less.
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

_CHILD = r"""
import json, sys, timeit
import numpy as np
from shmrpc.client import Client
from shmrpc.client import _lane
from shmrpc.schema import lane as L, messages as m
from shmrpc.schema.header import HEADER, HEADER_NBYTES

name, calls = sys.argv[1], int(sys.argv[2])
c = Client(name, lane="block", timeout_s=30)
x, y = np.ones(16, np.float32), np.full(16, 2, np.float32)
loan = c.loan(4096)
loan.array("x", 16, np.float32)[:] = x
loan.array("y", 16, np.float32)[:] = y
loan.send("vector_add", in_place=True)  # answered by the worker: the response replayed below
for _ in range(2):
    c.call("vector_add", x=x, y=y, in_place=True)  # the second one keeps its loan
kept = c._kept[0]
lane = c._t.lane
replies = {}  # slot mv id -> (the worker's response bytes, its header's op code and flags)
for lo in (loan, kept):
    mv = lo._s.mv
    h = HEADER.unpack_from(mv)
    replies[lo._s.index] = (mv, bytes(mv[HEADER_NBYTES:HEADER_NBYTES + h[2]]), h[1], h[3])
ring = _lane.ClientLane.ring


def replay(frame):
    region, index, rid, gen = m.unpack_call(frame)
    mv, resp, op_code, flags = replies[index]
    mv[HEADER_NBYTES:HEADER_NBYTES + len(resp)] = resp
    HEADER.pack_into(mv, 0, rid, op_code, len(resp), flags, gen)
    L.post(lane.page, lane._done_seq, L.DONE_SEQ, lane.seq, m.pack_done(region, index, rid, 0))


def answered(self, frame, request_id):
    ring(self, frame, request_id)
    replay(frame)


_lane.ClientLane.ring = answered
lane._worker_awake.value = 1 << 62  # the ring skips the doorbell: no worker takes part


def best(f):
    for _ in range(1000):
        f()
    return min(timeit.repeat(f, number=calls, repeat=5)) / calls * 1e6


out = {"loan_us": best(lambda: loan.send("vector_add", in_place=True)),
       "call_us": best(lambda: c.call("vector_add", x=x, y=y, in_place=True))}
assert c._kept and c._kept[0] is kept, "call() did not keep its loan"
frame = m.pack_call(kept._s.region, kept._s.index, 1, kept._s.generation)
out["replay_us"] = best(lambda: replay(frame))
_lane.ClientLane.ring = ring
lane._worker_awake.value = 0
loan.release()
c.close()
print(json.dumps(out))
"""


def _one(name: str, pythonpath: str, calls: int) -> dict[str, float]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    else:
        env.pop("PYTHONPATH", None)
    got = subprocess.run([sys.executable, "-c", _CHILD, name, str(calls)], env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    if got.returncode != 0:
        raise SystemExit(f"the client child failed:\n{got.stderr[-3000:]}")
    return {k: round(v, 3) for k, v in json.loads(got.stdout.strip().splitlines()[-1]).items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tree", action="append", required=True, metavar="LABEL=PYTHONPATH")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    trees = [t.split("=", 1) for t in args.tree]
    name = f"ccpu-{os.getpid()}-{secrets.token_hex(3)}"
    worker = subprocess.Popen([sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--backend", "numpy",
                               "--no-mlock", "--log-level", "WARNING", "--slots", "64K:16", "--lease", "4"],
                              stdout=subprocess.PIPE, text=True)
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    try:
        assert worker.stdout is not None and "ready" in worker.stdout.readline(), "the worker did not start"
        for r in range(args.rounds):
            for label, path in trees if r % 2 == 0 else list(reversed(trees)):  # ABBA: neither goes first each time
                runs[label].append(_one(name, path, args.calls))
                print(f"round {r + 1} {label:<8} " + "  ".join(f"{k} {v:6.2f}" for k, v in runs[label][-1].items()),
                      flush=True)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)
    medians = {label: {k: round(statistics.median(x[k] for x in rs), 2) for k in rs[0]} for label, rs in runs.items()}
    print("\nmedians over rounds (µs of client CPU per request, the replay included)")
    for label, med in medians.items():
        print(f"  {label:<8} " + "  ".join(f"{k} {v:6.2f}" for k, v in med.items()))
    if args.out:
        from shmrpc.bench._report import write_probe

        doc = {"mode": "client-cpu", "calls": args.calls, "rounds": args.rounds,
               "trees": {label: (path or "this checkout") for label, path in trees}, "runs": runs, "medians": medians}
        write_probe(doc, None, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
