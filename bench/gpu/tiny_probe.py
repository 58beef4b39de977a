"""Where the time of a tiny GPU request goes: each layer timed alone on the GPU machine.

    python bench/gpu/tiny_probe.py
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid

import numpy as np


def pct(ts: list[float]) -> str:
    a = np.asarray(ts) * 1e6
    return f"p50 {np.percentile(a, 50):7.1f} us  p99 {np.percentile(a, 99):7.1f} us"


def timed(fn, n: int = 2000) -> list[float]:  # type: ignore[no-untyped-def]
    for _ in range(200):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    import cupy as cp

    from shmrpc import kernels

    host = cp.cuda.alloc_pinned_memory(1 << 20)
    h = np.frombuffer(host, np.float32, 16)
    h[:] = 1
    o = np.frombuffer(host, np.float32, 16, offset=4096)
    s = cp.cuda.Stream(non_blocking=True)
    d = cp.empty(16, cp.float32)

    def raw() -> None:
        cp.cuda.runtime.memcpyAsync(d.data.ptr, h.ctypes.data, 64, cp.cuda.runtime.memcpyHostToDevice, s.ptr)
        with s:
            r = d * 2.0
        cp.cuda.runtime.memcpyAsync(o.ctypes.data, r.data.ptr, 64, cp.cuda.runtime.memcpyDeviceToHost, s.ptr)
        s.synchronize()

    print("raw memcpy + kernel + memcpy + sync  ", pct(timed(raw)))
    for kind in ("cupy", "numpy"):
        be = kernels.select_backend(kind)
        be.warmup()
        plan = be.plan([kernels.StepSpec("scale", {"x": "x"}, {"out": "out"}, {"a": 2.0})],
                       {"x": kernels.TensorSpec((16,), "float32")}, ["out"])
        print(f"backend.run {kind:5s}                    ", pct(timed(lambda be=be, plan=plan: be.run(plan, {"x": h}, {"out": o}))))
        be.close()
    from shmrpc.client import Client

    for backend in ("numpy", "cupy"):
        name = f"probe-{uuid.uuid4().hex[:6]}"
        p = subprocess.Popen([sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--slots", "64K:16",
                              "--lease", "4", "--backend", backend, "--log-level", "WARNING"], stdout=subprocess.PIPE,
                             text=True)
        assert "ready" in (p.stdout.readline() if p.stdout else "")
        with Client(name) as c, c.loan(64) as req:
            req.array("x", 16, np.float32)[:] = 1
            print(f"client loan.send scale, {backend:5s} worker  ", pct(timed(lambda: req.send("scale", a=2.0))))
            print(f"client loan.send echo,  {backend:5s} worker  ", pct(timed(lambda: req.send("echo"))))
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=30)


def profile_backend() -> None:
    """cProfile of 5000 tiny CuPy backend runs: where the Python time goes."""
    import cProfile
    import pstats

    import cupy as cp

    from shmrpc import kernels

    host = cp.cuda.alloc_pinned_memory(1 << 20)
    h = np.frombuffer(host, np.float32, 16)
    o = np.frombuffer(host, np.float32, 16, offset=4096)
    be = kernels.select_backend("cupy")
    be.warmup()
    plan = be.plan([kernels.StepSpec("scale", {"x": "x"}, {"out": "out"}, {"a": 2.0})],
                   {"x": kernels.TensorSpec((16,), "float32")}, ["out"])
    timed(lambda: be.run(plan, {"x": h}, {"out": o}), 500)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5000):
        be.run(plan, {"x": h}, {"out": o})
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    profile_backend() if "--profile" in sys.argv else main()
