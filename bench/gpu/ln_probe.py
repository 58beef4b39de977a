"""Probe: variants of the fused layernorm(+GELU) row kernel on one shape, next to the copy ceiling.

Each variant is ``ln_rows`` of ``kernels/cuda/layernorm_gelu.cu`` with two knobs: the block
size (the host today picks the smallest chunk count per thread whose block fits 512
threads) and whether gamma and beta are loaded into registers in the first pass, before the
two block reductions (so their latency hides behind them), instead of after. Every
variant's output is compared with the product kernel's. Prints one line per variant and
writes JSON with ``--out``.

    python3 bench/gpu/ln_probe.py [--rows 8192] [--d 8192] [--reps 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

KERNEL = r"""
template <class X, int V, int NCH, int BLOCK, bool PRE>
__global__ void __launch_bounds__(BLOCK) ln_probe(const typename X::T* __restrict__ x,
    const typename X::T* __restrict__ gamma, const typename X::T* __restrict__ beta,
    typename X::T* __restrict__ y, int D, float eps) {
  __shared__ float sh[33];
  const u64 row = blockIdx.x;
  const typename X::T* xr = x + row * (u64)D;
  typename X::T* yr = y + row * (u64)D;
  float v[NCH][V];
  float g[PRE ? NCH : 1][V], b[PRE ? NCH : 1][V];
  float s = 0.f;
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const int e = (c * BLOCK + threadIdx.x) * V;
    if (e < D) {
      load_vec<X, V>(xr + e, v[c]);
      if (PRE) { load_vec<X, V>(gamma + e, g[PRE ? c : 0]); load_vec<X, V>(beta + e, b[PRE ? c : 0]); }
#pragma unroll
      for (int i = 0; i < V; ++i) s += v[c][i];
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) v[c][i] = 0.f;
    }
  }
  const float mean = block_sum(s, sh) / (float)D;
  float q = 0.f;
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const int e = (c * BLOCK + threadIdx.x) * V;
    if (e < D) {
#pragma unroll
      for (int i = 0; i < V; ++i) { const float d = v[c][i] - mean; q += d * d; }
    }
  }
  const float rstd = rsqrtf(block_sum(q, sh) / (float)D + eps);
#pragma unroll
  for (int c = 0; c < NCH; ++c) {
    const int e = (c * BLOCK + threadIdx.x) * V;
    if (e < D) {
      float gg[V], bb[V], o[V];
      if (!PRE) { load_vec<X, V>(gamma + e, gg); load_vec<X, V>(beta + e, bb); }
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float gi = PRE ? g[PRE ? c : 0][i] : gg[i], bi = PRE ? b[PRE ? c : 0][i] : bb[i];
        const float t = (v[c][i] - mean) * rstd * gi + bi;
        o[i] = gelu_tanh(t);
      }
      store_vec<X, V>(yr + e, o);
    }
  }
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--d", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._cuda import CUDA_DIR
    from shmrpc.kernels._registry import OpCall

    rows, d = a.rows, a.d
    v = 8
    slots = d // v
    blocks = [bl for bl in (128, 256, 512, 1024) if slots % bl == 0]
    names = [f"ln_probe<F16,{v},{slots // bl},{bl},{'true' if pre else 'false'}>" for bl in blocks for pre in (False, True)]
    src = (CUDA_DIR / "common.cuh").read_text() + "\n" + (CUDA_DIR / "layernorm_gelu.cu").read_text() + KERNEL
    mod = cp.RawModule(code=src, options=("-std=c++17",), name_expressions=names)
    rs = cp.random.RandomState(1)
    x = (rs.standard_normal((rows, d), dtype=cp.float32) * 2).astype(cp.float16)
    g = rs.uniform(0.5, 1.5, d).astype(cp.float16)
    b = rs.uniform(-0.1, 0.1, d).astype(cp.float16)
    ts = TensorSpec((rows, d), "float16")
    call = OpCall(cp, {"x": x, "gamma": g, "beta": b}, {"x": ts, "gamma": TensorSpec((d,), "float16"),
                  "beta": TensorSpec((d,), "float16")}, {"out": ts}, {"eps": 1e-5}, {})
    ref = REGISTRY["layernorm_gelu"].cupy(call)["out"]

    def timed(fn: object) -> float:
        st, en = cp.cuda.Event(), cp.cuda.Event()
        for _ in range(3):
            fn()  # type: ignore[operator]
        meds = []
        for _ in range(5):
            st.record()
            for _ in range(a.reps):
                fn()  # type: ignore[operator]
            en.record()
            en.synchronize()
            meds.append(cp.cuda.get_elapsed_time(st, en) / 1e3 / a.reps)
        return statistics.median(meds)

    y = cp.empty_like(x)
    moved = 2 * x.nbytes
    t_copy = timed(lambda: cp.copyto(y, x))
    ceiling = moved / t_copy / 1e9
    res: dict[str, object] = {"rows": rows, "D": d, "copy_GBps": ceiling, "variants": []}
    t_prod = timed(lambda: REGISTRY["layernorm_gelu"].cupy(call))
    print(f"copy ceiling {ceiling:.0f} GB/s; product kernel {t_prod * 1e6:.1f} us = {moved / t_prod / 1e9 / ceiling:.1%}")
    res["product_us"] = t_prod * 1e6
    for name in names:
        fn = mod.get_function(name)
        bl = int(name.split(",")[3])
        out = cp.empty_like(x)

        def launch(fn: object = fn, bl: int = bl, out: object = out) -> None:
            fn((rows,), (bl,), (x, g, b, out, np.int32(d), np.float32(1e-5)))  # type: ignore[operator]

        t = timed(launch)
        diff = float(cp.max(cp.abs(out.astype(cp.float32) - ref.astype(cp.float32))))
        line = {"variant": name, "us": t * 1e6, "of_ceiling": moved / t / 1e9 / ceiling, "max_abs_diff_vs_product": diff}
        res["variants"].append(line)  # type: ignore[union-attr]
        print(f"{name:36s} {t * 1e6:7.1f} us  {line['of_ceiling']:.1%}  diff {diff:.3g}")
    # softmax: the product kernel itself, launched with each block size its template allows
    from shmrpc.kernels._cuda import get_function
    from shmrpc.kernels.norm import _sm_names

    sm_call = OpCall(cp, {"x": x}, {"x": ts}, {"out": ts}, {}, {})
    t_sm = timed(lambda: REGISTRY["softmax"].cupy(sm_call))
    sm_ref = REGISTRY["softmax"].cupy(sm_call)["out"]
    print(f"softmax product kernel {t_sm * 1e6:.1f} us = {moved / t_sm / 1e9 / ceiling:.1%}")
    res["softmax_product_us"] = t_sm * 1e6
    res["softmax_variants"] = []
    for bl in blocks:
        nch = slots // bl
        if nch not in (1, 2, 4, 8):
            continue
        fn = get_function("softmax.cu", _sm_names("F16", v), f"softmax_rows<F16,{v},{nch}>")
        out = cp.empty_like(x)

        def sm_launch(fn: object = fn, bl: int = bl, out: object = out) -> None:
            fn((rows,), (bl,), (x, out, np.int32(d)))  # type: ignore[operator]

        t = timed(sm_launch)
        diff = float(cp.max(cp.abs(out.astype(cp.float32) - sm_ref.astype(cp.float32))))
        res["softmax_variants"].append({"block": bl, "nch": nch, "us": t * 1e6,  # type: ignore[union-attr]
                                        "of_ceiling": moved / t / 1e9 / ceiling, "max_abs_diff_vs_product": diff})
        print(f"softmax_rows<F16,{v},{nch}> block {bl:4d} {t * 1e6:7.1f} us  {moved / t / 1e9 / ceiling:.1%}  diff {diff:.3g}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
