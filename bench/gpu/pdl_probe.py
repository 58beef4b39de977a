"""Probe: gemm_w4a16's tensor-core kernels launched as programmatic dependent launches (PDL) against plain launches.

A plain launch starts when the kernel before it in the stream has finished. By default (``SHMRPC_W4A16_PDL``, here
``quant.use_tuning(pdl=...)``) the op launches w4a16_wk / wkc / wkm / wg / wgc with the stream-serialization attribute
(``_cuda.launch_dependent``): the kernel may start as the one before it leaves the SMs, and waits
(``griddepcontrol.wait``) before it touches anything that kernel may write.

For M in ``--ms`` at the ``--shapes`` (group size 128) it times, with CUDA events around batches queued behind a spin
kernel (``gpu_kernels._timer``: launch cost hidden, median of 5 batches, weight sets rotated so that L2 cannot hold
them), one call after another of the op as the table chooses:

- ``before``: the chosen kernel built with ``-DW4_PDL=0 -DW4_PDL_PF=0`` (no griddepcontrol, no prefetch), launched
  plainly, as the op's launch code would (the kernel before programmatic dependent launches);
- ``plain``: the op with ``pdl=False``: plain launches (the kernel's griddepcontrol instructions then do nothing);
- ``pdl``: the op with ``pdl=True`` (the default);
- ``pdl pf=N`` and ``plain pf=N`` for each N of ``--pf`` (default 8): the chosen kernel built with ``-DW4_PDL_PF=N``
  (each warp prefetches the weights of its first N chunks into L2 before it waits; the op's build: 1), launched as a
  dependent launch and plainly;

(``before`` and the ``pf=N`` variants for w4a16_wk / wkc only; the wgmma kernels of M 33..64 get ``plain`` and ``pdl``)

and fp16 cuBLAS of the same shape. Each timer also records the host's seconds per call (the enqueue, GPU held).
Checks: ``pdl``'s output equals ``plain``'s bit for bit (the kernels are deterministic) and both pass the tests' rule
against float64 x @ dequant(w); and, ``--dep-reps`` times, a kernel that spins ~20 µs and then writes x is followed at
once by the op with ``pdl=True``: the answer must be that of the new x (the writer lets the next kernel launch at its
start, so a kernel that did not wait would read the old one); on square shapes also two calls chained (the second's x
is the first's output), with and without PDL, bit for bit. Prints a table and writes JSON (date, commit from SHMRPC_COMMIT, device, command) to ``--out``.

    python3 bench/gpu/pdl_probe.py --out bench/results/pdl-probe-DATE-COMMIT.json [--ms 1,8,16,32] [--shapes ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_kernels import _timer, in_specs_of, probe_record, w4a16_sets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--ms", default="1,8,16,32,64")
    ap.add_argument("--shapes", default="8192x8192,4096x14336,4096x4096", help="KxN,...")
    ap.add_argument("--dep-reps", type=int, default=20)
    ap.add_argument("--pf", default="8", help="comma-separated W4_PDL_PF values of the 'pdl pf=N' variants")
    args = ap.parse_args(argv)
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._cuda import sm_count, source
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels._w4a16_config import _wk_name, use_tuning, w4a16_wk_launch
    from shmrpc.kernels.quant import _sm90a, dequantize_int4, w4a16_choice, wk_launch

    spec = REGISTRY["gemm_w4a16"]
    rtol, atol = spec.tolerances["float16"]
    n_sm = sm_count()
    res: dict[str, Any] = {
        **probe_record(cp, "bench/gpu/pdl_probe.py", argv, n_sm),
        "rows": [], "dependency": [], "errors": []}
    if not _sm90a():
        res["errors"].append("not an sm_90 device: no programmatic dependent launch")
    mods: dict[str, Any] = {}
    pfs = [int(v) for v in args.pf.split(",") if v]
    variants = [("before", ("-DW4_PDL=0", "-DW4_PDL_PF=0"), False),
                *((f"{how} pf={p}", (f"-DW4_PDL_PF={p}",), how == "pdl") for p in pfs for how in ("pdl", "plain"))]
    res["pf"] = pfs
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    # the kernels the op chooses in this run (w4a16_wk / wkc): the variant modules build only these
    chosen = sorted({c for k, n in shapes for m in {*ms, 1} if (c := w4a16_choice(m, k, n, 128)) and 6 <= len(c) <= 7})
    write_late = cp.RawKernel(source("pdl_check.cu"), "write_late", options=("-std=c++17",))  # x's producer for the dependency check
    l2 = 60 << 20
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for k, n in shapes:
            gs = 128
            g = k // gs
            sets, rs = w4a16_sets(cp, k, n, gs, l2)
            w_ref = dequantize_int4(cp, *sets[0]).astype(cp.float64)
            n16 = max(2, -(-3 * l2 // (k * n * 2)))
            w16 = [rs.standard_normal((k, n), dtype=cp.float32).astype(cp.float16) for _ in range(n16)]
            for m in ms:
                x = (rs.standard_normal((m, k)) / np.sqrt(k)).astype(cp.float16)
                want = x.astype(cp.float64) @ w_ref
                wmax = float(cp.abs(want).max())
                in_specs = in_specs_of(TensorSpec, m, k, n, g)
                calls = [OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, in_specs,
                                {"out": TensorSpec((m, n), "float16")}, {}, {}, {}) for q, s, z in sets]
                cfg = w4a16_choice(m, k, n, gs)
                row: dict[str, Any] = {"K": k, "N": n, "M": m, "cfg": list(cfg) if cfg else None}
                it16 = iter(range(10**9))
                row["cublas_fp16_seconds"] = _timer(cp, lambda x=x, it16=it16: cp.matmul(x, w16[next(it16) % n16]),  # noqa: B023
                                                    args.reps)
                if cfg is None or len(cfg) not in (4, 6, 7, 8):
                    row["note"] = "the op's kernel here is not w4a16_wk, wg or their kin: no dependent launch"
                    res["rows"].append(row)
                    print(row, flush=True)
                    continue
                try:
                    for label, pdl in (("plain", False), ("pdl", True)):
                        it = iter(range(10**9))
                        host: list[float] = []
                        with use_tuning(pdl=pdl):
                            row[f"{label}_seconds"] = _timer(
                                cp, lambda it=it: spec.cupy(calls[next(it) % len(calls)])["out"], args.reps,  # noqa: B023
                                host=host)
                            got = spec.cupy(calls[0])["out"]
                        row[f"{label}_host_seconds"] = host[0] if host else None
                        d = got.astype(cp.float64)
                        row[f"{label}_rel_err"] = float(cp.abs(d - want).max()) / wmax
                        row[f"{label}_ok"] = bool(cp.allclose(d / wmax, want / wmax, rtol=rtol, atol=atol))
                        row[f"{label}_out"] = got
                    row["pdl_equals_plain"] = bool((row.pop("pdl_out") == row.pop("plain_out")).all())
                    if len(cfg) in (6, 7):  # the variants: of w4a16_wk / wkc only
                        (tiles, ksplit), cpb, smem = w4a16_wk_launch(m, k, n, n_sm, cfg)
                        partial = cp.empty((ksplit, m, n) if ksplit > 1 else (1,), dtype=cp.float32)
                        counters = cp.zeros(max(tiles, 1024), dtype=cp.uint32)
                        out = cp.zeros((m, n), dtype=cp.float16)
                        for label, opts, pdl in variants:
                            key = " ".join(opts)
                            if key not in mods:
                                names = [_wk_name("F16", c) for c in chosen]
                                mods[key] = cp.RawModule(code=source("w4a16_mma.cu"), options=("-std=c++17", *opts),
                                                         name_expressions=names)
                            fn = mods[key].get_function(_wk_name("F16", cfg))
                            it = iter(range(10**9))

                            tail = (partial, counters, out, np.int32(m), np.int32(k), np.int32(n), np.int32(gs // 2),
                                    np.int32(cpb))

                            def once(fn: Any = fn, it: Any = it, pdl: bool = pdl, grid: tuple[int, int] = (tiles, ksplit),
                                     warps: int = cfg[2], smem: int = smem, tail: tuple[Any, ...] = tail,
                                     calls: list[Any] = calls) -> None:
                                c = calls[next(it) % len(calls)].inputs
                                wk_launch(fn, grid, warps, smem, (c["x"], c["qweight"], c["scales"], c["zeros"], *tail),
                                          pdl=pdl)

                            row[f"{label}_seconds"] = _timer(cp, once, args.reps)
                except Exception as e:  # recorded, and the run goes on
                    res["errors"].append(f"M={m} {k}x{n}: {type(e).__name__}: {e}")
                    print("error", res["errors"][-1], flush=True)
                    continue
                res["rows"].append(row)
                print({kk: (round(v * 1e6, 2) if kk.endswith("seconds") and v else v) for kk, v in row.items()},
                      flush=True)
            # the dependency check on this shape, M = 1 and the largest M asked: x written late by the kernel before
            for m in sorted({1, max(ms)}):
                cfg = w4a16_choice(m, k, n, gs)
                if cfg is None or len(cfg) not in (4, 6, 7):
                    continue
                x = cp.zeros((m, k), dtype=cp.float16)
                call = OpCall(cp, {"x": x, "qweight": sets[0][0], "scales": sets[0][1], "zeros": sets[0][2]}, in_specs_of(
                    TensorSpec, m, k, n, g), {"out": TensorSpec((m, n), "float16")}, {}, {}, {})
                bad = 0
                want_one = w_ref.sum(axis=0) * float(np.float16(0.25))
                with use_tuning(pdl=True):
                    for i in range(args.dep_reps):
                        v = np.float16(0.25 if i % 2 == 0 else -0.25)
                        write_late((n_sm,), (256,), (x, np.int64(m * k), np.uint16(v.view(np.uint16)), np.int64(40_000)))
                        got = spec.cupy(call)["out"].astype(cp.float64)
                        ref = want_one if v > 0 else -want_one
                        scale = float(cp.abs(ref).max())
                        if not bool(cp.allclose(got / scale, cp.broadcast_to(ref, got.shape) / scale, rtol=rtol, atol=atol)):
                            bad += 1
                if k == n:  # chained: out1 = x @ W, out2 = out1 @ W; with PDL the second waits for the first
                    xr = (rs.standard_normal((m, k)) / np.sqrt(k)).astype(cp.float16)
                    chained = []
                    for pdl in (False, True):
                        with use_tuning(pdl=pdl):
                            c1 = OpCall(cp, {"x": xr, "qweight": sets[0][0], "scales": sets[0][1], "zeros": sets[0][2]},
                                        in_specs_of(TensorSpec, m, k, n, g), {"out": TensorSpec((m, n), "float16")},
                                        {}, {}, {})
                            o1 = spec.cupy(c1)["out"]
                            c2 = OpCall(cp, {"x": o1, "qweight": sets[1 % len(sets)][0], "scales": sets[1 % len(sets)][1],
                                             "zeros": sets[1 % len(sets)][2]}, in_specs_of(TensorSpec, m, k, n, g),
                                        {"out": TensorSpec((m, n), "float16")}, {}, {}, {})
                            chained.append(spec.cupy(c2)["out"].copy())
                    bad += int(not bool((chained[0] == chained[1]).all()))
                res["dependency"].append({"K": k, "N": n, "M": m, "cfg": list(cfg), "reps": args.dep_reps, "wrong": bad})
                print("dependency", res["dependency"][-1], flush=True)
    stream.synchronize()
    _summary(res)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 1 if res["errors"] or any(d["wrong"] for d in res["dependency"]) else 0


def _summary(res: dict[str, Any]) -> None:
    cols = ["cublas_fp16", "before", "plain", "pdl", *(c for p in res.get("pf", []) for c in (f"pdl pf={p}", f"plain pf={p}"))]
    print(f"\n{'M':>3} {'K x N':>11} " + " ".join(f"{c.replace('cublas_fp16', 'cuBLAS').replace('pdl pf=', 'pf').replace('plain pf=', 'pl.pf'):>7}"
                                                 for c in cols) + f" {'host plain/pdl':>15}  same ok")
    for r in res["rows"]:
        if "pdl_seconds" not in r:
            continue
        us = [r.get(f"{c}_seconds") for c in cols]
        h = f"{r['plain_host_seconds'] * 1e6:.1f}/{r['pdl_host_seconds'] * 1e6:.1f}"
        print(f"{r['M']:>3} {str(r['K']) + 'x' + str(r['N']):>11} "
              + " ".join(f"{v * 1e6:7.1f}" if v else f"{'-':>7}" for v in us)
              + f" {h:>15}  {r['pdl_equals_plain']} {r['plain_ok'] and r['pdl_ok']}")
    for d in res["dependency"]:
        print(f"dependency M={d['M']} {d['K']}x{d['N']}: {d['wrong']} wrong of {d['reps']}")
    for e in res["errors"]:
        print("error:", e)


if __name__ == "__main__":
    sys.exit(main())
