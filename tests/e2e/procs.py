"""Client programs run as separate processes by the e2e tests: `python procs.py MODE NAME ...`.

* ``calls NAME SEED N``: N vector_add and N pipeline calls of random sizes, checked against
  NumPy; prints ``{"seed": SEED, "bad": count}``.
* ``victim NAME``: marks a slot with 0xAB, puts 4 slow requests in flight, prints "ready",
  then sleeps until it is killed.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from shmrpc.client import Client, Pipeline


def slow(n: int) -> Pipeline:
    """A pipeline of n identity-like scale steps (keeps a request in flight for a while)."""
    p = Pipeline()
    for _ in range(n):
        p = p.then("scale", a=1.0)
    return p


def calls(name: str, seed: int, n: int) -> None:
    rng = np.random.default_rng(seed)
    bad = 0
    with Client(name, timeout_s=20) as c:
        for _ in range(n):
            x = rng.standard_normal(rng.integers(1, 5000)).astype(np.float32)
            y = rng.standard_normal(x.shape).astype(np.float32)
            a = float(rng.standard_normal())
            p = Pipeline().then("scale", a=a).then("vector_add", inputs={"x": "0.out", "y": "y"})
            bad += not np.array_equal(c.call("vector_add", x=x, y=y)["out"], x + y)
            bad += not np.allclose(c.call(p, x=x, y=y)["1.out"], a * x + y, rtol=1e-5, atol=1e-6)
    print(json.dumps({"seed": seed, "bad": int(bad)}), flush=True)


def victim(name: str) -> None:
    c = Client(name, timeout_s=30)
    with c.loan(1000) as req:
        req.array("x", 1000, np.uint8)[:] = 0xAB  # a marker the next holder must not see
    futs = [c.submit(slow(20), x=np.ones(2000)) for _ in range(4)]
    print("ready", len(futs), flush=True)
    time.sleep(60)  # killed here, with requests in flight


if __name__ == "__main__":
    mode, name, *rest = sys.argv[1:]
    if mode == "calls":
        calls(name, int(rest[0]), int(rest[1]))
    elif mode == "victim":
        victim(name)
    else:
        sys.exit(f"unknown mode {mode}")
