"""Probe: what bounds gemm_w4a16 on the GPU, measured by variants of its kernels in one run.

For M in 1, 8, 16, 32, 64 at K x N = 8192 x 8192, 4096 x 14336 and 4096 x 4096 (group size 128) it times, with CUDA
events around batches queued behind a spin kernel (``gpu_kernels._timer``: launch cost hidden,
median of 5 batches, weight sets rotated so that L2 cannot hold them):

- fp16 cuBLAS (``cupy.matmul``) of the same shape, and a plain 16-byte read of the same bytes
  (packed weights + scales + zeros): the two references;
- the op as it is (``product``), the float32 CUDA-core kernel (M = 1), the opt-in float16x2
  kernel (M = 1);
- ``w4a16_wg`` / ``w4a16_wgc`` (``kernels/cuda/w4a16_wg.cu``: wgmma, sm_90a) in configurations (MT, NWORD, S, CL);
- ``w4a16_wk`` (``kernels/cuda/w4a16_mma.cu``) in configurations (MT, NWORD, WK, BPS, S, XSM),
  ``w4a16_wkc`` (clusters of CL blocks split K: (MT, NWORD, WK, 0, S, XSM, CL)), ``w4a16_wkm`` (x packed by chunk,
  clusters of CN column slabs share each activation chunk, bulk copies multicast: (MT, NWORD, WK, 0, S, 1, 1, CN)),
  and
  ``w4a16_mma_async`` (MT, NWORD, WARPS, BPS, S), through the op (``quant.use_tuning(mma_cfg=...)``),
  so the product's launch code runs; a configuration the op would not take for the shape is listed
  as skipped;
- the same kernels built from the same source with other compile-time switches and launched as the op
  would (programmatic dependent launches where the op makes them): ``-DW4_EPI=0`` (the earlier epilogue: the WK warps' tiles added one warp after another, WK
  barriers; checked like the product, marked ``epi0``), ``-DW4_LDSM=0`` (the A fragments read as 32-bit
  words before the math instead of by ldmatrix per k16 step: the kernel before; checked, marked ``ldsm=0``),
  ``-DW4_FIX=0`` (MT = 0 with the zero and the scale applied per weight pair, before the mma, instead of to
  each chunk's float32 sums: the kernel before; checked, marked ``fix=0``), ``-DW4_LOP=0`` (the dequantization's
  mask-and-magic as two LOP3, as the C++ expression compiles: the kernel before; checked, marked ``lop=0``),
  ``-DW4_SUB=0`` / ``2`` (float16 at M <= 16: the weights entering the mma as MAGIC + q, the kernel before, or as
  subnormals with the high nibbles shifted by IMAD.HI instead of SHF; checked, marked ``sub=0`` / ``sub=2``)
  configurations the op's module does not build (``EXTRA``: more stages or warps than the table's; checked, marked
  ``extra``) and diagnostics ``-DW4_PROBE=bits``: ``64``
  (nothing: the launch of an empty kernel of the same geometry and shared memory), ``16`` (no chunk
  loop: launch, zeroing and epilogue; also with ``W4_EPI=0``), ``32`` (no epilogue: the chunk loop only),
  ``1`` (loads only), ``6`` (mma only); their results are wrong by construction and marked ``diag``; at M > 32 (8192 x
  8192) also w4a16_wkm's packing kernel alone (``w4_xpack``, diag).

Every non-diagnostic case is checked against float64 x @ dequant(w) computed on the device:
max|out - ref| / max|ref|, and the tests' rule (allclose of out / max|ref| with the op's
float16 tolerance). Prints a table and writes JSON (date, commit from SHMRPC_COMMIT, device,
command) to ``--out``. Finishes in about 20 s on an H200 once the kernels are compiled, a minute or
two before (``--budget-s`` stops adding cases past that many seconds; skipped cases are listed; a
case that raises is recorded under "errors" and the run goes on).

    python3 bench/gpu/w4a16_probe.py --out bench/results/w4a16-probe-DATE-COMMIT.json [--skip epi0,diag,ldsm0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_kernels import _timer, in_specs_of, probe_record, w4a16_sets  # noqa: E402

_READ = r"""extern "C" __global__ void read16(const uint4* __restrict__ p, long long n, unsigned int* sink) {
  unsigned int acc = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    uint4 v; asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p + i));
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}"""

# Per M: the configurations timed through the op: w4a16_wk (MT, NWORD, WK, BPS, S, XSM), w4a16_wkc (MT, NWORD, WK, 0,
# S, XSM, CL), w4a16_mma_async (MT, NWORD, WARPS, BPS, S) and w4a16_wg / w4a16_wgc (MT, NWORD, S, CL; sm_90 only); one the op would not take for the shape (e.g. clusters
# that do not fit in one wave) is listed under "skipped", never timed on another path under its name.
CFGS: dict[int, list[tuple[int, ...]]] = {1: [(0, 4, 8, 1, 3, 1), (0, 4, 8, 0, 3, 1, 2), (0, 4, 4, 8), (0, 2, 4, 8),
            (0, 4, 12, 1, 3, 1), (0, 4, 12, 0, 3, 1, 2), (0, 2, 8, 1, 4, 1), (0, 4, 8, 1, 4, 0)],
        8: [(0, 4, 8, 1, 3, 1), (0, 4, 8, 0, 3, 1, 2), (0, 4, 4, 8), (0, 2, 4, 8),
            (0, 4, 12, 1, 3, 1), (0, 4, 12, 0, 3, 1, 2)],
        16: [(1, 4, 8, 1, 3, 1), (1, 4, 8, 0, 3, 1, 2), (-2, 4, 8, 1, 3, 1), (-2, 4, 8, 0, 3, 1, 2), (1, 2, 8, 1, 4, 1), (1, 2, 8, 1, 3, 0), (1, 2, 4, 4), (1, 2, 4, 8), (1, 4, 4, 4),
             (1, 4, 4, 8)],
        32: [(2, 2, 8, 1, 3, 1), (2, 2, 8, 0, 3, 1, 2), (2, 4, 8, 1, 2, 1), (2, 4, 8, 0, 2, 1, 2), (2, 4, 8, 1, 3, 1),
             (2, 4, 8, 0, 3, 1, 2), (2, 2, 4, 4), (2, 2, 4, 8), (2, 4, 4, 4), (2, 2, 6, 4)],
        64: [(4, 2, 4, 1, 2, 1), (4, 2, 4, 0, 2, 1, 2), (4, 2, 8, 1, 2, 1), (4, 2, 8, 0, 2, 1, 2), (4, 2, 4, 4),
             (4, 1, 4, 2), (4, 1, 4, 4), (4, 1, 4, 8), (4, 1, 6, 4)]}
# the table of 2c364f7 (its choice at 8192 x 8192; per M one label): M = 1, 8 the TR cluster kernel, M = 16 the MT = 1
# cluster kernel, M 17..64 w4a16_wk without a K split; the kernels themselves now read A by ldmatrix
OLD = {1: (0, 4, 8, 0, 3, 1, 2), 8: (0, 4, 8, 0, 3, 1, 2), 16: (1, 4, 8, 0, 3, 1, 2), 32: (2, 2, 8, 1, 3, 1),
       64: (4, 2, 4, 1, 2, 1)}
# the A fragments read as 32-bit words before the math (-DW4_LDSM=0, the kernel before ldmatrix), per M
LDSM0: dict[int, list[tuple[int, ...]]] = {16: [(1, 4, 8, 0, 3, 1, 2)], 32: [(2, 2, 8, 1, 3, 1)], 64: [(4, 2, 8, 1, 2, 1)]}
# MT = 0 as before W4_FIX (-DW4_FIX=0: the zero and the scale applied per weight pair by HADD2 / HMUL2), per M
FIX0: dict[int, list[tuple[int, ...]]] = {1: [(0, 4, 8, 0, 3, 1, 2), (0, 4, 8, 1, 3, 1)], 8: [(0, 4, 8, 0, 3, 1, 2), (0, 4, 8, 1, 3, 1)]}
# (t & mask) | MAGIC as written in C++ (-DW4_LOP=0: two LOP3 per dequantized pair instead of one), per M
LOP0: dict[int, list[tuple[int, ...]]] = {1: [(0, 4, 8, 0, 3, 1, 2)], 8: [(0, 4, 8, 0, 3, 1, 2)], 16: [(1, 4, 8, 0, 3, 1, 2)], 32: [(2, 4, 8, 0, 3, 1, 2)],
        64: [(4, 2, 8, 1, 2, 1)]}
# the weights as MAGIC + q (-DW4_SUB=0, the kernel before) or as subnormals shifted by IMAD.HI (-DW4_SUB=2), per M
_SUB_CFGS: dict[int, list[tuple[int, ...]]] = {1: [(0, 4, 8, 0, 3, 1, 2), (0, 4, 8, 1, 3, 1)], 8: [(0, 4, 8, 0, 3, 1, 2)],
                                              16: [(-2, 4, 8, 0, 3, 1, 2), (-2, 4, 8, 1, 3, 1)]}
SUBV = {m: [(cfg, sub) for cfg in cfgs for sub in (0, 2)] for m, cfgs in _SUB_CFGS.items()}
# configurations the op's module does not build, compiled from the product's source in a module of their own, per M
EXTRA: dict[int, list[tuple[int, ...]]] = {m: [(0, 4, 8, 0, 4, 1, 2), (0, 4, 16, 0, 2, 1, 2), (0, 4, 8, 2, 3, 1)] for m in (1, 8)}
EXTRA[16] = [(-2, 4, 8, 0, 2, 1, 2)]
# the earlier epilogue (-DW4_EPI=0) next to the same configuration with the new one, per M
EPI0: dict[int, list[tuple[int, ...]]] = {1: [(0, 4, 8, 1, 3, 1)], 8: [(0, 4, 8, 1, 3, 1)], 16: [(1, 4, 8, 1, 3, 1)], 32: [(2, 2, 8, 1, 3, 1)],
        64: [(4, 2, 4, 1, 2, 1)]}
DIAG_CFGS: dict[int, list[tuple[int, ...]]] = {1: [(0, 4, 8, 0, 3, 1, 2)], 16: [(1, 4, 8, 0, 3, 1, 2)], 32: [(2, 4, 8, 0, 3, 1, 2)], 64: [(4, 2, 8, 1, 2, 1)]}
DIAG_BITS = {64: "nothing: the launch", 16: "no chunk loop: launch, zeroing and epilogue",
             32: "no epilogue: the chunk loop only", 1: "loads only", 6: "mma only: no weight loads, no dequant"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--ms", default="1,8,16,32,64")
    ap.add_argument("--shapes", default="8192x8192,4096x14336,4096x4096", help="KxN,...")
    ap.add_argument("--budget-s", type=float, default=125.0)
    ap.add_argument("--skip", default="", help="comma-separated groups of cases left out: epi0, diag, ldsm0, fix0, lop0, sub, extra")
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._cuda import sm_count, source
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels._w4a16_config import _mma_cfg, _takes, _wk_name, tuning, use_tuning, w4a16_wk_launch
    from shmrpc.kernels.quant import _sm90a, dequantize_int4, pack_x, w4a16_choice, wk_launch

    spec = REGISTRY["gemm_w4a16"]
    rtol, atol = spec.tolerances["float16"]
    n_sm = sm_count()
    res: dict[str, Any] = {
        **probe_record(cp, "bench/gpu/w4a16_probe.py", argv, n_sm),
        "check": f"max|out - ref| / max|ref| against float64 x @ dequant(w); ok = allclose(out/max|ref|, ref/max|ref|, "
                 f"rtol={rtol}, atol={atol})",
        "rows": [], "skipped": [], "errors": []}
    read = cp.RawKernel(_READ, "read16")
    sink = cp.zeros(1, dtype=cp.uint32)
    skip = set(filter(None, args.skip.split(",")))
    var_mods: dict[tuple[int, ...], Any] = {}
    epi0_cfgs = sorted({c for cs in EPI0.values() for c in cs})
    diag_cfgs = sorted({c for cs in DIAG_CFGS.values() for c in cs})
    ldsm0_cfgs = sorted({c for cs in LDSM0.values() for c in cs})
    fix0_cfgs = sorted({c for cs in FIX0.values() for c in cs})
    lop0_cfgs = sorted({c for cs in LOP0.values() for c in cs})
    sub_cfgs = sorted({c for cs in SUBV.values() for c, _ in cs})
    extra_cfgs = sorted({c for cs in EXTRA.values() for c in cs})

    def variant_fn(bits: int, epi: int, cfg: tuple[int, ...], ldsm: int = 1, fix: int = 1, lop: int = 1,
                   sub: int = 1) -> Any:
        """The kernel of ``cfg`` built with -DW4_PROBE=bits -DW4_EPI=epi -DW4_LDSM=ldsm -DW4_FIX=fix -DW4_LOP=lop
        -DW4_SUB=sub (one module per set of switches; all at the product's values: the EXTRA configurations)."""
        key = (bits, epi, ldsm, fix, lop, sub)
        if key not in var_mods:
            cfgs = (diag_cfgs if bits else epi0_cfgs if epi == 0 else ldsm0_cfgs if ldsm == 0 else fix0_cfgs if fix == 0
                    else lop0_cfgs if lop == 0 else sub_cfgs if sub != 1 else extra_cfgs)
            var_mods[key] = cp.RawModule(
                code=source("w4a16_mma.cu"),
                options=("-std=c++17", *(f"-DW4_{name}={v}" for name, v in zip(("PROBE", "EPI", "LDSM", "FIX", "LOP", "SUB"),
                                                                                  key))),
                name_expressions=[_wk_name("F16", c) for c in cfgs])
        return var_mods[key].get_function(_wk_name("F16", cfg))

    l2 = 60 << 20
    pdl = tuning().pdl and _sm90a()  # the variants are launched as the op launches its kernels
    for k, n in (tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")):
        gs = 128
        g = k // gs
        packed = k * n // 2 + 4 * g * n
        sets, rs = w4a16_sets(cp, k, n, gs, l2)
        n_sets = len(sets)
        w_ref = dequantize_int4(cp, *sets[0]).astype(cp.float64)
        n16 = max(2, -(-3 * l2 // (k * n * 2)))
        w16 = [rs.standard_normal((k, n), dtype=cp.float32).astype(cp.float16) for _ in range(n16)]
        raw = [cp.empty(packed // 16 * 16, dtype=cp.uint8) for _ in range(n_sets)]
        itr = iter(range(10**9))
        n_vec = packed // 16
        t_read = _timer(cp, lambda: read((4 * n_sm,), (512,), (raw[next(itr) % n_sets], np.int64(n_vec), sink)), args.reps)  # noqa: B023
        for m in (int(v) for v in args.ms.split(",")):
            x = (rs.standard_normal((m, k)) / np.sqrt(k)).astype(cp.float16)
            want = x.astype(cp.float64) @ w_ref
            wmax = float(cp.abs(want).max())
            in_specs = in_specs_of(TensorSpec, m, k, n, g)
            calls = [OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, in_specs,
                            {"out": TensorSpec((m, n), "float16")}, {}, {}, {}) for q, s, z in sets]
            it16 = iter(range(10**9))
            t16 = _timer(cp, lambda x=x, it16=it16: cp.matmul(x, w16[next(it16) % n16]), args.reps)  # noqa: B023
            base = {"K": k, "N": n, "M": m, "cublas_fp16_seconds": t16, "read_seconds": t_read, "bytes_read": packed}

            def check(got: Any, want: Any = want, wmax: float = wmax) -> tuple[float, bool]:
                d = got.astype(cp.float64)
                err = float(cp.abs(d - want).max()) / wmax
                ok = bool(cp.allclose(d / wmax, want / wmax, rtol=rtol, atol=atol))
                return err, ok

            def op_case(label: str, tuning: dict[str, Any], calls: list[Any] = calls, base: dict[str, Any] = base,
                        m: int = m, k: int = k, n: int = n, gs: int = gs) -> None:
                if time.monotonic() - t_start > args.budget_s:
                    res["skipped"].append({**base, "case": label})
                    return
                it = iter(range(10**9))
                if "mma_cfg" in tuning:
                    with use_tuning(**tuning):
                        taken = _mma_cfg(m, k, n, gs, n_sm=n_sm, wg=_sm90a())
                    if taken != tuning["mma_cfg"]:
                        res["skipped"].append({**base, "case": label, "why": "the op does not take it for this shape"})
                        return
                try:
                    with use_tuning(**tuning):
                        t = _timer(cp, lambda: spec.cupy(calls[next(it) % len(calls)])["out"], args.reps)  # noqa: B023
                        err, ok = check(spec.cupy(calls[0])["out"])
                except Exception as e:  # recorded, and the run goes on
                    _error(res, base, label, e)
                    return
                row = {**base, "case": label, "seconds": t, "rel_err": err, "ok": ok, "diag": False}
                res["rows"].append(row)
                _print(row)

            def variant_case(cfg: tuple[int, ...], bits: int, epi: int, ldsm: int = 1, m: int = m, k: int = k, n: int = n,
                             gs: int = gs, calls: list[Any] = calls, base: dict[str, Any] = base, fix: int = 1,
                             lop: int = 1, sub: int = 1) -> None:
                diag = bits != 0
                label = (f"wk {cfg}" + (f" epi={epi}" if epi != 1 else "") + (" ldsm=0" if ldsm != 1 else "")
                         + (" fix=0" if fix != 1 else "") + (" lop=0" if lop != 1 else "")
                         + (f" sub={sub}" if sub != 1 else "")
                         + (" extra" if (bits, epi, ldsm, fix, lop, sub) == (0, 1, 1, 1, 1, 1) else "")
                         + (f" probe={bits} ({DIAG_BITS[bits]})" if diag else ""))
                if time.monotonic() - t_start > args.budget_s:
                    res["skipped"].append({**base, "case": label})
                    return
                try:
                    fn = variant_fn(bits, epi, cfg, ldsm, fix, lop, sub)
                except Exception as e:
                    _error(res, base, label, e)
                    return
                (tiles, ksplit), cpb, smem = w4a16_wk_launch(m, k, n, n_sm, cfg)
                partial = cp.empty((ksplit, m, n) if ksplit > 1 else (1,), dtype=cp.float32)
                counters = cp.zeros(max(tiles, 1024), dtype=cp.uint32)
                out = cp.zeros((m, n), dtype=cp.float16)
                it = iter(range(10**9))

                def once(c: dict[str, Any] | None = None) -> None:
                    c = c or calls[next(it) % len(calls)].inputs
                    wk_launch(fn, (tiles, ksplit), cfg[2], smem,
                              (c["x"], c["qweight"], c["scales"], c["zeros"], partial, counters, out, np.int32(m),
                               np.int32(k), np.int32(n), np.int32(gs // 2), np.int32(cpb)), pdl=pdl)

                err: float | None = None
                ok: bool | None = None
                try:
                    t = _timer(cp, once, args.reps)
                    if not diag:
                        once(calls[0].inputs)
                        err, ok = check(out)
                except Exception as e:
                    _error(res, base, label, e)
                    return
                row = {**base, "case": label, "seconds": t, "rel_err": err, "ok": ok, "diag": diag}
                res["rows"].append(row)
                _print(row)

            op_case(f"product (the op as it is: {w4a16_choice(m, k, n, gs)})", {})
            if m == 1:
                op_case("float32 CUDA-core kernel (the path before)", {"mma": False, "h2": False})
                op_case("float16x2 kernel (opt-in h2)", {"mma": False, "h2": True})
            row = min(r for r in CFGS if r >= m) if m <= max(CFGS) else max(CFGS)  # other M: the list of the next M listed
            for cfg in CFGS[row]:
                kind = {4: "wg", 5: "mma_async", 8: "wkm"}.get(len(cfg), "wk")
                op_case(f"{kind} {cfg}" + (" (the table before)" if cfg == OLD.get(m) else ""), {"mma_cfg": cfg, "h2": False})
            for cfg in LDSM0.get(m, []) if "ldsm0" not in skip else []:
                if _takes(cfg, n, n_sm, forced=True):
                    variant_case(cfg, 0, 1, 0)
            for cfg in FIX0.get(m, []) if "fix0" not in skip else []:
                if _takes(cfg, n, n_sm, forced=True):
                    variant_case(cfg, 0, 1, 1, fix=0)
            for cfg in LOP0.get(m, []) if "lop0" not in skip else []:
                if _takes(cfg, n, n_sm, forced=True):
                    variant_case(cfg, 0, 1, 1, lop=0)
            for cfg, sub in SUBV.get(m, []) if "sub" not in skip else []:
                if _takes(cfg, n, n_sm, forced=True):
                    variant_case(cfg, 0, 1, 1, sub=sub)
            for cfg in EXTRA.get(m, []) if "extra" not in skip else []:
                if _takes(cfg, n, n_sm, forced=True):
                    variant_case(cfg, 0, 1, 1)
            if m > 32 and k == 8192 and n == 8192 and "diag" not in skip:  # w4a16_wkm's packing of x, alone
                try:
                    t = _timer(cp, lambda x=x, m=m, k=k: pack_x(x, m, k, 64, "F16"), args.reps)
                    diag_row = {**base, "case": "w4_xpack alone (w4a16_wkm's packing of x; a diag row)", "seconds": t,
                                "rel_err": None, "ok": None, "diag": True}
                    res["rows"].append(diag_row)
                    _print(diag_row)
                except Exception as e:
                    _error(res, base, "w4_xpack alone", e)
            for cfg in EPI0.get(m, []) if "epi0" not in skip else []:
                variant_case(cfg, 0, 0)
            if m in DIAG_CFGS and k == 8192 and n == 8192 and "diag" not in skip:
                for cfg in DIAG_CFGS[m]:
                    for bits in DIAG_BITS:
                        variant_case(cfg, bits, 1)
                        if bits == 16 and len(cfg) == 6:
                            variant_case(cfg, bits, 0)
            del calls
        sets.clear()
        w16.clear()
        raw.clear()
        del w_ref
        cp.get_default_memory_pool().free_all_blocks()
    res["wall_seconds"] = time.monotonic() - t_start
    _summary(res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out} ({res['wall_seconds']:.0f} s)")
    return 0


def _error(res: dict[str, Any], base: dict[str, Any], label: str, e: Exception) -> None:
    res["errors"].append({**base, "case": label, "error": f"{type(e).__name__}: {e}"[:2000]})
    print(f"M={base['M']:<3} {base['K']}x{base['N']:<6} ERROR {type(e).__name__}: {str(e)[:300]}  {label}", flush=True)


def _print(row: dict[str, Any]) -> None:
    t = row["seconds"]
    gbs = row["bytes_read"] / t / 1e9
    chk = "diag" if row["diag"] else f"{row['rel_err']:.1e} {'ok' if row['ok'] else 'FAIL'}"
    print(f"M={row['M']:<3} {row['K']}x{row['N']:<6} {t * 1e6:7.1f} us  {gbs:6.0f} GB/s  read x{t / row['read_seconds']:4.2f}  "
          f"cuBLAS/this {row['cublas_fp16_seconds'] / t:5.2f}x  {chk:14s} {row['case']}", flush=True)


def _summary(res: dict[str, Any]) -> None:
    best: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r in res["rows"]:
        key = (r["K"], r["N"], r["M"])
        if not r["diag"] and r["ok"] and (key not in best or r["seconds"] < best[key]["seconds"]):
            best[key] = r
    res["best"] = list(best.values())
    print("\nbest correct case per shape:")
    print("| M | K x N | best (µs) | case | plain read (µs) | fp16 cuBLAS (µs) | cuBLAS / best | product (µs) |")
    print("|---|---|---|---|---|---|---|---|")
    for (k, n, m), r in sorted(best.items()):
        prod = next((p["seconds"] for p in res["rows"] if (p["K"], p["N"], p["M"]) == (k, n, m)
                     and p["case"].startswith("product")), float("nan"))
        print(f"| {m} | {k}x{n} | {r['seconds'] * 1e6:.1f} | {r['case']} | {r['read_seconds'] * 1e6:.1f} | "
              f"{r['cublas_fp16_seconds'] * 1e6:.1f} | {r['cublas_fp16_seconds'] / r['seconds']:.2f}x | {prod * 1e6:.1f} |")


if __name__ == "__main__":
    raise SystemExit(main())
