"""``await AsyncClient.call`` beside ``Client.call`` on one worker, A/B between trees.

    python bench/async_call.py --calls 3000 --rounds 4 --tree before=PATH --tree after= \\
        --out bench/results/async-call-DATE.json

Starts one worker (NumPy backend, this checkout). Per round and tree, a child process with that tree on ``PYTHONPATH``
(empty: this checkout) sends a 64 B ``vector_add`` of two float32 arrays through ``Client.call`` (``call``), then in one
``asyncio.run``: ``await AsyncClient.call`` one at a time (``async_call``), ``await AsyncLoan.send`` of the same inputs
written once into a loan (``async_loan``), and ``asyncio.gather`` of 4 calls at a time (``async_gather4``, µs per
call; the worker leases a client 4 slots, so none waits for one) and of 16 (``async_gather16``: 12 wait for a slot,
since the thirty-fourth session on the loop, before from the executor after an ACQUIRE); then ``call()`` and ``await
AsyncClient.call`` of a new signature every call (``call_newsig``, ``async_newsig``: ``scale`` with a new ``a``, whose
output sizes the client asks of the worker first; ``--calls`` / 10 calls; since the thirty-fourth session the
AsyncClient asks from the loop, before from the executor; since 2026-12-04 ``call()`` asks nothing when the outputs
fit the room it gives them, and learns their sizes from the answer). Then the same through a
blocking lane (``Client(lane="block")``): ``call`` (``lane_call``) and ``await AsyncClient.call``
(``lane_async_call``); -1 for a tree before 2026-12-04's thirty-third session, whose AsyncClient left a lane's answer uncollected (every such call
timed out). Per case the best of 5 repeats of ``--calls`` calls, µs per call, and the process's CPU time per call over
the 5 repeats (``..._cpu_us``: every thread of the process).
"""

from __future__ import annotations

import sys

from worker_cpu import child_main  # (bench/, beside this program)

_CHILD = r"""
import asyncio, json, sys, time, timeit
import numpy as np
from shmrpc.client import AsyncClient, Client

name, calls = sys.argv[1], int(sys.argv[2])
out = {}
a = np.arange(16, dtype=np.float32)
b = np.full(16, 2, np.float32)


def record(key, runs, cpu, n=None):
    n = n or calls
    out[key + "_us"] = min(runs) / n * 1e6
    out[key + "_cpu_us"] = cpu / (len(runs) * n) * 1e6


def sync_call(key, lane=None):
    with Client(name, timeout_s=30, lane=lane) as c:
        assert np.array_equal(c.call("vector_add", x=a, y=b)["out"], a + 2)
        c0 = time.process_time()
        runs = timeit.repeat(lambda: c.call("vector_add", x=a, y=b), number=calls, repeat=5)
        record(key, runs, time.process_time() - c0)


sync_call("call")
fresh = iter(range(1, 1 << 40))  # a new attribute each call: a new signature, whose output sizes are asked
with Client(name, timeout_s=30) as c:
    c0 = time.process_time()
    runs = timeit.repeat(lambda: c.call("scale", x=a, a=float(next(fresh)), b=0.0), number=calls // 10, repeat=5)
    record("call_newsig", runs, time.process_time() - c0, calls // 10)


async def timed(key, step, per=1, n=None):
    n = n or calls
    await step()
    runs, c0 = [], time.process_time()
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n // per):
            await step()
        runs.append(time.perf_counter() - t)
    record(key, runs, time.process_time() - c0, n)


async def main():
    async with await AsyncClient.connect(name, timeout_s=30) as ac:
        assert np.array_equal((await ac.call("vector_add", x=a, y=b))["out"], a + 2)
        await timed("async_call", lambda: ac.call("vector_add", x=a, y=b))
        async with ac.loan(4096) as req:
            req.array("x", 16, "float32")[:] = a
            req.array("y", 16, "float32")[:] = b
            assert np.array_equal((await req.send("vector_add"))["out"], a + 2)
            await timed("async_loan", lambda: req.send("vector_add"))

        def gather(n):
            async def step():
                outs = await asyncio.gather(*(ac.call("vector_add", x=a, y=b) for _ in range(n)))
                assert all(np.array_equal(o["out"], a + 2) for o in outs)
            return step

        await timed("async_gather4", gather(4), 4)
        await timed("async_gather16", gather(16), 16)
        await timed("async_newsig", lambda: ac.call("scale", x=a, a=float(next(fresh)), b=0.0), 1, calls // 10)


async def lane_main():
    async with await AsyncClient.connect(name, timeout_s=30, lane="block") as ac:
        assert np.array_equal((await ac.call("vector_add", x=a, y=b))["out"], a + 2)
        await timed("lane_async_call", lambda: ac.call("vector_add", x=a, y=b))


asyncio.run(main())
sync_call("lane_call", "block")
if hasattr(AsyncClient, "_watch_lane"):
    asyncio.run(lane_main())
else:
    out["lane_async_call_us"] = out["lane_async_call_cpu_us"] = -1.0
print(json.dumps(out))
"""

if __name__ == "__main__":
    sys.exit(child_main(__doc__, "async-call", "shmrpc-acall", _CHILD, "us"))
