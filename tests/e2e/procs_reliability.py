"""Client programs killed at a chosen point of a call: ``python procs_reliability.py POINT NAME``.

Each takes every slot of its lease, writes 0xAB all over the data it can reach, gets to
POINT, prints ``ready <n slots>`` and sleeps until the test SIGKILLs it:

* ``before``: tensors and descriptor written in every slot, no doorbell rung.
* ``computing``: a slow pipeline in flight in every slot (the worker is computing).
* ``reading``: the answers came back; it holds the outputs as views into every slot and keeps
  reading them.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from shmrpc.client import Client, Pipeline


def _slow(n: int) -> Pipeline:
    p = Pipeline()
    for _ in range(n):
        p = p.then("scale", a=1.0)
    return p


def _chain(n: int) -> Pipeline:
    """n chained matrix products x @ w @ w ... (keeps the worker computing for a while)."""
    p = Pipeline().then("gemm")
    for i in range(1, n):
        p = p.then("gemm", inputs={"x": f"{i - 1}.out", "w": "w"})
    return p


def main(point: str, name: str) -> None:
    """Run to ``point`` and wait to be killed."""
    c = Client(name, timeout_s=60)
    sizes = sorted(s.nbytes for s in c._slots.free)  # the lease, smallest first
    n = len(sizes)
    desc = c.geometry.desc_nbytes
    if point == "before":
        loans = [c.loan(sz - desc) for sz in sizes]
        for ln in loans:
            x = ln.array("x", (ln.nbytes - desc) // 2, np.uint8)
            x[:] = 0xAB
        for ln in loans:  # descriptor and header written, as _post does, but no CALL
            payload, op_code, flags, _ = c._describe("echo", tuple(ln._tensors), {}, 0, ())
            mv = ln._live()
            mv[16:16 + len(payload)] = payload
            mv[:16] = b"\xab" * 16
        print("ready", n, flush=True)
    elif point == "computing":
        futs = []
        for sz in sizes:
            k = 700 if sz >= 8 << 20 else 32  # x, w and the output fit; 20 chained products of k^3 each
            eye = np.eye(k, dtype=np.float32)
            futs.append(c.submit(_chain(20), x=eye, w=eye))
        print("ready", n, flush=True)
    elif point == "reading":
        outs = []
        for sz in sizes:
            k = (sz - desc) // 2 - 512
            outs.append(c.call("echo", x=np.full(k, 0xAB, np.uint8), copy=False)["out"])
        print("ready", n, flush=True)
        while True:  # reading the responses in place
            assert all(int(o[0]) == 0xAB for o in outs)
            time.sleep(0.001)
    else:
        sys.exit(f"unknown point {point}")
    time.sleep(120)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
