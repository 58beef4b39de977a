"""The host's cost of one gemm_w4a16 call on the CuPy path, in pieces, with the GPU held busy.

    python3 bench/gpu/launch_probe.py [--ms 1,64] [--k 8192] [--n 8192] [--out FILE.json]

Per M: the op (its destination given, as the worker gives it), then the pieces of its launch: ``get_function``, the
kernel launch itself (through the RawKernel and through its driver Function), ``w4a16_choice`` and the inputs' layout
checks. Each figure is the median over 7 batches of the wall time per call of 400 calls enqueued while a spin kernel
holds the GPU (so the host never waits for it). Then, per M, how many functions the shared-memory opt-in table
(``quant._WK_SMEM_SET``) holds after 300 more calls of the op: one per kernel the calls used, unless a function
object is made per call. Prints a table; ``--out`` writes JSON (date, command, machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

_SPIN = r'''extern "C" __global__ void spin(long long c) { long long t = clock64(); while (clock64() - t < c) { } }'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,64")
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--out")
    args = ap.parse_args()
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec, quant
    from shmrpc.kernels._cuda import get_function
    from shmrpc.kernels._registry import OpCall

    spin = cp.RawKernel(_SPIN, "spin")
    dev = cp.cuda.Device()

    def host_us(fn: Any, reps: int = 400, batches: int = 7) -> float:
        fn()
        dev.synchronize()
        per: list[float] = []
        for _ in range(batches):
            spin((1,), (1,), (np.int64(4e7),))  # ~20 ms at 2 GHz: longer than the enqueues
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            per.append((time.perf_counter() - t0) / reps)
            dev.synchronize()
        return statistics.median(per) * 1e6

    k, n, gs = args.k, args.n, 128
    g = k // gs
    rs = cp.random.RandomState(0)
    q = rs.randint(0, 256, (k // 2, n), dtype=cp.uint8)
    s = rs.uniform(0.005, 0.02, (g, n)).astype(cp.float16)
    z = rs.randint(0, 16, (g, n)).astype(cp.float16)
    spec = REGISTRY["gemm_w4a16"]
    rows: list[dict[str, Any]] = []
    for m in (int(v) for v in args.ms.split(",")):
        x = (rs.standard_normal((m, k)) / np.sqrt(k)).astype(cp.float16)
        out = cp.empty((m, n), dtype=cp.float16)
        ins = {"x": TensorSpec((m, k), "float16"), "qweight": TensorSpec((k // 2, n), "uint8"),
               "scales": TensorSpec((g, n), "float16"), "zeros": TensorSpec((g, n), "float16")}
        call = OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, ins,
                      {"out": TensorSpec((m, n), "float16")}, {}, {"out": out}, {})
        cfg = quant.w4a16_choice(m, k, n, gs)
        row: dict[str, Any] = {"M": m, "K": k, "N": n, "configuration": cfg,
                               "op_us": host_us(lambda call=call: spec.cupy(call))}
        arrays = (x, q, s, z)
        row["layout_checks_us"] = host_us(lambda a=arrays: all(v.flags.c_contiguous and v.data.ptr % 16 == 0 for v in a))
        row["w4a16_choice_us"] = host_us(lambda m=m: quant.w4a16_choice(m, k, n, gs))
        launch = getattr(quant, "_launch_of", None)
        if cfg is not None and launch is not None:
            from shmrpc.kernels._cuda import sm_count

            lo = launch("F16", m, k, n, gs, cfg, sm_count())
            fn = get_function(lo.file, lo.names, lo.name, lo.arch)
            row["get_function_us"] = host_us(lambda lo=lo: get_function(lo.file, lo.names, lo.name, lo.arch))
            a = ((x, q, s, z, out, *lo.tail) if not lo.partials else
                 (x, q, s, z, quant._partials(call, lo.partials), quant._counters(call, lo.tiles), out, *lo.tail))
            block = (32 * lo.warps,)
            row["launch_us"] = host_us(lambda fn=fn, lo=lo, a=a, b=block: fn(lo.grid, b, a, shared_mem=lo.smem))
            if hasattr(fn, "kernel"):
                kf = fn.kernel
                row["launch_driver_function_us"] = host_us(lambda kf=kf, lo=lo, a=a, b=block: kf(lo.grid, b, a, shared_mem=lo.smem))
        for _ in range(300):
            spec.cupy(call)
        dev.synchronize()
        row["opt_in_table_entries_after_300_calls"] = len(quant._WK_SMEM_SET)
        rows.append(row)
    keys = ("op_us", "layout_checks_us", "w4a16_choice_us", "get_function_us", "launch_us", "launch_driver_function_us",
            "opt_in_table_entries_after_300_calls")
    print(f"{'M':>4} {'configuration':<24}" + "".join(f"{kk.replace('_us', ''):>16}" for kk in keys))
    for r in rows:
        print(f"{r['M']:>4} {str(r['configuration']):<24}" + "".join(
            f"{r[kk]:>16.1f}" if kk in r and kk.endswith("_us") else f"{r.get(kk, '-'):>16}" for kk in keys))
    if args.out:
        from shmrpc.bench._report import write_probe

        write_probe({"mode": "w4a16-launch-probe", "unit": "µs per call (host), GPU held", "rows": rows}, None, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
