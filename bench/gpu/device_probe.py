"""What entering the CUDA device costs per request: CuPy's ``Device`` context against ``DeviceScope``.

    python bench/gpu/device_probe.py [--calls 2000] [--rounds 4] [--out FILE.json]

Times, on this GPU machine, in one process:

* the runtime calls alone: ``cudaGetDevice``, ``cudaSetDevice`` to the current device;
* ``with cupy.cuda.Device(0): pass`` (its ``__exit__`` calls cudaSetDevice every time) against
  ``with DeviceScope(0, runtime): pass`` (below: calls it only where the device changes);
* the CuPy backend's lone request path, ``backend.run``, with each of the two as the backend's device
  context (``be._dev``), interleaved ``--rounds`` times: 64 B float32 ``scale`` (the tiny request, CUDA
  graph off and on) and gemm x=16x256 @ w=256x256 float16 with x and w sent per request, views in
  page-locked memory as the worker's are.

Prints p50 / p99 per case (µs) and writes JSON (date, command, machine, per-round p50s) to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np


class DeviceScope:
    """CuPy's ``Device`` context calling cudaSetDevice only where the device changes (the alternative timed here;
    tried in the backend on 2026-12-01 and taken out again: slower than CuPy's, see docs/benchmarks.md)."""

    def __init__(self, device: int, runtime: Any) -> None:
        self.id, self._rt, self._stack = device, runtime, []  # one thread only: this probe's

    def __enter__(self) -> DeviceScope:
        prev = self._rt.getDevice()
        if prev != self.id:
            self._rt.setDevice(self.id)
        self._stack.append(prev)
        return self

    def __exit__(self, *exc: object) -> None:
        prev = self._stack.pop()
        if self._rt.getDevice() != prev:
            self._rt.setDevice(prev)


def _lat(fn: Any, calls: int) -> list[float]:
    for _ in range(min(200, calls)):
        fn()
    out = []
    pc = time.perf_counter
    for _ in range(calls):
        t0 = pc()
        fn()
        out.append(pc() - t0)
    return out


def _pcts(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs) * 1e6
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def _per_call(fn: Any, n: int = 20000) -> float:
    """Mean µs of ``fn()`` over ``n`` calls in a loop (for calls too short to time one by one)."""
    for _ in range(1000):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import cupy as cp

    from shmrpc import kernels

    rt = cp.cuda.runtime
    cupy_dev, scope = cp.cuda.Device(0), DeviceScope(0, rt)
    rt.setDevice(0)

    def in_cupy_dev() -> None:
        with cupy_dev:
            pass

    def in_scope() -> None:
        with scope:
            pass

    calls: dict[str, list[float]] = {"cudaGetDevice": [], "cudaSetDevice (same device)": [],
                                     "with cupy.cuda.Device(0)": [], "with DeviceScope(0)": []}
    for _ in range(args.rounds):
        calls["cudaGetDevice"].append(_per_call(rt.getDevice))
        calls["cudaSetDevice (same device)"].append(_per_call(lambda: rt.setDevice(0)))
        calls["with cupy.cuda.Device(0)"].append(_per_call(in_cupy_dev))
        calls["with DeviceScope(0)"].append(_per_call(in_scope))
    print("per call, mean of 20 000 in a loop, median of the rounds (µs)")
    for k, v in calls.items():
        print(f"  {k:<32} {statistics.median(v):8.3f}")

    mem = cp.cuda.alloc_pinned_memory(4 << 20)
    base = np.frombuffer(mem, np.uint8)
    x16 = base[0:64].view(np.float32)
    o16 = base[4096:4160].view(np.float32)
    x16[:] = np.arange(16, dtype=np.float32)
    gx = base[8192:8192 + 16 * 256 * 2].view(np.float16).reshape(16, 256)
    gw = base[65536:65536 + 256 * 256 * 2].view(np.float16).reshape(256, 256)
    go = base[262144:262144 + 16 * 256 * 2].view(np.float16).reshape(16, 256)
    rng = np.random.default_rng(0)
    gx[...] = rng.standard_normal((16, 256)).astype(np.float16)
    gw[...] = (rng.standard_normal((256, 256)) / 16).astype(np.float16)

    be = kernels.select_backend("cupy")
    be.warmup()
    scale = be.plan([kernels.StepSpec("scale", {"x": "x"}, {"out": "out"}, {"a": 2.0})],
                    {"x": kernels.TensorSpec((16,), "float32")}, ["out"])
    gemm = be.plan([kernels.StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "out"})],
                   {"x": kernels.TensorSpec((16, 256), "float16"), "w": kernels.TensorSpec((256, 256), "float16")},
                   ["out"])
    graph_limit = be._graphs.limit  # type: ignore[attr-defined]
    cases = {
        "scale 64 B, backend.run, no graph": (scale, {"x": x16}, {"out": o16}, 0),
        "scale 64 B, backend.run, CUDA graph": (scale, {"x": x16}, {"out": o16}, graph_limit),
        "gemm 16x256x256 float16, backend.run": (gemm, {"x": gx, "w": gw}, {"out": go}, graph_limit),
    }
    ctxs = {"cupy.cuda.Device": cupy_dev, "DeviceScope": scope}
    rows: dict[str, dict[str, list[float]]] = {c: {k: [] for k in ctxs} for c in cases}
    p99s: dict[str, dict[str, list[float]]] = {c: {k: [] for k in ctxs} for c in cases}
    for name, (plan, ins, outs, limit) in cases.items():
        be._graphs.limit = limit  # type: ignore[attr-defined]
        for _ in range(args.rounds):
            for ctx_name, ctx in ctxs.items():
                be._dev = ctx  # type: ignore[attr-defined]
                p50, p99 = _pcts(_lat(lambda p=plan, i=ins, o=outs: be.run(p, i, o), args.calls))
                rows[name][ctx_name].append(p50)
                p99s[name][ctx_name].append(p99)
    be._graphs.limit = graph_limit  # type: ignore[attr-defined]
    be._dev = scope  # type: ignore[attr-defined]
    assert np.array_equal(o16, x16 * 2), "scale gave a wrong answer"
    ref = gx.astype(np.float32) @ gw.astype(np.float32)
    err = float(np.max(np.abs(go.astype(np.float32) - ref)) / np.max(np.abs(ref)))
    assert err < 1e-2, f"gemm off by {err}"
    be.close()

    print(f"\nbackend.run, p50 per round (µs), {args.calls} calls each, interleaved")
    print(f"  {'case':<40} {'cupy.cuda.Device':>24} {'DeviceScope':>24}")
    for name in cases:
        cells = [" / ".join(f"{v:.1f}" for v in rows[name][k]) for k in ctxs]
        print(f"  {name:<40} {cells[0]:>24} {cells[1]:>24}")
    summary = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rows.items()}
    for name, s in summary.items():
        print(f"  median: {name:<32} {s['cupy.cuda.Device']:.1f} -> {s['DeviceScope']:.1f} µs")
    if args.out:
        from shmrpc.bench._report import write_probe

        write_probe({"mode": "device-probe", "calls": args.calls, "rounds": args.rounds,
                     "per_call_us": {k: statistics.median(v) for k, v in calls.items()}, "per_call_rounds_us": calls,
                     "run_p50_us_rounds": rows, "run_p99_us_rounds": p99s, "run_p50_us_median": summary,
                     "gemm_max_rel_err": err}, [f"bench/gpu/{__file__.rsplit('/', 1)[-1]}", *sys.argv[1:]], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
