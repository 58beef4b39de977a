"""GPU kernel benchmarks for shmrpc.kernels, with the ceilings measured in the same run.

Run on the GPU host::

    python bench/gpu_kernels.py --out bench/results/gpu_kernels.json          # full (~1-2 min)
    python bench/gpu_kernels.py --quick --out /tmp/smoke.json                 # smoke run

Measures (CUDA events around batches of calls queued behind a spin kernel, so Python's launch
cost is hidden; median over 5 batches, after warm-up):

1. device-to-device copy GB/s (bytes read + written) of a 2 GiB buffer: the HBM ceiling;
2. gemm_w4a16 for x (M, K) @ int4 W (K, N), M in 1/16/64, (K, N) in 8192x8192 and 4096x14336,
   rotating among enough weight sets that L2 (60 MB) cannot hold them; against fp16
   cuBLAS (cupy.matmul) of the same shape; GB/s of the bytes the kernel must read
   (packed weights + scales + zeros + x, + out) and that as a share of the copy ceiling; for
   M = 2..64 the op's default path is the tensor-core kernel (cuda/w4a16_mma.cu); the path before it
   (SHMRPC_W4A16_MMA=0: the float32 CUDA-core kernel for M <= 4, dequantize + cuBLAS above) is timed too
   ("previous_path_seconds"); for the op and for cuBLAS also the host's cost of one call (Python and the
   launch, timed while the spin kernel holds the GPU: "host_seconds_per_call") and what a caller that
   launches call after call sees (a plain loop and one synchronize: "eager_seconds");
3. layernorm_gelu on 8192 x 8192 float16: GB/s (read + write) vs the ceiling, and vs
   CuPy layernorm then gelu (unfused array code);
4. softmax on 8192 x 8192 float16 (float32 math): GB/s vs the ceiling, vs the array code on CuPy;
5. elementwise streaming through the backend: scale() on a pinned host buffer (H2D,
   kernel, D2H chunked over three streams): GB/s of bytes in + out;
6. correctness of each against the NumPy twin on this run's data (max relative error).

Prints a table last and writes JSON (date, GPU, CuPy version, command line, results).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

_SPIN = r"""extern "C" __global__ void spin(long long cycles) {
  long long t0 = clock64();
  while (clock64() - t0 < cycles) { }
}"""


def _timer(cp: Any, fn: Any, reps: int, warm: int = 3, batches: int = 5, host: list[float] | None = None) -> float:
    """Median over ``batches`` of the GPU seconds per ``fn()`` call, launch overhead hidden.

    A spin kernel holds the stream while the host enqueues ``reps`` calls between two
    CUDA events, so the events time the GPU work back to back, not Python's launch cost.
    ``host``: appended with the median host seconds per call of those enqueues (the GPU
    held, so the host never waits for it: the Python and launch cost of one call).
    """
    for _ in range(warm):
        fn()
    stream = cp.cuda.get_current_stream()
    stream.synchronize()
    spin = cp.RawKernel(_SPIN, "spin")
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    host_s = (time.perf_counter() - t0) / 3
    stream.synchronize()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    per_call: list[float] = []
    host_per_call: list[float] = []
    for _ in range(batches):
        spin((1,), (1,), (np.int64((host_s * reps * 1.5 + 2e-3) * 2.5e9),))
        a.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host_per_call.append((time.perf_counter() - t0) / reps)
        b.record()
        b.synchronize()
        per_call.append(cp.cuda.get_elapsed_time(a, b) / 1e3 / reps)
    if host is not None:
        host.append(statistics.median(host_per_call))
    return statistics.median(per_call)


def _eager(cp: Any, fn: Any, reps: int, batches: int = 5) -> float:
    """Median over ``batches`` of the wall seconds per ``fn()`` call in a plain loop of ``reps`` calls and one
    synchronize: what a caller that launches op after op sees (the larger of the host's and the GPU's cost)."""
    stream = cp.cuda.get_current_stream()
    fn()
    stream.synchronize()
    per_call: list[float] = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        stream.synchronize()
        per_call.append((time.perf_counter() - t0) / reps)
    return statistics.median(per_call)


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    g, w = got.astype(np.float64), want.astype(np.float64)
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))


def copy_ceiling(cp: Any, nbytes: int, reps: int) -> dict[str, float]:
    a = cp.ones(nbytes, dtype=cp.uint8)
    b = cp.empty_like(a)
    s = _timer(cp, lambda: cp.cuda.runtime.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, 3, cp.cuda.get_current_stream().ptr), reps)
    return {"bytes": nbytes, "seconds": s, "GBps": 2 * nbytes / s / 1e9}


def probe_record(cp: Any, script: str, argv: list[str] | None, n_sm: int) -> dict[str, Any]:
    """The head of a probe's JSON (bench/gpu/*_probe.py): date, device, SMs, versions, commit (SHMRPC_COMMIT), command
    and how it times."""
    props = cp.cuda.runtime.getDeviceProperties(0)
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]), "sm_count": n_sm,
        "cupy": cp.__version__, "numpy": np.__version__, "commit": os.environ.get("SHMRPC_COMMIT", "unknown"),
        "command": " ".join(["python3", script, *(argv if argv is not None else sys.argv[1:])]),
        "timer": "CUDA events around batches of --reps calls queued behind a spin kernel, median of 5 batches"}


def write_json(path: str, res: dict[str, Any]) -> None:
    """A probe's document written to ``path`` (its folder made), indented."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def w4a16_sets(cp: Any, k: int, n: int, gs: int = 128, l2_bytes: int = 60 << 20) -> tuple[list[tuple[Any, Any, Any]], Any]:
    """Enough (qweight, scales, zeros) sets of a K x N int4 weight that rotating through them keeps it out of L2
    (three times ``l2_bytes`` in all, two sets at least), and the random state they came from (seed 0)."""
    g = k // gs
    packed = k * n // 2 + 4 * g * n
    rs = cp.random.RandomState(0)
    return [(rs.randint(0, 256, (k // 2, n), dtype=cp.uint8),
             rs.uniform(0.005, 0.02, (g, n)).astype(cp.float16),
             rs.randint(0, 16, (g, n)).astype(cp.float16)) for _ in range(max(2, -(-3 * l2_bytes // packed)))], rs


def in_specs_of(ts: Any, m: int, k: int, n: int, g: int) -> dict[str, Any]:
    """gemm_w4a16's input specs (``ts``: TensorSpec) for float16 x (M, K) and a K x N int4 weight of ``g`` groups."""
    return {"x": ts((m, k), "float16"), "qweight": ts((k // 2, n), "uint8"), "scales": ts((g, n), "float16"),
            "zeros": ts((g, n), "float16")}


def bench_w4a16(cp: Any, m: int, k: int, n: int, reps: int, ceiling: float, l2_bytes: int = 60 << 20) -> dict[str, Any]:
    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels.quant import dequantize_int4, use_tuning, w4a16_choice

    gs = 128
    g = k // gs
    packed = k * n // 2 + 4 * g * n
    sets, rs = w4a16_sets(cp, k, n, gs, l2_bytes)
    n_sets = len(sets)
    x = (rs.standard_normal((m, k)) / np.sqrt(k)).astype(cp.float16)
    spec = REGISTRY["gemm_w4a16"]
    ws: dict[str, Any] = {}
    in_specs = in_specs_of(TensorSpec, m, k, n, g)
    out_specs = {"out": TensorSpec((m, n), "float16")}
    calls = [OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, in_specs, out_specs, {}, {}, ws) for q, s, z in sets]
    it = iter(range(10**9))
    host: list[float] = []
    t = _timer(cp, lambda: spec.cupy(calls[next(it) % n_sets]), reps, host=host)
    t_eager = _eager(cp, lambda: spec.cupy(calls[next(it) % n_sets]), reps)
    with use_tuning(mma=False):  # as SHMRPC_W4A16_MMA=0
        t_prev = _timer(cp, lambda: spec.cupy(calls[next(it) % n_sets]), reps)
        prev_out = spec.cupy(calls[0])["out"].get()
    got = spec.cupy(calls[0])["out"].get()
    q, s, z = (a.get() for a in sets[0])
    want = (x.get().astype(np.float32) @ dequantize_int4(np, q, s, z)).astype(np.float16)
    mma = w4a16_choice(m, k, n, gs)
    # fp16 cuBLAS of the same shape, rotating dense weight sets
    n16 = max(2, -(-3 * l2_bytes // (k * n * 2)))
    w16 = [rs.standard_normal((k, n), dtype=cp.float32).astype(cp.float16) for _ in range(n16)]
    it2 = iter(range(10**9))
    t16 = _timer(cp, lambda: cp.matmul(x, w16[next(it2) % n16]), reps, host=host)
    t16_eager = _eager(cp, lambda: cp.matmul(x, w16[next(it2) % n16]), reps)
    moved = packed + m * k * 2 + m * n * 2
    sets.clear()
    w16.clear()
    cp.get_default_memory_pool().free_all_blocks()
    return {"M": m, "K": k, "N": n, "group_size": gs, "weight_sets": n_sets, "seconds": t, "GBps": moved / t / 1e9,
            "of_ceiling": moved / t / 1e9 / ceiling, "previous_path_seconds": t_prev,
            "previous_path_rel_err": _rel(prev_out, want), "speedup_vs_previous": t_prev / t,
            "path": f"mma {mma}" if mma else "fused float32 (CUDA cores)", "cublas_fp16_seconds": t16, "speedup_vs_fp16": t16 / t,
            "max_rel_err_vs_numpy": _rel(got, want), "host_seconds_per_call": host[0], "eager_seconds": t_eager,
            "cublas_fp16_host_seconds_per_call": host[1], "cublas_fp16_eager_seconds": t16_eager}


def bench_layernorm_gelu(cp: Any, rows: int, d: int, reps: int, ceiling: float) -> dict[str, Any]:
    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._dtypes import from_float
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels.elementwise import gelu_float
    from shmrpc.kernels.norm import layernorm_float

    rs = cp.random.RandomState(1)
    x = rs.standard_normal((rows, d), dtype=cp.float32).astype(cp.float16)
    g = rs.uniform(0.5, 1.5, d).astype(cp.float16)
    b = rs.uniform(-0.1, 0.1, d).astype(cp.float16)
    spec = REGISTRY["layernorm_gelu"]
    ts = TensorSpec((rows, d), "float16")
    call = OpCall(cp, {"x": x, "gamma": g, "beta": b}, {"x": ts, "gamma": TensorSpec((d,), "float16"),
                  "beta": TensorSpec((d,), "float16")}, {"out": ts}, {"eps": 1e-5}, {})
    t = _timer(cp, lambda: spec.cupy(call), reps)

    def unfused() -> Any:
        f = layernorm_float(cp, x.astype(cp.float32), g.astype(cp.float32), b.astype(cp.float32), 1e-5)
        return from_float(cp, gelu_float(cp, f), "float16")

    tu = _timer(cp, unfused, max(5, reps // 5))
    got = spec.cupy(call)["out"].get()
    sub = slice(0, min(rows, 512))
    ref_call = OpCall(np, {"x": x[sub].get(), "gamma": g.get(), "beta": b.get()}, call.in_specs, call.out_specs, {"eps": 1e-5}, {})
    want = spec.numpy(ref_call)["out"]
    moved = 2 * rows * d * 2
    return {"rows": rows, "D": d, "seconds": t, "GBps": moved / t / 1e9, "of_ceiling": moved / t / 1e9 / ceiling,
            "unfused_seconds": tu, "speedup_vs_unfused": tu / t, "max_rel_err_vs_numpy": _rel(got[sub], want)}


def bench_softmax(cp: Any, rows: int, d: int, reps: int, ceiling: float) -> dict[str, Any]:
    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels.norm import _softmax

    rs = cp.random.RandomState(3)
    x = (rs.standard_normal((rows, d), dtype=cp.float32) * 4).astype(cp.float16)
    spec = REGISTRY["softmax"]
    ts = TensorSpec((rows, d), "float16")
    call = OpCall(cp, {"x": x}, {"x": ts}, {"out": ts}, {}, {})
    t = _timer(cp, lambda: spec.cupy(call), reps)
    tu = _timer(cp, lambda: _softmax(call), max(5, reps // 5))  # the array code: unfused CuPy
    got = spec.cupy(call)["out"].get()
    sub = slice(0, min(rows, 512))
    f = x[sub].get().astype(np.float64)
    e = np.exp(f - f.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    moved = 2 * rows * d * 2
    return {"rows": rows, "D": d, "seconds": t, "GBps": moved / t / 1e9, "of_ceiling": moved / t / 1e9 / ceiling,
            "unfused_seconds": tu, "speedup_vs_unfused": tu / t, "max_rel_err_vs_float64": _rel(got[sub], want)}


def bench_stream(cp: Any, nbytes: int, reps: int) -> dict[str, Any]:
    from shmrpc.kernels import StepSpec, TensorSpec, select_backend

    n = nbytes // 4
    x = np.random.default_rng(2).standard_normal(n, dtype=np.float32)
    o = np.empty_like(x)
    with select_backend("cupy") as be:
        for a in (x, o):
            be.register_host(a.ctypes.data, a.nbytes)
        plan = be.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0, "b": 1.0})], {"x": TensorSpec((n,), "float32")}, ["o"])
        runs = [be.run(plan, {"x": x}, {"o": o}) for _ in range(reps + 2)][2:]
        err = _rel(o, 2 * x + 1)
        be.unregister_host()
    tot = statistics.median(r["total"] for r in runs)
    return {"bytes_in": nbytes, "bytes_out": nbytes, "seconds": tot, "GBps_in_plus_out": 2 * nbytes / tot / 1e9,
            "chunks": runs[0].get("chunks", 1.0), "max_rel_err": err}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="small sizes, few reps (smoke run)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per batch of 5 (default 50, quick 10)")
    args = ap.parse_args(argv)
    import cupy as cp

    reps = args.reps or (10 if args.quick else 50)
    props = cp.cuda.runtime.getDeviceProperties(0)
    res: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "gpu": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "sms": int(props["multiProcessorCount"]), "cupy": cp.__version__, "numpy": np.__version__,
        "command": " ".join(["python", *sys.argv]), "quick": args.quick, "reps": reps,
        "commit": os.environ.get("SHMRPC_COMMIT", "unknown"),
    }
    res["copy_ceiling"] = copy_ceiling(cp, (256 << 20) if args.quick else (2 << 30), reps)
    ceiling = res["copy_ceiling"]["GBps"]
    shapes = [(8192, 8192), (4096, 14336)]
    ms = (1, 16) if args.quick else (1, 4, 16, 32, 64)
    res["gemm_w4a16"] = [bench_w4a16(cp, m, k, n, reps, ceiling) for k, n in shapes for m in ms]
    res["layernorm_gelu"] = bench_layernorm_gelu(cp, 1024 if args.quick else 8192, 8192, reps, ceiling)
    res["softmax"] = bench_softmax(cp, 1024 if args.quick else 8192, 8192, reps, ceiling)
    res["stream_scale"] = bench_stream(cp, (64 << 20) if args.quick else (256 << 20), min(reps, 20))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"\n{res['gpu']} ({res['sms']} SMs), CuPy {res['cupy']}; copy ceiling {ceiling:.0f} GB/s (read+write)")
    print(f"{'case':<34}{'time us':>10}{'GB/s':>9}{'% ceil':>8}{'vs ref':>9}{'rel err':>10}{'host us':>9}"
          f"{'eager us':>10}{'cuBLAS host / eager us':>24}")
    for r in res["gemm_w4a16"]:
        label = f"w4a16 M={r['M']} K={r['K']} N={r['N']}"
        print(f"{label:<34}{r['seconds'] * 1e6:>10.1f}{r['GBps']:>9.0f}"
              f"{100 * r['of_ceiling']:>7.0f}%{r['speedup_vs_fp16']:>8.2f}x{r['max_rel_err_vs_numpy']:>10.1e}"
              f"{r['host_seconds_per_call'] * 1e6:>9.1f}{r['eager_seconds'] * 1e6:>10.1f}"
              f"{r['cublas_fp16_host_seconds_per_call'] * 1e6:>15.1f} / {r['cublas_fp16_eager_seconds'] * 1e6:.1f}")
    r = res["layernorm_gelu"]
    label = f"layernorm_gelu {r['rows']}x{r['D']} fp16"
    print(f"{label:<34}{r['seconds'] * 1e6:>10.1f}{r['GBps']:>9.0f}"
          f"{100 * r['of_ceiling']:>7.0f}%{r['speedup_vs_unfused']:>8.2f}x{r['max_rel_err_vs_numpy']:>10.1e}")
    r = res["softmax"]
    label = f"softmax {r['rows']}x{r['D']} fp16"
    print(f"{label:<34}{r['seconds'] * 1e6:>10.1f}{r['GBps']:>9.0f}"
          f"{100 * r['of_ceiling']:>7.0f}%{r['speedup_vs_unfused']:>8.2f}x{r['max_rel_err_vs_float64']:>10.1e}")
    r = res["stream_scale"]
    label = f"scale H2D+D2H {r['bytes_in'] >> 20} MiB each way"
    print(f"{label:<34}{r['seconds'] * 1e6:>10.1f}{r['GBps_in_plus_out']:>9.0f}"
          f"{'':>8}{'':>9}{r['max_rel_err']:>10.1e}")
    for r in res["gemm_w4a16"]:
        print(f"  M={r['M']} K={r['K']}: path {r['path']}; previous path {r['previous_path_seconds'] * 1e6:.1f} us "
              f"({r['speedup_vs_previous']:.2f}x now, its rel err {r['previous_path_rel_err']:.1e})")
    print("vs ref: w4a16 = speedup over fp16 cuBLAS; layernorm_gelu, softmax = speedup over unfused CuPy")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
