"""Probe: the second wave of gemm_w4a16 at M = 64, K = N = 8192, and whether a tail launch beside the first wave
takes it away.

The table's kernel there (w4a16_wgc, MT 4, NWORD 1, clusters of 8) launches 64 clusters, and the device keeps 62 of
them resident (``cluster_probe.py``): the last two tiles run as a second wave. This probe times, at M x K (``--m``,
``--k``), with CUDA events around batches queued behind a spin kernel (``gpu_kernels._timer``, weight sets rotated so
that L2 cannot hold them):

- ``table``: the op at N = ``--n`` as the table chooses (733592a's op also had ``table, tail on``: its own split,
  the tail forked as below, since removed: docs/kernels.md);
- ``main``: the op forced to ``--cfg`` at N = n - ``--tail-cols`` (one wave);
- ``tail CFG``: the op forced to each of ``--tail-cfgs`` at N = ``--tail-cols`` alone;
- ``serial CFG``: main, then that tail, on one stream;
- ``forked CFG``: main on the stream, the tail on a second stream (an event from the first before it, the first
  waiting for an event after it): the tail's clusters may take the slots the first wave leaves free;

each with dependent launches on and off (``quant.use_tuning(pdl=...)``). Prints a table and writes JSON (date,
commit from SHMRPC_COMMIT, device, command) to ``--out``.

    python3 bench/gpu/tail_probe.py --out bench/results/tail-probe-DATE-COMMIT.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_kernels import _timer, in_specs_of, probe_record, w4a16_sets, write_json  # noqa: E402


def _cfg(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--cfg", default="4,1,4,8", help="the first wave's configuration")
    ap.add_argument("--tail-cols", type=int, default=256)
    ap.add_argument("--tail-cfgs", default="4,1,4,8;4,1,4,4;4,1,4,2;4,2,8,1,2,1;4,2,4,1,2,1", help="';'-separated configurations of the tail")
    args = ap.parse_args(argv)
    import cupy as cp

    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._cuda import sm_count
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels.quant import use_tuning

    n_sm = sm_count()
    res: dict[str, Any] = {**probe_record(cp, "bench/gpu/tail_probe.py", argv, n_sm), "mode": "tail-probe", "rows": []}
    spec = REGISTRY.get("gemm_w4a16")
    m, k, gs = args.m, args.k, 128
    g = k // gs
    x = (cp.random.RandomState(1).standard_normal((m, k)) / 64).astype(cp.float16)

    def calls_of(n: int) -> list[Any]:
        sets, _ = w4a16_sets(cp, k, n, gs, 60 << 20)
        return [OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, in_specs_of(TensorSpec, m, k, n, g),
                       {"out": TensorSpec((m, n), "float16")}, {}, {}, {}) for q, s, z in sets]

    n_main = args.n - args.tail_cols
    full, main_calls, tail_calls = calls_of(args.n), calls_of(n_main), calls_of(args.tail_cols)
    main_cfg = _cfg(args.cfg)
    side = cp.cuda.Stream(non_blocking=True)
    it = iter(range(10**9))

    def run(calls: list[Any], cfg: tuple[int, ...] | None, pdl: bool) -> Any:
        with use_tuning(mma_cfg=cfg, pdl=pdl):
            return spec.cupy(calls[next(it) % len(calls)])["out"]

    def serial(tail_cfg: tuple[int, ...], pdl: bool) -> Any:
        run(main_calls, main_cfg, pdl)
        return run(tail_calls, tail_cfg, pdl)

    def forked(tail_cfg: tuple[int, ...], pdl: bool) -> Any:
        main = cp.cuda.get_current_stream()
        side.wait_event(main.record())
        out = run(main_calls, main_cfg, pdl)
        with side:
            run(tail_calls, tail_cfg, pdl)
        main.wait_event(side.record())
        return out

    cases: list[tuple[str, Any]] = [("table", lambda pdl: run(full, None, pdl)),
                                    (f"main {args.cfg} N={n_main}", lambda pdl: run(main_calls, main_cfg, pdl))]
    for text in args.tail_cfgs.split(";"):
        c = _cfg(text)
        cases += [(f"tail {text} N={args.tail_cols}", lambda pdl, c=c: run(tail_calls, c, pdl)),
                  (f"serial {text}", lambda pdl, c=c: serial(c, pdl)), (f"forked {text}", lambda pdl, c=c: forked(c, pdl))]
    print(f"M={m} K={k} N={args.n}: {'case':<32} {'pdl us':>8} {'plain us':>9}")
    for label, fn in cases:
        row: dict[str, Any] = {"case": label, "M": m, "K": k, "N": args.n}
        for pdl in (True, False):
            fn(pdl)
            row["pdl_seconds" if pdl else "plain_seconds"] = _timer(cp, lambda fn=fn, pdl=pdl: fn(pdl), args.reps)
        res["rows"].append(row)
        print(f"{'':>{len(f'M={m} K={k} N={args.n}: ')}}{label:<32} {row['pdl_seconds'] * 1e6:8.1f} "
              f"{row['plain_seconds'] * 1e6:9.1f}", flush=True)
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
