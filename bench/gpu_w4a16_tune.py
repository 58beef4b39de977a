"""Tuning sweep for the tensor-core gemm_w4a16 kernel (cuda/w4a16_mma.cu): the measured table behind
``_w4a16_config._MMA_TABLE``.

Run on the GPU host::

    python bench/gpu_w4a16_tune.py --out bench/results/w4a16-mma-tuning.json

For each (M, K, N) and configuration (MT, NWORD, WARPS, blocks per SM) it times the op (CUDA events,
median of 5 batches, weight sets rotated so L2 cannot hold them; see gpu_kernels._timer), checks the
result against a float64 reference of the dequantized weights, and prints the best configuration per
row next to the old path (SHMRPC_W4A16_MMA=0) and fp16 cuBLAS of the same shape.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernels import _timer, in_specs_of, w4a16_sets  # noqa: E402

_M16 = [(1, 2, 4, 2, 0), (1, 1, 4, 4, 0), (1, 2, 4, 2, 4), (1, 2, 4, 4, 4), (1, 2, 4, 2, 3), (1, 1, 4, 2, 4),
        (1, 1, 4, 4, 4), (1, 1, 4, 2, 6), (1, 1, 4, 4, 6), (1, 1, 8, 2, 4), (1, 1, 8, 1, 4)]
CFGS = {1: _M16, 16: _M16, 32: [(2, 1, 4, 4, 0), (2, 1, 4, 2, 4), (2, 1, 4, 4, 4), (2, 2, 4, 2, 3), (2, 2, 4, 1, 3)],
        64: [(4, 1, 4, 2, 0), (4, 1, 4, 2, 3), (4, 1, 4, 1, 3), (4, 1, 4, 4, 3), (4, 1, 2, 2, 4), (4, 1, 2, 4, 4)]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ms", default="1,16,32,64")
    ap.add_argument("--shapes", default="8192x8192,4096x14336", help="KxN,...")
    ap.add_argument("--cfgs", default="", help="only these configurations: MT,NWORD,WARPS,BPS,S;...")
    args = ap.parse_args(argv)
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels.quant import dequantize_int4, use_tuning

    spec = REGISTRY["gemm_w4a16"]
    props = cp.cuda.runtime.getDeviceProperties(0)
    res: dict[str, Any] = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                           "gpu": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
                           "command": " ".join(["python", *sys.argv]), "commit": os.environ.get("SHMRPC_COMMIT", "unknown"),
                           "rows": []}
    l2 = 60 << 20
    only = [tuple(int(v) for v in c.split(",")) for c in args.cfgs.split(";") if c]
    for k, n in (tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")):
        gs = 128
        g = k // gs
        sets, rs = w4a16_sets(cp, k, n, gs, l2)
        n_sets = len(sets)
        w_ref = dequantize_int4(np, *(a.get() for a in sets[0])).astype(np.float64)
        n16 = max(2, -(-3 * l2 // (k * n * 2)))
        w16 = [rs.standard_normal((k, n), dtype=cp.float32).astype(cp.float16) for _ in range(n16)]
        for m in (int(v) for v in args.ms.split(",")):
            x = (rs.standard_normal((m, k)) / np.sqrt(k)).astype(cp.float16)
            want = x.get().astype(np.float64) @ w_ref
            in_specs = in_specs_of(TensorSpec, m, k, n, g)
            calls = [OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, in_specs,
                            {"out": TensorSpec((m, n), "float16")}, {}, {}, {}) for q, s, z in sets]
            it = iter(range(10**9))

            def once(calls: list[Any] = calls, it: Any = it, n_sets: int = n_sets) -> Any:
                return spec.cupy(calls[next(it) % n_sets])["out"]

            def err(calls: list[Any] = calls, want: np.ndarray = want) -> float:
                got = spec.cupy(calls[0])["out"].get().astype(np.float64)
                return float(np.abs(got - want).max() / np.abs(want).max())

            it16 = iter(range(10**9))
            t16 = _timer(cp, lambda x=x, it16=it16: cp.matmul(x, w16[next(it16) % n16]), args.reps)  # noqa: B023
            with use_tuning(mma=False):  # as SHMRPC_W4A16_MMA=0
                t_old, e_old = _timer(cp, once, args.reps), err()
            row: dict[str, Any] = {"M": m, "K": k, "N": n, "cublas_fp16_seconds": t16, "old_path_seconds": t_old,
                                   "old_path_rel_err": e_old, "configs": []}
            for cfg in only or CFGS.get(m, CFGS[64]):
                with use_tuning(mma_cfg=cfg if len(cfg) == 6 else (*cfg, 0)[:5]):  # as SHMRPC_W4A16_MMA_CFG
                    t, e = _timer(cp, once, args.reps), err()
                row["configs"].append({"cfg": cfg, "seconds": t, "rel_err": e})
            best = min(row["configs"], key=lambda c: c["seconds"])
            row["best"] = best
            t_def = _timer(cp, once, args.reps)
            row["default_seconds"], row["default_rel_err"] = t_def, err()
            res["rows"].append(row)
            print(f"M={m:<3} K={k:<5} N={n:<6} cuBLAS {t16 * 1e6:7.1f}  old {t_old * 1e6:7.1f} ({e_old:.1e})  default "
                  f"{t_def * 1e6:7.1f} ({row['default_rel_err']:.1e})  best {best['seconds'] * 1e6:7.1f} {best['cfg']} "
                  f"({best['rel_err']:.1e})  best/cuBLAS {t16 / best['seconds']:.2f}x", flush=True)
            for c in row["configs"]:
                print(f"      {c['cfg']}: {c['seconds'] * 1e6:7.1f} us  err {c['rel_err']:.1e}")
        sets.clear()
        w16.clear()
        cp.get_default_memory_pool().free_all_blocks()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
