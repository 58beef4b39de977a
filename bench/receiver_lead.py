"""``call()`` and ``submit().result()`` beside the background receiver thread, A/B between trees.

    python bench/receiver_lead.py --calls 3000 --rounds 3 --tree before=PATH --tree after= \\
        --out bench/results/receiver-lead-DATE.json

Starts one worker (NumPy backend, this checkout). Per round and tree, a child process with that tree on ``PYTHONPATH``
(empty: this checkout) sends a 64 B ``vector_add`` of two float32 arrays through ``call()`` in a client that never
submitted (``call_fresh``), then through ``submit().result()`` (``submit``: the first ``submit()`` starts the client's
receiver thread, which finishes futures nobody waits for), then through ``call()`` again in that client
(``call_after_submit``). Per case the best of 5 repeats of ``--calls`` calls, µs per call, and the client process's CPU
time per call over the 5 repeats (``..._cpu_us``: the calling thread, the receiver thread and libzmq's I/O thread), and
the share of those calls whose thread asked the receiver to step aside (``..._handover_share``; -1 for a tree before
e55b9ac, which does not count them).
"""

from __future__ import annotations

import sys

from worker_cpu import child_main  # (bench/, beside this program)

_CHILD = r"""
import json, sys, time, timeit
import numpy as np
from shmrpc.client import Client

name, calls = sys.argv[1], int(sys.argv[2])
out = {}


def timed(key, f):
    # the best wall time of 5 repeats, and this process's CPU time per call over all 5 (its threads: the caller, the
    # receiver, libzmq's I/O thread)
    c0, h0 = time.process_time(), c._inflight.snapshot().get("handovers", -1)
    out[key + "_us"] = min(timeit.repeat(f, number=calls, repeat=5)) / calls * 1e6
    out[key + "_cpu_us"] = (time.process_time() - c0) / (5 * calls) * 1e6
    # the share of calls whose thread asked the receiver to step aside (-1: the tree does not count them)
    h1 = c._inflight.snapshot().get("handovers", -1)
    out[key + "_handover_share"] = -1.0 if h0 < 0 else (h1 - h0) / (5 * calls)


a = np.arange(16, dtype=np.float32)
b = np.full(16, 2, np.float32)
with Client(name, timeout_s=30) as c:
    assert np.array_equal(c.call("vector_add", x=a, y=b)["out"], a + 2)
    timed("call_fresh", lambda: c.call("vector_add", x=a, y=b))
    assert np.array_equal(c.submit("vector_add", x=a, y=b).result()["out"], a + 2)
    timed("submit", lambda: c.submit("vector_add", x=a, y=b).result())
    assert np.array_equal(c.call("vector_add", x=a, y=b)["out"], a + 2)
    timed("call_after_submit", lambda: c.call("vector_add", x=a, y=b))
print(json.dumps(out))
"""

if __name__ == "__main__":
    sys.exit(child_main(__doc__, "receiver-lead", "shmrpc-rlead", _CHILD, "us"))
