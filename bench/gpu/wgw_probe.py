"""Probe: w4a16_wgw (cuda/w4a16_wg.cu: w4a16_wgc with W warpgroups per block, each on its own 128*NWORD columns, one
set of activation stages for the block) against the op's own choice at M 33..64.

Each case ``M,K,N:MT,NWORD,S,CL,W`` of ``--cases`` is timed as a programmatic dependent launch (``gpu_kernels._timer``:
CUDA events around batches queued behind a spin kernel, median of 5 batches, weight sets rotated so that L2 cannot
hold them), next to the op with its own choice for the shape (first in each case's pair of rows), in ``--rounds``
interleaved rounds. The output is compared with the op's (float16, relative to max |out|) and with a second launch of
itself (bit-equal: the groups are added in one order whichever block comes last). The module is compiled here for
sm_90a from ``w4a16_mma.cu+w4a16_wg.cu`` (``shmrpc.kernels._cuda._ArchModule``). Prints a table and writes JSON (date,
commit from SHMRPC_COMMIT, device, command) to ``--out``.

    python3 bench/gpu/wgw_probe.py --out bench/results/wgw-probe-DATE-COMMIT.json \\
        --cases "64,8192,8192:4,1,4,8,2;64,4096,14336:4,1,4,4,2"
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


def _name(cfg: tuple[int, ...]) -> str:
    return "w4a16_wgw<F16,{}>".format(",".join(map(str, cfg)))


def _op(spec: Any, calls: list[Any]) -> Callable[[], Any]:
    """One call of the op with its own choice, over ``calls`` in turn."""
    it = iter(range(10**9))

    def once() -> Any:
        return spec.cupy(calls[next(it) % len(calls)])["out"]
    return once


def _raw(wk_launch: Any, fn: Any, grid: tuple[int, int], warps: int, smem: int, calls: list[Any],
         tail: tuple[Any, ...]) -> Callable[[], Any]:
    """One dependent launch of ``fn`` over ``calls`` in turn (the call's four arrays, then ``tail``); returns the
    output (``tail``'s first)."""
    it = iter(range(10**9))

    def once() -> Any:
        c = calls[next(it) % len(calls)].inputs
        wk_launch(fn, grid, warps, smem, (c["x"], c["qweight"], c["scales"], c["zeros"], *tail), pdl=True)
        return tail[0]
    return once


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", required=True, help="M,K,N:MT,NWORD,S,CL,W;...")
    ap.add_argument("--defs", default="", help="';'-separated builds (space-separated options; the empty one: as is)")
    args = ap.parse_args(argv)
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._cuda import _ArchModule, sm_count, source
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels.quant import w4a16_choice, wk_launch

    n_sm = sm_count()
    res: dict[str, Any] = {**probe_record(cp, "bench/gpu/wgw_probe.py", argv, n_sm), "mode": "wgw-probe", "rows": []}
    spec = REGISTRY.get("gemm_w4a16")
    cases = [(tuple(int(v) for v in c.split(":")[0].split(",")), tuple(int(v) for v in c.split(":")[1].split(",")))
             for c in args.cases.split(";") if c]
    names = tuple(sorted({_name(c) for _, c in cases}))
    mods = {d: _ArchModule(source("w4a16_mma.cu+w4a16_wg.cu"), names, "sm_90a", tuple(d.split()))
            for d in args.defs.split(";")}
    print(f"{'case':<30} {'kernel':<32} {'us':>7} {'max diff':>9} {'same bits':>9} registers")
    for (m, k, n), cfg in cases:
        mt, nword, st, cl, w = cfg
        gs, ng = 128, k // 128
        sets, rs = w4a16_sets(cp, k, n, gs, 60 << 20)
        x = (rs.standard_normal((m, k)) / np.sqrt(k)).astype(cp.float16)
        calls = [OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, in_specs_of(TensorSpec, m, k, n, ng),
                        {"out": TensorSpec((m, n), "float16")}, {}, {}, {}) for q, s, z in sets]
        tiles, chunks = n // (128 * nword * w), k // 64
        cpb = -(-chunks // cl)
        nb, bc = 16 * mt, 32 * nword
        stage = -(-(nb * 128 + 4 * w * 32 * bc + 4 * w * 4 * bc) // 1024) * 1024
        smem = max(st * stage, nb * (4 * w * bc + 4) * 4) + 1024
        out = cp.empty((m, n), dtype=cp.float16)
        op = _op(spec, calls)

        want = op().astype(cp.float32)  # calls[0]
        scale = float(cp.abs(want).max()) or 1.0
        runs: list[tuple[str, Callable[[], Any], dict[str, Any]]] = [("op " + ",".join(map(str, w4a16_choice(m, k, n, gs) or ())), op, {})]
        for d, mod in mods.items():
            fn = mod.get_function(_name(cfg))
            raw = _raw(wk_launch, fn, (tiles, cl), 4 * w, smem, calls, (out, *(np.int32(v) for v in (m, k, n, gs // 2, cpb))))
            got = raw().astype(cp.float32)  # calls[0]
            for _ in range(len(calls) - 1):  # back to calls[0]
                raw()
            again = raw().astype(cp.float32)
            cp.cuda.get_current_stream().synchronize()
            info = {"cfg": list(cfg), "build": d or "as is", "max_diff": float(cp.abs(got - want).max()) / scale,
                    "same_bits": bool((got == again).all()), "num_regs": cp.cuda.driver.funcGetAttribute(4, fn.ptr)}
            runs.append((_name(cfg)[6:] + (" " + d if d else ""), raw, info))
        for r in range(args.rounds):
            for label, once, info in runs:
                sec = _timer(cp, once, args.reps)
                res["rows"].append({"M": m, "K": k, "N": n, "kernel": label, "round": r + 1, "seconds": sec, **info})
                print(f"{m},{k},{n} r{r + 1:<17} {label:<32} {sec * 1e6:7.2f} " + (
                    f"{info['max_diff']:9.1e} {info['same_bits']!s:>9} {info['num_regs']}" if info else ""), flush=True)
        sets.clear()
        cp.get_default_memory_pool().free_all_blocks()
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
