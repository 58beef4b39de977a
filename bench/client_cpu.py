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

import sys

from worker_cpu import child_main  # (bench/, beside this program)

_CHILD = r"""
import json, sys, time, timeit
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


def answered(self, frame, request_id, *rest):
    ring(self, frame, request_id, *rest)
    replay(frame)


_lane.ClientLane.ring = answered
lane._worker_awake.value = 1 << 62  # the ring skips the doorbell: no worker takes part
# NOTE: the worker reads the lanes once more after it clears the doorbell of the last real call: a replayed ring in
# that moment would be taken by it too (and refused: the replay wrote a response header there). Let its turn end.
time.sleep(0.2)


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


def main() -> int:
    return child_main(__doc__, "client-cpu", "ccpu", _CHILD, "µs of client CPU per request, the replay included")


if __name__ == "__main__":
    sys.exit(main())
