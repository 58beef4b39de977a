"""Drive gemm_w4a16 for one M so that Nsight Compute can profile the kernel the op launches.

    ncu --kernel-name regex:w4a16 --launch-skip 20 --launch-count 1 [sections] \\
        python3 bench/gpu/w4a16_ncu.py --m 16 [--k 8192 --n 8192]

Runs the op (the product's table: ``quant.w4a16_choice``) 40 times over weight sets rotated past L2, float16
activations, group size 128, then checks the last output against float64 ``x @ dequant(w)`` with the
tests' rule and prints the configuration and the error. The ``w4a16`` stage of ``bench/gpu/run.sh``
(``W4_NCU=1``) runs it under ``ncu`` for M = 1, 16 and 64 at 8192 x 8192.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_kernels import in_specs_of, w4a16_sets  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, required=True)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels.quant import dequantize_int4, w4a16_choice

    m, k, n, gs = args.m, args.k, args.n, 128
    g = k // gs
    sets, rs = w4a16_sets(cp, k, n, gs)
    x = (rs.standard_normal((m, k)) / np.sqrt(k)).astype(cp.float16)
    spec = REGISTRY["gemm_w4a16"]
    in_specs = in_specs_of(TensorSpec, m, k, n, g)
    out_specs = {"out": TensorSpec((m, n), "float16")}
    ws: dict[str, object] = {}
    out = None
    for i in range(args.calls):
        q, s, z = sets[i % len(sets)]
        out = spec.cupy(OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, in_specs, out_specs, {}, {}, ws))["out"]
    cp.cuda.runtime.deviceSynchronize()
    q, s, z = (a.get() for a in sets[(args.calls - 1) % len(sets)])
    ref = x.get().astype(np.float64) @ dequantize_int4(np, q, s, z).astype(np.float64)
    got = out.get().astype(np.float64)
    scale = float(np.max(np.abs(ref)))
    err = float(np.max(np.abs(got - ref)) / scale)
    ok = bool(np.allclose(got / scale, ref / scale, rtol=4e-3, atol=4e-3))
    print(f"M={m} K={k} N={n}: configuration {w4a16_choice(m, k, n, gs)}, max|err|/max|ref| {err:.2e}, "
          f"{'correct' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
