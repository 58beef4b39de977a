"""``Pool.call`` beside ``Client.call`` on one worker, A/B between trees.

    python bench/pool_call.py --calls 3000 --rounds 4 --tree before=PATH --tree after= \\
        --out bench/results/pool-call-DATE.json

Starts one worker (NumPy backend, this checkout). Per round and tree, a child process with that tree on ``PYTHONPATH``
(empty: this checkout) sends a 64 B ``vector_add`` of two float32 arrays through ``Client.call`` (``client_call``),
through a ``Pool`` of that one worker (``Pool(workers=[name])``: ``pool_call``), then through the pool's
``submit().result()`` (``pool_submit``; its first ``submit()`` starts the member client's receiver thread), then through
``Pool.call`` again (``pool_call_after_submit``). Per case the best of 5 repeats of ``--calls`` calls, µs per call, and
the client process's CPU time per call over the 5 repeats (``..._cpu_us``: every thread of the process).
"""

from __future__ import annotations

import sys

from worker_cpu import child_main  # (bench/, beside this program)

_CHILD = r"""
import json, sys, time, timeit
import numpy as np
from shmrpc.client import Client, Pool

name, calls = sys.argv[1], int(sys.argv[2])
out = {}


def timed(key, f):
    # the best wall time of 5 repeats, and this process's CPU time per call over all 5
    c0 = time.process_time()
    out[key + "_us"] = min(timeit.repeat(f, number=calls, repeat=5)) / calls * 1e6
    out[key + "_cpu_us"] = (time.process_time() - c0) / (5 * calls) * 1e6


a = np.arange(16, dtype=np.float32)
b = np.full(16, 2, np.float32)
with Client(name, timeout_s=30) as c:
    assert np.array_equal(c.call("vector_add", x=a, y=b)["out"], a + 2)
    timed("client_call", lambda: c.call("vector_add", x=a, y=b))
with Pool(workers=[name], timeout_s=30) as pool:
    assert np.array_equal(pool.call("vector_add", x=a, y=b)["out"], a + 2)
    timed("pool_call", lambda: pool.call("vector_add", x=a, y=b))
    assert np.array_equal(pool.submit("vector_add", x=a, y=b).result()["out"], a + 2)
    timed("pool_submit", lambda: pool.submit("vector_add", x=a, y=b).result())
    timed("pool_call_after_submit", lambda: pool.call("vector_add", x=a, y=b))
print(json.dumps(out))
"""

if __name__ == "__main__":
    sys.exit(child_main(__doc__, "pool-call", "shmrpc-poolcall", _CHILD, "us"))
