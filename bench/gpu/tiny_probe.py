"""Where the time of a tiny GPU request goes: each layer timed alone on the GPU machine.

    python bench/gpu/tiny_probe.py              the layers, backend.run with and without CUDA graphs, workers
    python bench/gpu/tiny_probe.py --profile    cProfile of tiny CuPy backend runs
    python bench/gpu/tiny_probe.py --profile-batch    cProfile of run_batch (gemm, B=8), memcpy path and gather path
    python bench/gpu/tiny_probe.py --batch [--out FILE.json]
        in-process requests/s of gemm 16x256x256 float16 (x and w sent per request) through
        Backend.run one request at a time vs Backend.run_batch over B requests (plain joint run, and
        on CuPy the gather/scatter launches and the CUDA graphs), B = 1, 2, 4, 8, 16, on NumPy (always)
        and CuPy (when it sees a GPU); views in page-locked memory on CuPy, as the worker's are; first
        checks gather == plain and graph == plain bit for bit (and records whether gather == run)
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
    for kind, graphs in (("cupy", True), ("cupy", False), ("numpy", False)):
        be = kernels.select_backend(kind)
        be.warmup()
        if kind == "cupy" and not graphs:
            be._graphs.limit = 0  # type: ignore[attr-defined]  # the plain path: device buffers, no events
        label = f"{kind} {'graph' if graphs else 'plain' if kind == 'cupy' else ''}"
        plan = be.plan([kernels.StepSpec("scale", {"x": "x"}, {"out": "out"}, {"a": 2.0})],
                       {"x": kernels.TensorSpec((16,), "float32")}, ["out"])
        print(f"backend.run {label:11s}              ", pct(timed(lambda be=be, plan=plan: be.run(plan, {"x": h}, {"out": o}))))
        print(f"backend.run {label:11s}, 100 us idle ", pct(timed(lambda be=be, plan=plan: be.run(plan, {"x": h}, {"out": o}),
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


def _gemm_views(buf: np.ndarray, count: int, m: int, k: int, n: int, rng: np.random.Generator) -> list:  # type: ignore[type-arg]
    """``count`` (inputs, outputs) view pairs of gemm (x (m, k), w (k, n) -> o (m, n)) at 4 KiB-aligned offsets of ``buf``."""
    items, off = [], 0
    for _ in range(count):
        views = []
        for shape in ((m, k), (k, n), (m, n)):
            views.append(np.frombuffer(buf, np.float16, shape[0] * shape[1], off).reshape(shape))
            off += -(-views[-1].nbytes // 4096) * 4096
        x, w, o = views
        x[:] = rng.standard_normal(x.shape)
        w[:] = rng.standard_normal(w.shape) * 0.05
        items.append(({"x": x, "w": w}, {"o": o}))
    return items


def batch(out_path: str | None, rounds: int = 3) -> None:
    """Requests/s of gemm 16x256x256 float16 in process: run (one by one), run_batch plain and run_batch with
    CUDA graphs (CuPy), at B = 1, 2, 4, 8, 16; modes interleaved per round, medians of the rounds' medians."""
    from shmrpc import kernels

    kinds = ["numpy"]
    try:
        import cupy as cp

        if cp.cuda.runtime.getDeviceCount() > 0:
            kinds.append("cupy")
    except Exception:  # noqa: BLE001 - NumPy only on a machine without CuPy
        cp = None
    from shmrpc.kernels import _backend_numpy

    rng = np.random.default_rng(0)
    results: list[dict[str, object]] = []
    checks: list[dict[str, object]] = []
    m, k, n = 16, 256, 256
    sizes = (1, 2, 4, 8, 16)
    for kind in kinds:
        be = kernels.select_backend(kind)
        plan = be.plan([kernels.StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "o"})],
                       {"x": kernels.TensorSpec((m, k), "float16"), "w": kernels.TensorSpec((k, n), "float16")}, ["o"])
        per = 2 * (m * k + k * n + m * n)
        nmax = max(sizes)
        if kind == "cupy":
            mem = cp.cuda.alloc_pinned_memory(nmax * (per + 3 * 4096))
            buf = np.frombuffer(mem, np.uint8)
        else:
            buf = np.empty(nmax * (per + 3 * 4096), np.uint8)
        items = _gemm_views(buf, nmax, m, k, n, rng)
        graphs = getattr(be, "_batch_graphs", None)
        gg = getattr(be, "_gather_graphs", None)
        limit = graphs.limit if graphs is not None else 0
        gg_limit = gg.limit if gg is not None else 0
        can_gather = bool(getattr(be, "gather_batches", False))
        if can_gather:
            be.gather_min_batch = 2  # type: ignore[attr-defined]  # measured at every B, whatever the default
        modes = ["run", "run_batch plain"] + (["run_batch gather"] if can_gather else []) + (
            ["run_batch graph"] if graphs is not None and limit else []) + (
            ["run_batch gather-graph"] if can_gather and gg_limit else [])
        if kind == "numpy":
            modes = ["run", "run_batch plain"]
        elif not can_gather:
            print(f"gather path unavailable: {be._host_access.why!r}")  # type: ignore[attr-defined]

        def once(group: list, mode: str, be: object = be, plan: object = plan, graphs: object = graphs,  # type: ignore[type-arg]
                 limit: int = limit, can_gather: bool = can_gather, gg: object = gg,
                 gg_limit: int = gg_limit) -> list:  # type: ignore[type-arg]
            if mode == "run":
                for ins, outs in group:
                    be.run(plan, ins, outs)  # type: ignore[attr-defined]
                return []
            if graphs is not None:
                graphs.limit = limit if mode == "run_batch graph" else 0  # type: ignore[attr-defined]
                be.gather_batches = can_gather and mode in ("run_batch gather", "run_batch gather-graph")  # type: ignore[attr-defined]
            if gg is not None:
                gg.limit = gg_limit if mode == "run_batch gather-graph" else 0  # type: ignore[attr-defined]
            return be.run_batch(plan, group)  # type: ignore[attr-defined, no-any-return]

        if graphs is not None:  # correctness first: gather and graph vs plain joint run, bit for bit, at every B
            for size in sizes[1:]:
                group = items[:size]
                once(group, "run")
                per_req = [o["o"].copy() for _, o in group]
                once(group, "run_batch plain")
                want = [o["o"].copy() for _, o in group]
                row: dict[str, object] = {"batch": size}
                for mode in modes[2:]:
                    for _, o in group:
                        o["o"][:] = 0
                    res = [once(group, mode) for _ in range(3)][-1]
                    same = all(o["o"].tobytes() == w.tobytes() for (_, o), w in zip(group, want))
                    served = sorted({k for r in res if isinstance(r, dict) for k in ("gather", "graph") if k in r})
                    row[mode.split()[-1] + "_bit_equal_plain"] = same
                    row[mode.split()[-1] + "_served_by"] = served
                    print(f"check B={size:2d}: {mode} output == plain joint output, bit for bit: {same} (served by {served})")
                row["plain_bit_equal_run"] = all(w.tobytes() == p.tobytes() for w, p in zip(want, per_req))
                row["plain_max_abs_diff_run"] = max(float(np.abs(w.astype(np.float64) - p.astype(np.float64)).max())
                                                    for w, p in zip(want, per_req))
                print(f"check B={size:2d}: plain joint output == run one by one, bit for bit: {row['plain_bit_equal_run']} "
                      f"(max abs diff {row['plain_max_abs_diff_run']})")
                checks.append(row)
            print(f"batch graphs: {len(graphs)} held, {graphs.captures} captures, last error {graphs.last_error!r}")
            if gg is not None:
                print(f"gather graphs: {len(gg)} held, {gg.captures} captures, last error {gg.last_error!r}")
        meds: dict[tuple[str, int], list[float]] = {}
        for _ in range(rounds):
            for size in sizes:
                for mode in modes:
                    if mode != "run" and size == 1:
                        continue  # run_batch of one request is run
                    _backend_numpy.BATCH_JOINT = mode != "run"
                    ts = timed(lambda g=items[:size], md=mode: once(g, md), n=300 if kind == "cupy" else 20)
                    meds.setdefault((mode, size), []).append(float(np.median(ts)))
        print(f"| {kind} requests/s | " + " | ".join(f"B={sz}" for sz in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for mode in modes:
            cells = []
            for size in sizes:
                r = meds.get((mode, size))
                if r is None:
                    cells.append("—")
                    continue
                med = float(np.median(r))
                results.append({"backend": kind, "mode": mode, "batch": size, "median_s": med, "requests_per_s": size / med,
                                "round_medians_s": r})
                cells.append(f"{size / med:,.0f}".replace(",", " "))
            print(f"| {mode} | " + " | ".join(cells) + " |")
        if graphs is not None:
            graphs.limit = limit
            be.gather_batches = can_gather  # type: ignore[attr-defined]
            print(f"batch graphs: {len(graphs)} held, {graphs.captures} captures, {graphs.launches} launches, "
                  f"last error {graphs.last_error!r}")
        if gg is not None:
            gg.limit = gg_limit
            print(f"gather graphs: {len(gg)} held, {gg.captures} captures, {gg.launches} launches, "
                  f"last error {gg.last_error!r}")
        be.close()
    _backend_numpy.BATCH_JOINT = False
    if out_path:
        import datetime
        import os
        import platform

        gpu = ""
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
        doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "command": " ".join(sys.argv),
               "commit": os.environ.get("SHMRPC_COMMIT", "unknown"), "python": platform.python_version(),
               "cpu_count": os.cpu_count(), "gpu": gpu, "cupy": getattr(cp, "__version__", None),
               "what": "gemm 16x256x256 float16, x and w per request, in process, views in page-locked memory (CuPy); "
                       "modes: run = Backend.run one by one; run_batch plain = memcpy per tensor per request (graphs, "
                       "gather off); gather = one gather and one scatter launch (graphs off); graph = batch graphs on "
                       "(gather off; the same addresses every call); gather-graph = graphs of gathered batches, one per (plan, B) "
                       "(slot-keyed graphs off); "
                       f"{rounds} rounds, modes interleaved, median of the rounds' medians of 300 calls",
               "checks": checks, "results": results}
        with open(out_path, "w") as f:
            json.dump(doc, f, indent=2)


def profile_batch(size: int = 8, calls: int = 2000) -> None:
    """cProfile of ``calls`` run_batch calls of gemm 16x256x256 float16 over ``size`` page-locked requests,
    plain joint run (memcpy per tensor) and gather/scatter launches: where the Python time of a batch goes."""
    import cProfile
    import pstats

    import cupy as cp

    from shmrpc import kernels

    be = kernels.select_backend("cupy")
    be.warmup()
    be._batch_graphs.limit = 0  # type: ignore[attr-defined]
    be._gather_graphs.limit = 0  # type: ignore[attr-defined]
    be.gather_min_batch = 2  # type: ignore[attr-defined]
    m, k, n = 16, 256, 256
    plan = be.plan([kernels.StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "o"})],
                   {"x": kernels.TensorSpec((m, k), "float16"), "w": kernels.TensorSpec((k, n), "float16")}, ["o"])
    mem = cp.cuda.alloc_pinned_memory(size * (2 * (m * k + k * n + m * n) + 3 * 4096))
    items = _gemm_views(np.frombuffer(mem, np.uint8), size, m, k, n, np.random.default_rng(0))
    for gather in (False, True):
        be.gather_batches = gather  # type: ignore[attr-defined]
        ts = timed(lambda: be.run_batch(plan, items), 500)
        print(f"run_batch B={size} {'gather' if gather else 'plain '}: {pct(ts)}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            be.run_batch(plan, items)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(18)
    be.close()


if __name__ == "__main__":
    if "--profile-batch" in sys.argv:
        profile_batch()
    elif "--profile" in sys.argv:
        profile_backend()
    elif "--batch" in sys.argv:
        batch(sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None)
    else:
        main()
