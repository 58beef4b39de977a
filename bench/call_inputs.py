"""``call()`` with inputs the steady path took on in 2026-12-04 (a transposed array, a resident tensor) against the
same values as C-contiguous arrays, A/B between trees. (Named ``bench/strided_call.py`` until the resident case came.)

    python bench/call_inputs.py --calls 2000 --rounds 3 --tree before=PATH --tree after= \\
        --out bench/results/call-inputs-2026-12-04.json

Starts one worker (NumPy backend, this checkout). Per round and tree, a child process with that tree on ``PYTHONPATH``
(empty: this checkout) sends ``echo`` of a square float32 matrix of 64 B, 4 KiB and 16 KiB through
``call()``: C-contiguous (``c``), and transposed (``t``: the same values, Fortran-ordered); and ``vector_add`` of
such a matrix and a second one, given as an array (``a``) or as a resident tensor put once (``r``); and that
``vector_add`` of two arrays through ``submit().result()`` (``s``) and ``await AsyncClient.call`` (``as``), which took
the general path before 2026-12-04 and send a planned signature by its plan since. Per case it keeps the best of
5 repeats of ``--calls`` calls, µs per call. (The worker's slots are 64 KiB: the input and its output fit.) Before 2026-12-04 a transposed input went
the general path (NumPy made a contiguous copy first, then the copy into the slot); since then the steady path's one
copy into the slot reads it in C order. A resident input went the general path too; since then its plan is kept.
"""

from __future__ import annotations

import sys

from worker_cpu import child_main  # (bench/, beside this program)

_CHILD = r"""
import asyncio, json, sys, time, timeit
import numpy as np
from shmrpc.client import AsyncClient, Client, Resident

name, calls = sys.argv[1], int(sys.argv[2])
out = {}
with Client(name, timeout_s=30) as c:
    for label, n in (("64B", 4), ("4KiB", 32), ("16KiB", 64)):
        a = np.arange(n * n, dtype=np.float32).reshape(n, n)
        t = np.ascontiguousarray(a.T).T  # the values of a, Fortran-ordered
        assert not t.flags.c_contiguous and np.array_equal(t, a)
        for case, x in (("c", a), ("t", t)):
            np.testing.assert_array_equal(c.call("echo", x=x)["out"], a)
            best = min(timeit.repeat(lambda: c.call("echo", x=x), number=calls, repeat=5)) / calls * 1e6
            out[f"{label}_{case}_us"] = best
        w = np.ones((n, n), np.float32)
        c.put(f"w{n}", w)
        for case, y in (("a", w), ("r", Resident(f"w{n}"))):
            np.testing.assert_array_equal(c.call("vector_add", x=a, y=y)["out"], a + 1)
            best = min(timeit.repeat(lambda: c.call("vector_add", x=a, y=y), number=calls, repeat=5)) / calls * 1e6
            out[f"{label}_add_{case}_us"] = best
        w2 = np.full((n, n), 2, np.float32)
        assert np.array_equal(c.submit("vector_add", x=a, y=w2).result()["out"], a + 2)
        best = min(timeit.repeat(lambda: c.submit("vector_add", x=a, y=w2).result(), number=calls, repeat=5))
        out[f"{label}_add_s_us"] = best / calls * 1e6

        async def timed(ac, a=a, w2=w2):
            assert np.array_equal((await ac.call("vector_add", x=a, y=w2))["out"], a + 2)
            runs = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(calls):
                    await ac.call("vector_add", x=a, y=w2)
                runs.append(time.perf_counter() - t)
            return min(runs) / calls * 1e6

        async def main():
            async with await AsyncClient.connect(name, timeout_s=30) as ac:
                return await timed(ac)

        out[f"{label}_add_as_us"] = asyncio.run(main())
print(json.dumps(out))
"""


def main() -> int:
    return child_main(__doc__, "call-inputs", "cinputs", _CHILD,
                      "µs per call(); echo of c: a C-contiguous, t: a transposed matrix; vector_add with a: an array, "
                      "r: a resident, s: submit().result(), as: AsyncClient.call")


if __name__ == "__main__":
    sys.exit(main())
