"""Probe: how many clusters of gemm_w4a16's cluster kernels the device runs at once, and their time with and without
dependent launches.

For each configuration (w4a16_wkc, w4a16_wgc, w4a16_wgm; ``--cfgs`` for others) at M x K x N it asks the driver (``cuOccupancyMaxActiveClusters``) how
many of its clusters can be resident at once, next to the clusters the launch needs, then times the op forced to it
(``gpu_kernels._timer``, median of batches) as a programmatic dependent launch and as a plain one, and its output's
largest difference from the op's own choice (relative to max |out|). A w4a16_wg / wgc configuration of ``--cfgs`` that
the product does not build (``"MT,NWORD,S,CL"``, e.g. clusters of 7) is compiled into the module for the run. Prints a
table and writes JSON (date, commit from SHMRPC_COMMIT, device, command) to ``--out``.

    python3 bench/gpu/cluster_probe.py --out bench/results/cluster-probe-DATE-COMMIT.json
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_kernels import _timer, in_specs_of, probe_record, w4a16_sets, write_json  # noqa: E402

# (M, K, N), configuration: the table's cluster kernels at the shapes, and the kernel without a split (The run
# of 451995b timed w4a16_wks there, stream-K in clusters of 8, since removed: 15 clusters of 8 fit, docs/kernels.md.)
CASES = [((1, 8192, 8192), (0, 4, 8, 0, 3, 1, 2)), ((1, 4096, 14336), (0, 4, 8, 1, 3, 1)),
         ((16, 8192, 8192), (-2, 4, 8, 0, 3, 1, 2)), ((64, 8192, 8192), (4, 4, 2)), ((64, 4096, 14336), (4, 4, 1))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cfgs", default="", help="M,K,N:configuration;... instead of the built-in cases")
    args = ap.parse_args(argv)
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels import _w4a16_config as wcfg
    from shmrpc.kernels._cuda import _LaunchConfig, get_function, sm_count
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels.quant import _launch_of, use_tuning, w4a16_choice

    n_sm = sm_count()
    res: dict[str, Any] = {**probe_record(cp, "bench/gpu/cluster_probe.py", argv, n_sm), "mode": "cluster-probe", "rows": []}
    spec = REGISTRY.get("gemm_w4a16")
    occ = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    occ.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_void_p]
    occ.restype = ctypes.c_int
    cases = [(tuple(int(v) for v in c.split(":")[0].split(",")), tuple(int(v) for v in c.split(":")[1].split(",")))
             for c in args.cfgs.split(";") if c] or CASES
    extra = tuple(dict.fromkeys(cfg for _, cfg in cases if len(cfg) == 4 and cfg not in wcfg._WG_VARIANTS))
    if extra:  # probe builds: w4a16_wg / wgc configurations the product does not build, compiled into its module
        wcfg._WG_VARIANTS = (*wcfg._WG_VARIANTS, *extra)
        wcfg._wg_names.cache_clear()
    for (m, k, n), cfg in cases:
        gs, g = 128, k // 128
        sets, rs = w4a16_sets(cp, k, n, gs, 60 << 20)
        x = (rs.standard_normal((m, k)) / 64).astype(cp.float16)
        in_specs = in_specs_of(TensorSpec, m, k, n, g)
        calls = [OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, in_specs,
                        {"out": TensorSpec((m, n), "float16")}, {}, {}, {}) for q, s, z in sets]
        row: dict[str, Any] = {"M": m, "K": k, "N": n, "cfg": list(cfg), "probe_build": cfg in extra}
        want = spec.cupy(calls[0])["out"].astype(cp.float32)  # the op's own choice
        with use_tuning(mma_cfg=cfg, mma_m1=True):
            if w4a16_choice(m, k, n, gs) != cfg:
                raise SystemExit(f"{cfg} does not take {m}x{k}x{n}")
            got = spec.cupy(calls[0])["out"].astype(cp.float32)
        row["max_diff"] = float(cp.abs(got - want).max()) / (float(cp.abs(want).max()) or 1.0)
        for pdl in (True, False):
            with use_tuning(mma_cfg=cfg, mma_m1=True, pdl=pdl):
                it = iter(range(10**9))
                spec.cupy(calls[0])  # compiles, and opts the function in to its shared memory
                row["pdl_seconds" if pdl else "plain_seconds"] = _timer(
                    cp, lambda it=it, calls=calls: spec.cupy(calls[next(it) % len(calls)])["out"], args.reps)  # noqa: B023
        launch = _launch_of("F16", m, k, n, gs, cfg, n_sm)
        cl = cfg[6] if len(cfg) >= 7 else cfg[3] if len(cfg) == 4 else cfg[2] if len(cfg) == 3 else 1
        if cl > 1:
            fn = get_function(launch.file, launch.names, launch.name, launch.arch)
            handle = fn.ptr if hasattr(fn, "ptr") else fn.kernel.ptr
            c = _LaunchConfig(launch.grid[0], launch.grid[1], 1, 32 * launch.warps, 1, 1, launch.smem, None, None, 0)
            got = ctypes.c_int(-1)
            rc = occ(ctypes.byref(got), ctypes.c_void_p(handle), ctypes.addressof(c))
            row.update(max_active_clusters=got.value if rc == 0 else f"CUresult {rc}", cluster=cl,
                       clusters_launched=launch.grid[0] * launch.grid[1] // cl)
        res["rows"].append(row)
        print({kk: (round(v * 1e6, 2) if kk.endswith("seconds") else v) for kk, v in row.items()}, flush=True)
        sets.clear()
        cp.get_default_memory_pool().free_all_blocks()
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
