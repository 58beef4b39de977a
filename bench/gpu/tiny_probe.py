"""Where the time of a tiny GPU request goes: each layer timed alone on the GPU machine.

    python bench/gpu/tiny_probe.py
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid

import numpy as np


def pct(ts: list[float]) -> str:
    a = np.asarray(ts) * 1e6
    return f"p50 {np.percentile(a, 50):7.1f} us  p99 {np.percentile(a, 99):7.1f} us"


def timed(fn, n: int = 2000, gap_s: float = 0.0) -> list[float]:  # type: ignore[no-untyped-def]
    """Latencies of ``fn``; ``gap_s`` idles between calls as a worker does between requests."""
    for _ in range(200):
        fn()
    out = []
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
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
    print("raw, 100 us idle between             ", pct(timed(raw, gap_s=100e-6)))
    for kind in ("cupy", "numpy"):
        be = kernels.select_backend(kind)
        be.warmup()
        plan = be.plan([kernels.StepSpec("scale", {"x": "x"}, {"out": "out"}, {"a": 2.0})],
                       {"x": kernels.TensorSpec((16,), "float32")}, ["out"])
        print(f"backend.run {kind:5s}                    ", pct(timed(lambda be=be, plan=plan: be.run(plan, {"x": h}, {"out": o}))))
        print(f"backend.run {kind:5s}, 100 us idle between", pct(timed(lambda be=be, plan=plan: be.run(plan, {"x": h}, {"out": o}),
                                                                        gap_s=100e-6)))
        be.close()
    from shmrpc.client import Client

    for backend, extra, spin in (("numpy", [], 0), ("cupy", [], 0), ("cupy", ["--spin-us", "200"], 200)):
        name = f"probe-{uuid.uuid4().hex[:6]}"
        p = subprocess.Popen([sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--slots", "64K:16",
                              "--lease", "4", "--backend", backend, "--log-level", "WARNING", *extra],
                             stdout=subprocess.PIPE, text=True)
        assert "ready" in (p.stdout.readline() if p.stdout else "")
        label = f"{backend} worker {' '.join(extra)}"
        with Client(name, spin_us=spin) as c, c.loan(64) as req:
            req.array("x", 16, np.float32)[:] = 1
            print(f"client loan.send scale, {label:28s}", pct(timed(lambda: req.send("scale", a=2.0))))
            print(f"client loan.send echo,  {label:28s}", pct(timed(lambda: req.send("echo"))))
        st = json.loads(subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", name, "--json"],
                                       capture_output=True, text=True).stdout)
        d = st["counters"]["duration"].get("scale", {})
        if d:
            print(f"  worker-side mean per scale request: {d['sum_s'] / d['count'] * 1e6:.1f} us")
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
