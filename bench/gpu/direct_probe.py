"""A small request's GPU part with and without its copies: kernels on the registered host pages themselves.

The CuPy worker serves a small repeated request by one CUDA graph of H2D copy, kernel(s), D2H copy. On a device
where kernels may use the host address of registered memory (``cudaDevAttrCanUseHostPointerForRegisteredMem``,
as the gather launches use), the kernels could instead read the inputs from, and write the outputs into, the
slot's pages over the bus: no copy engine, no device buffer. This probe times, in process, per size:

    dma      memcpyAsync H2D, the op, memcpyAsync D2H, synchronize (the worker's graph, issued plainly)
    dma-g    the same captured as a graph: launch, synchronize (what the worker does now)
    host     the op reading the host input, its result copied by a kernel into the host output, synchronize
    host-g   the same as a graph
    one-g    the op writing its output straight into the host output (``out=``), as a graph
    empty-g  a graph of one empty kernel: the floor of a launch and a synchronize

every mode checked against NumPy first. The region is an anonymous mapping registered as the worker registers
its regions (``cudaHostRegisterPortable``).

``--ops``: then the CuPy backend's own graph of one request, ``backend.run`` with ``DIRECT_MAX_BYTES`` 0 (its copies)
and unbounded (no copies), per op and size, the inputs rewritten by the CPU before each call as a client does
(rows ``backend-copies`` / ``backend-direct``, each output checked equal between the two first), and the latter
through ``backend.bind`` as the worker calls it (``backend-bound``).

    python3 bench/gpu/direct_probe.py [--sizes 64,4096,65536,1048576] [--n 2000] [--rounds 3]
                                      [--ops scale,vector_add,layernorm,softmax] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import subprocess
import time
from datetime import datetime, timezone
from typing import Any

import numpy as np


def _timed(fn: Any, n: int, gap_s: float) -> float:
    for _ in range(100):
        fn()
    out = []
    for _ in range(n):
        if gap_s:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return float(np.median(out)) * 1e6


def _size(cp: Any, s: Any, buf: mmap.mmap, nbytes: int, empty_kernel: Any, alias: Any) -> dict[str, Any]:
    """The modes of one size (each checked against NumPy), as functions to time."""
    rt = cp.cuda.runtime
    n = nbytes // 4
    off = (nbytes + 4095) // 4096 * 4096
    hx = np.frombuffer(buf, np.float32, n, offset=0)
    hy = np.frombuffer(buf, np.float32, n, offset=off)
    ho = np.frombuffer(buf, np.float32, n, offset=2 * off)
    hx[:] = np.arange(n, dtype=np.float32) % 97
    hy[:] = 1.5
    ref = hx + hy
    dx, dy = cp.empty(n, cp.float32), cp.empty(n, cp.float32)
    ax, ay, ao = alias(hx), alias(hy), alias(ho)
    keep: list[Any] = []

    def dma() -> None:
        rt.memcpyAsync(dx.data.ptr, hx.ctypes.data, nbytes, rt.memcpyHostToDevice, s.ptr)
        rt.memcpyAsync(dy.data.ptr, hy.ctypes.data, nbytes, rt.memcpyHostToDevice, s.ptr)
        with s:
            r = dx + dy
        rt.memcpyAsync(ho.ctypes.data, r.data.ptr, nbytes, rt.memcpyDeviceToHost, s.ptr)
        keep[:] = [r]

    def host() -> None:
        with s:
            r = ax + ay
            cp.copyto(ao, r)
        keep[:] = [r]

    def one() -> None:
        with s:
            cp.add(ax, ay, out=ao)

    def empty() -> None:
        empty_kernel((1,), (32,), (), stream=s)

    def plain(fn: Any) -> Any:
        def run() -> None:
            fn()
            s.synchronize()
        return run

    def graph(fn: Any) -> Any:
        fn()
        s.synchronize()
        pool = cp.cuda.MemoryPool()
        with cp.cuda.using_allocator(pool.malloc):
            s.begin_capture()
            fn()
            g = s.end_capture()
        held = (pool, list(keep))

        def run() -> None:
            g.launch(s)
            s.synchronize()
        run.held = held  # type: ignore[attr-defined]
        return run

    modes = {"dma": plain(dma), "dma-g": graph(dma), "host": plain(host), "host-g": graph(host),
             "one-g": graph(one), "empty-g": graph(empty)}
    for name, fn in modes.items():
        if name == "empty-g":
            continue
        ho[:] = -1
        fn()
        ok = bool(np.array_equal(ho, ref))
        print(f"  {nbytes:>8} B {name:8s} equal to NumPy: {ok}", flush=True)
        if not ok:
            raise SystemExit(f"{name} gave a wrong result at {nbytes} B")
    return modes


def _backend_rows(cp: Any, buf: mmap.mmap, addr: int, span: int, a: Any) -> list[dict[str, Any]]:
    """``backend.run`` of one op per size, its graph with copies and without, interleaved (see the module doc)."""
    from shmrpc import kernels
    from shmrpc.kernels import _backend_cupy

    rows: list[dict[str, Any]] = []
    default = _backend_cupy.DIRECT_MAX_BYTES
    be = kernels.select_backend("cupy")
    be.register_host(addr, span)
    rng = np.random.default_rng(0)
    try:
        for op in a.ops.split(","):
            names = list(kernels.REGISTRY[op].inputs)
            for nbytes in [int(s) for s in a.sizes.split(",")]:
                d = 64 if nbytes >= 256 else nbytes // 4
                shape = (max(1, nbytes // 4 // d), d)
                step = (nbytes + 4095) // 4096 * 4096
                specs = {n: kernels.TensorSpec(shape if n in ("x", "y") else (d,), "float32") for n in names}
                views = {n: np.frombuffer(buf, np.float32, int(np.prod(specs[n].shape)), i * step).reshape(specs[n].shape)
                         for i, n in enumerate(names)}
                out = np.frombuffer(buf, np.float32, int(np.prod(shape)), len(names) * step).reshape(shape)
                plans = {}
                for v in views.values():
                    v[...] = rng.standard_normal(v.shape)
                for arm, bound in (("backend-copies", 0), ("backend-direct", 1 << 40)):
                    _backend_cupy.DIRECT_MAX_BYTES = bound
                    be.unregister_host()
                    be.register_host(addr, span)
                    plans[arm] = be.plan([kernels.StepSpec(op, {n: n for n in names}, {"out": "o"})], specs, ["o"])
                    for _ in range(3):
                        be.run(plans[arm], views, {"o": out})
                    plans[arm] = (plans[arm], out.copy(), bound)
                same = plans["backend-copies"][1].tobytes() == plans["backend-direct"][1].tobytes()
                print(f"  backend.run {op} {nbytes} B: direct equal to copies: {same}", flush=True)
                if not same:
                    raise SystemExit(f"backend.run {op} {nbytes} B: the two graphs differ")
                x0 = views[names[0]]

                def call(plan: Any = None, x0: np.ndarray = x0, views: dict[str, np.ndarray] = views,
                         out: np.ndarray = out) -> None:
                    x0[0, 0] += 1  # the CPU writes the input, as a client does before it rings
                    be.run(plan, views, {"o": out})
                for r in range(a.rounds):
                    for arm in ("backend-copies", "backend-direct", "backend-bound"):
                        plan, _, bound = plans["backend-direct" if arm == "backend-bound" else arm]
                        _backend_cupy.DIRECT_MAX_BYTES = bound
                        be.unregister_host()  # the graphs go: captured again under this arm's bound
                        be.register_host(addr, span)
                        if arm == "backend-bound":  # the worker's way: bind once, call per request
                            run = be.bind(plan, views, {"o": out})

                            def fn(run: Any = run, x0: np.ndarray = x0) -> None:
                                x0[0, 0] += 1
                                run()
                        else:
                            def fn(plan: Any = plan) -> None:
                                call(plan)
                        rows.append({"op": op, "nbytes": nbytes, "mode": arm, "round": r + 1,
                                     "p50_us": _timed(fn, a.n, a.gap_us / 1e6)})
    finally:
        _backend_cupy.DIRECT_MAX_BYTES = default
        be.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,4096,65536,1048576")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gap-us", type=float, default=20.0, help="busy gap between calls (a worker's turn)")
    ap.add_argument("--ops", default="", help="ops timed through backend.run (comma-separated)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import cupy as cp

    rt = cp.cuda.runtime
    sizes = [int(s) for s in a.sizes.split(",")]
    span = 4 * max(sizes) + (1 << 16)
    buf = mmap.mmap(-1, span)
    base = np.frombuffer(buf, np.uint8)
    addr = base.ctypes.data
    rt.hostRegister(addr, span, 1)
    attrs = rt.pointerGetAttributes(addr)
    same = int(attrs.devicePointer) == addr
    facts = {"host_pointer_attr": int(rt.deviceGetAttribute(91, 0)), "device_pointer_is_host": same}
    print("facts", facts, flush=True)
    if not same:
        raise SystemExit("kernels may not use this host address: nothing to measure")

    def alias(view: np.ndarray) -> Any:
        mem = cp.cuda.UnownedMemory(view.ctypes.data, view.nbytes, view, 0)
        return cp.ndarray(view.shape, view.dtype, cp.cuda.MemoryPointer(mem, 0))

    s = cp.cuda.Stream(non_blocking=True)
    empty_kernel = cp.RawKernel('extern "C" __global__ void shmrpc_probe_empty() {}', "shmrpc_probe_empty")
    rows: list[dict[str, Any]] = []
    modes: list[str] = []
    for nbytes in sizes:
        got = _size(cp, s, buf, nbytes, empty_kernel, alias)
        modes = list(got)
        for r in range(a.rounds):
            for name, fn in got.items():
                rows.append({"nbytes": nbytes, "mode": name, "round": r + 1, "p50_us": _timed(fn, a.n, a.gap_us / 1e6)})
    rt.hostUnregister(addr)
    if a.ops:
        rows += _backend_rows(cp, buf, addr, span, a)
    print(f"\n{'bytes':>8} " + " ".join(f"{m:>8}" for m in modes))
    for nbytes in sizes:
        med = {m: float(np.median([x["p50_us"] for x in rows if x["nbytes"] == nbytes and x["mode"] == m]))
               for m in modes}
        print(f"{nbytes:>8} " + " ".join(f"{med[m]:8.1f}" for m in modes))
    for op in a.ops.split(",") if a.ops else []:
        for nbytes in sizes:
            got = [x for x in rows if x.get("op") == op and x["nbytes"] == nbytes]
            if got:
                med = {m: float(np.median([x["p50_us"] for x in got if x["mode"] == m]))
                       for m in ("backend-copies", "backend-direct", "backend-bound")}
                print(f"backend.run {op:12s} {nbytes:>8} B: copies {med['backend-copies']:7.1f}  "
                      f"direct {med['backend-direct']:7.1f}  bound {med['backend-bound']:7.1f} us")
    if a.out:
        commit = os.environ.get("SHMRPC_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                                                  capture_output=True, text=True).stdout.strip()
        props = cp.cuda.runtime.getDeviceProperties(0)
        doc = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
               "command": "python3 bench/gpu/direct_probe.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out"),
               "machine": {"gpu": props["name"].decode(), "cpus": os.cpu_count(), "python": platform.python_version(),
                           "cupy": cp.__version__},
               "facts": facts, "gap_us": a.gap_us, "rows": rows}
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
