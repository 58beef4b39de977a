"""Probe: gemm_w4a16's w4a16_wk / w4a16_wkc kernels built with compile-time switches of ``cuda/w4a16_mma.cu`` (probe
builds: ``-DW4_ROT=1`` and the like) against the product build, at the same shapes and configurations.

For each case ``M,K,N:configuration`` of ``--cases`` (six numbers: w4a16_wk, seven: w4a16_wkc, four: w4a16_wg /
w4a16_wgc, three: w4a16_wgm, whose every build, the empty one too, is compiled here for sm_90a from
``w4a16_mma.cu+w4a16_wg.cu``, so that a configuration the product does not build can be timed;
``shmrpc.kernels._cuda._ArchModule``; ``0``: the op as it runs by default, its own choice) and each build of
``--defs`` (';'-separated; the empty one is the op itself, forced to the configuration), it times one call after
another as a programmatic dependent launch (``gpu_kernels._timer``: CUDA events around batches queued behind a spin
kernel, median of 5 batches, weight sets rotated so that L2 cannot hold them), and compares the output with the op's
forced to the configuration (relative to max |out|; for a configuration the product does not build, the op's own
choice). ``--dtype bfloat16``: the activations and the output in bfloat16 (the kernels of that type; float16 by
default). Prints a table and writes JSON (date, commit from SHMRPC_COMMIT, device, command) to ``--out``.

    python3 bench/gpu/macro_probe.py --out bench/results/macro-probe-DATE-COMMIT.json \\
        --cases "1,4096,14336:0,4,8,1,3,1" --defs ";-DW4_ROT=1;-DW4_ROT=2"
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_kernels import _timer, in_specs_of, probe_record, w4a16_sets, write_json  # noqa: E402


def _registers(cp: Any, fn: Any) -> dict[str, int]:
    """The kernel's registers per thread and local (spilled) bytes per thread, from the driver."""
    try:
        get = cp.cuda.driver.funcGetAttribute
        return {"num_regs": get(4, fn.ptr), "local_bytes": get(3, fn.ptr)}  # CU_FUNC_ATTRIBUTE_NUM_REGS, LOCAL_SIZE_BYTES
    except (AttributeError, RuntimeError) as e:  # recorded, not fatal: the timing is what the probe is for
        print(f"registers not read: {e!r}")
        return {}


def _op_once(spec: Any, cfg: tuple[int, ...], calls: list[Any], use_tuning: Any) -> Callable[[], Any]:
    """One call of the op forced to ``cfg``, over ``calls`` in turn."""
    it = iter(range(10**9))

    def once() -> Any:
        with use_tuning(mma_cfg=cfg, mma_m1=True):
            return spec.cupy(calls[next(it) % len(calls)])["out"]
    return once


def _op_default(spec: Any, calls: list[Any]) -> Callable[[], Any]:
    """One call of the op as it runs by default (its own choice of kernel), over ``calls`` in turn."""
    it = iter(range(10**9))

    def once() -> Any:
        return spec.cupy(calls[next(it) % len(calls)])["out"]
    return once


def _raw_once(wk_launch: Any, fn: Any, grid: tuple[int, int], warps: int, smem: int, calls: list[Any],
              tail: tuple[Any, ...], out: Any) -> Callable[[], Any]:
    """One dependent launch of the probe build's kernel ``fn`` over ``calls`` in turn (arguments: the call's four
    arrays, then ``tail``); returns ``out``."""
    it = iter(range(10**9))

    def once() -> Any:
        c = calls[next(it) % len(calls)].inputs
        wk_launch(fn, grid, warps, smem, (c["x"], c["qweight"], c["scales"], c["zeros"], *tail), pdl=True)
        return out
    return once


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cases", required=True, help="M,K,N:configuration;...")
    ap.add_argument("--defs", default=";-DW4_ROT=1;-DW4_ROT=2", help="';'-separated builds (space-separated options)")
    ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16", help="the activations' type")
    args = ap.parse_args(argv)
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._cuda import _ArchModule, sm_count, source
    from shmrpc.kernels._dtypes import to_float
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels._w4a16_config import _is_wg, _wg_name, _wg_warps, _wk_name, w4a16_wg_launch, w4a16_wk_launch
    from shmrpc.kernels.quant import use_tuning, wk_launch

    n_sm = sm_count()
    res: dict[str, Any] = {**probe_record(cp, "bench/gpu/macro_probe.py", argv, n_sm), "mode": "macro-probe", "rows": []}
    spec = REGISTRY.get("gemm_w4a16")
    cases = [(tuple(int(v) for v in c.split(":")[0].split(",")), tuple(int(v) for v in c.split(":")[1].split(",")))
             for c in args.cases.split(";") if c]
    builds = args.defs.split(";")
    mods: dict[Any, Any] = {}
    dt = args.dtype
    kt = "BF16" if dt == "bfloat16" else "F16"
    names = sorted({_wk_name(kt, cfg) for _, cfg in cases if len(cfg) >= 5})
    wg_names = tuple(sorted({_wg_name(kt, cfg) for _, cfg in cases if _is_wg(cfg)}))
    print(f"{'case':<34} {'build':<16} {'us':>7} {'max diff':>9}")
    for (m, k, n), cfg in cases:
        gs, g = 128, k // 128
        sets, rs = w4a16_sets(cp, k, n, gs, 60 << 20)
        f = rs.standard_normal((m, k)) / np.sqrt(k)
        x = (f.astype(cp.float32).view(cp.uint32) >> 16).astype(cp.uint16) if dt == "bfloat16" else f.astype(cp.float16)
        specs = {**in_specs_of(TensorSpec, m, k, n, g), "x": TensorSpec((m, k), dt)}
        calls = [OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, specs,
                        {"out": TensorSpec((m, n), dt)}, {}, {}, {}) for q, s, z in sets]
        if cfg == (0,):  # the op's own choice, as it runs by default
            tiles, ksplit, cpb, smem = 1, 1, 0, 0
        elif _is_wg(cfg):
            (tiles, ksplit), cpb, smem = w4a16_wg_launch(m, k, n, cfg)
        else:
            (tiles, ksplit), cpb, smem = w4a16_wk_launch(m, k, n, n_sm, cfg)
        partial = cp.empty((max(1, ksplit * m * n) if len(cfg) == 6 else 1,), dtype=cp.float32)
        counters = cp.zeros((max(tiles, 1024),), dtype=cp.uint32)
        out = cp.empty((m, n), dtype=cp.uint16 if dt == "bfloat16" else cp.float16)
        with use_tuning(mma_cfg=None if cfg == (0,) else cfg, mma_m1=cfg != (0,)):
            want = to_float(cp, spec.cupy(calls[0])["out"], dt).astype(cp.float32)
        scale = float(cp.abs(want).max()) or 1.0
        for opts in builds:
            row: dict[str, Any] = {"M": m, "K": k, "N": n, "dtype": dt, "cfg": list(cfg), "build": opts or "product"}
            once: Callable[[], Any]
            if cfg == (0,):
                once = _op_default(spec, calls)
            elif _is_wg(cfg):
                if ("wg", opts) not in mods:
                    mods[("wg", opts)] = _ArchModule(source("w4a16_mma.cu+w4a16_wg.cu"), wg_names, "sm_90a",
                                                     tuple(opts.split()))
                fn = mods[("wg", opts)].get_function(_wg_name(kt, cfg))
                row.update(_registers(cp, fn))
                once = _raw_once(wk_launch, fn, (tiles, ksplit), _wg_warps(cfg), smem, calls,
                                 (out, *(np.int32(v) for v in (m, k, n, gs // 2, cpb))), out)
            elif not opts:
                once = _op_once(spec, cfg, calls, use_tuning)
            else:
                if opts not in mods:
                    mods[opts] = cp.RawModule(code=source("w4a16_mma.cu"), options=("-std=c++17", *opts.split()),
                                              name_expressions=names)
                once = _raw_once(wk_launch, mods[opts].get_function(_wk_name(kt, cfg)), (tiles, ksplit), cfg[2], smem,
                                 calls, (partial, counters, out, *(np.int32(v) for v in (m, k, n, gs // 2, cpb))), out)
            got = once()  # calls[0], as want
            row["max_diff"] = float(cp.abs(to_float(cp, got, dt).astype(cp.float32) - want).max()) / scale
            row["seconds"] = _timer(cp, once, args.reps)
            res["rows"].append(row)
            print(f"{m},{k},{n}:{','.join(map(str, cfg)):<22} {row['build']:<16} {row['seconds'] * 1e6:7.2f} "
                  f"{row['max_diff']:9.1e}" + (f" {row['num_regs']} registers" if row.get("num_regs") else ""), flush=True)
        sets.clear()
        cp.get_default_memory_pool().free_all_blocks()
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
