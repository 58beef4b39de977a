"""What a new call signature costs, A/B between trees, rounds interleaved: each tree's own worker and client.

    python bench/new_signature.py --calls 300 --rounds 4 --tree base=PATH --tree new= \\
        --out bench/results/new-signature-DATE-COMMIT.json

A signature is everything that decides a call's slot layout and descriptor (docs/client.md, "The steady
path"); a new one is planned on both sides: the client builds its descriptor (and, before 2026-12-04,
asked the worker for the outputs' sizes first), the worker decodes, checks and plans it. Callers whose
attribute values or shapes change from call to call pay that every call. Per round and tree (``--tree
LABEL=PYTHONPATH``, empty: this checkout) a NumPy worker and a client child both run that tree's code; the
child measures, µs per call, best of 3 repeats of ``--calls`` calls:

- ``steady``: ``call("scale", x=16 float32, a=1.0, b=0.0)`` again and again (one signature);
- ``new_attr``: the same with a new ``a`` every call (a new signature every call);
- ``new_shape``: ``vector_add`` of two float32 vectors of a new length every call;
- ``submit_new_attr``: ``Client.submit(...).result()`` with a new ``a`` every call (added 2026-12-05: submit()
  guesses like call() since then);
- ``async_new_attr``: ``await AsyncClient.call`` with a new ``a`` every call;
- ``turns3``: three signatures in turn (``scale``, ``vector_add``, ``echo`` of the same 16 float32), each seen
  before but never the last one in the slot (added 2026-12-04; the worker keeps a few per slot since then);
- ``blocks3``: the same three, each a third of a repeat's calls in a row;

and, for ``new_attr``, ``turns3`` and ``blocks3``, the worker's and the client's CPU per call over the repeats (``..._worker_cpu``,
``..._client_cpu``; the worker's from ``/proc`` by ``worker_cpu.py``'s reader, in ticks, so a few tens of µs coarse at 300 calls).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys

from worker_cpu import ab_parser, ab_rounds, start_worker, tree_env  # (bench/, beside this program)

_BENCH = os.path.dirname(os.path.abspath(__file__))

_CHILD = r"""
import asyncio, json, sys, time
import numpy as np
from shmrpc.client import AsyncClient, Client

name, calls, wpid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, sys.argv[4])  # bench/, for worker_cpu's reading of a process's CPU time
from worker_cpu import _cpu_s


def wcpu():
    return _cpu_s(wpid)


out = {}
x = np.arange(16, dtype=np.float32)
fresh = iter(range(1, 10**9))


def best(key, step, cpu=False):
    runs, w0, c0 = [], wcpu(), time.process_time()
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            step()
        runs.append(time.perf_counter() - t)
    out[key] = min(runs) / calls * 1e6
    if cpu:
        out[key + "_worker_cpu"] = (wcpu() - w0) / (3 * calls) * 1e6
        out[key + "_client_cpu"] = (time.process_time() - c0) / (3 * calls) * 1e6


with Client(name, timeout_s=30) as c:
    for _ in range(200):
        c.call("scale", x=x, a=1.0, b=0.0)
    best("steady", lambda: c.call("scale", x=x, a=1.0, b=0.0))
    best("new_attr", lambda: c.call("scale", x=x, a=float(next(fresh)) + 0.5, b=0.0), cpu=True)
    best("submit_new_attr", lambda: c.submit("scale", x=x, a=float(next(fresh)) + 0.75, b=0.0).result())

    def new_shape():
        n = 1 + next(fresh) % 4000
        v = np.ones(n, np.float32)
        c.call("vector_add", x=v, y=v)
    best("new_shape", new_shape)
    three = [lambda: c.call("scale", x=x, a=2.0, b=1.0), lambda: c.call("vector_add", x=x, y=x),
             lambda: c.call("echo", x=x)]
    turn = iter(range(10**9))
    best("turns3", lambda: three[next(turn) % 3](), cpu=True)
    block = iter(range(10**9))
    best("blocks3", lambda: three[next(block) % calls * 3 // calls](), cpu=True)


async def main():
    async with await AsyncClient.connect(name, timeout_s=30) as ac:
        await ac.call("scale", x=x, a=1.0, b=0.0)
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(calls):
                await ac.call("scale", x=x, a=float(next(fresh)) + 0.25, b=0.0)
            runs.append(time.perf_counter() - t)
        out["async_new_attr"] = min(runs) / calls * 1e6


asyncio.run(main())
print(json.dumps(out))
"""


def main() -> int:
    args = ab_parser(__doc__).parse_args()

    def one(label: str, pythonpath: str) -> dict[str, float]:
        name = f"nsig-{os.getpid()}-{secrets.token_hex(3)}"
        env = tree_env(pythonpath)
        worker = start_worker(name, env)
        try:
            got = subprocess.run([sys.executable, "-c", _CHILD, name, str(args.calls), str(worker.pid), _BENCH], env=env,
                                 capture_output=True, text=True, timeout=600, check=False)
            if got.returncode != 0:
                raise SystemExit(f"the client child of {label} failed:\n{got.stderr[-3000:]}")
            figures = json.loads(got.stdout.strip().splitlines()[-1])
            return {k: round(v, 3) for k, v in figures.items()}
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.communicate(timeout=30)

    ab_rounds("new-signature", args.tree, args.rounds, args.calls, one, "µs per call", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
