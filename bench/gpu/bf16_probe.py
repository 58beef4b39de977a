"""Probe: gemm_w4a16 with bfloat16 activations next to float16 ones, in one call: the same shapes, the same int4
weight sets (rotated so that L2 cannot hold them), the op's own choice of kernel (its table is the same for both
dtypes), timed as ``bench/gpu_kernels.py`` times it (``_timer``: CUDA events around batches queued behind a spin
kernel, median of 5 batches), each result compared with float64 ``x @ dequantize_int4(...)`` of the activations as
the op sees them (relative to max |out|). Prints a table and writes JSON (date, commit from SHMRPC_COMMIT, device,
command) to ``--out``.

    python3 bench/gpu/bf16_probe.py --out bench/results/bf16-probe-DATE-COMMIT.json [--cases "64,8192,8192;1,4096,14336"]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_kernels import _rel, _timer, in_specs_of, probe_record, w4a16_sets, write_json  # noqa: E402

_TABLE = ";".join(f"{m},{k},{n}" for k, n in ((8192, 8192), (4096, 14336)) for m in (1, 4, 16, 32, 64))


def _rotating(spec: Any, calls: list[Any]) -> Any:
    """One op call per call of the result, through ``calls`` in turn."""
    it = iter(range(10**9))
    return lambda: spec.cupy(calls[next(it) % len(calls)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--cases", default=_TABLE, help="';'-separated M,K,N (default: the kernel table's)")
    ap.add_argument("--reps", type=int, default=50, help="timed calls per batch of 5")
    args = ap.parse_args(argv)
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._cuda import sm_count
    from shmrpc.kernels._dtypes import to_float
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels.quant import dequantize_int4, w4a16_choice

    res: dict[str, Any] = {**probe_record(cp, "bench/gpu/bf16_probe.py", argv, sm_count()), "mode": "bf16-probe",
                           "rows": []}
    spec = REGISTRY["gemm_w4a16"]
    print(f"{'M':>3} {'K':>6} {'N':>6} {'dtype':<9} {'us':>8} {'rel err':>9}  path")
    for case in (c for c in args.cases.split(";") if c):
        m, k, n = (int(v) for v in case.split(","))
        g = k // 128
        sets, rs = w4a16_sets(cp, k, n)
        f = rs.standard_normal((m, k)) / np.sqrt(k)
        xs = {"float16": f.astype(cp.float16),
              "bfloat16": (f.astype(cp.float32).view(cp.uint32) >> 16).astype(cp.uint16)}
        q, s, z = (a.get() for a in sets[0])
        w = dequantize_int4(np, q, s, z).astype(np.float64)
        for dt, x in xs.items():
            specs = in_specs_of(TensorSpec, m, k, n, g)
            specs["x"] = TensorSpec((m, k), dt)
            calls = [OpCall(cp, {"x": x, "qweight": q_, "scales": s_, "zeros": z_}, specs,
                            {"out": TensorSpec((m, n), dt)}, {}, {}, {}) for q_, s_, z_ in sets]
            t = _timer(cp, _rotating(spec, calls), args.reps)
            got = cp.asnumpy(spec.cupy(calls[0])["out"])
            xf = to_float(np, cp.asnumpy(x), dt).astype(np.float64)  # x as the op sees it (bfloat16: its words)
            err = _rel(to_float(np, got, dt), xf @ w)
            path = w4a16_choice(m, k, n, 128)
            res["rows"].append({"M": m, "K": k, "N": n, "dtype": dt, "seconds": t, "max_rel_err_vs_float64": err,
                                "path": list(path) if path else None})
            print(f"{m:>3} {k:>6} {n:>6} {dt:<9} {t * 1e6:>8.2f} {err:>9.1e}  {path}")
        sets.clear()
        cp.get_default_memory_pool().free_all_blocks()
    write_json(args.out, res)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
