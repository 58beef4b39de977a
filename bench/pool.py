"""Throughput through a client Pool: 1 worker vs 2 workers (``shmrpc serve --devices``), N client processes.

For each worker count K it starts a supervisor with ``--devices 0..K-1`` (on a GPU host each worker
owns one GPU; with ``--backend numpy`` the ordinals only name the workers), uploads the weight ``w``
to every worker once through the pool (a resident tensor), then runs N client processes, each with
its own ``Pool`` keeping ``--window`` ``gemm`` calls in flight for ``--seconds``, and records calls/s.

    python bench/pool.py --backend numpy --m 64 --k 512 --n 512 --out bench/results/pool-cpu.json
    python bench/pool.py --backend cupy --m 2048 --k 8192 --n 8192 --out $OUT/pool-gpu.json   # bench/gpu/run.sh pool

Prints a table; writes JSON (date, commit, machine, command, every point).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _client(prefix: str, m: int, k: int, dtype: str, window: int, seconds: float, start: Any, q: Any) -> None:
    from shmrpc.client import Pool, Resident

    x = np.ones((m, k), dtype)
    with Pool(prefix, timeout_s=120.0) as pool:
        for _ in range(2):
            pool.call("gemm", x=x, w=Resident("shared/w"))
        start.wait()
        t0 = time.perf_counter()
        end = t0 + seconds
        n = 0
        futs = [pool.submit("gemm", x=x, w=Resident("shared/w")) for _ in range(window)]
        while futs:
            f = futs.pop(0)
            f.result()
            n += 1
            if time.perf_counter() < end:
                futs.append(pool.submit("gemm", x=x, w=Resident("shared/w")))
        q.put((n, time.perf_counter() - t0, pool.stats()))


def _worker_env(backend: str, n_workers: int) -> dict[str, str]:
    """NumPy workers share this host's cores: BLAS threads per worker = cores / workers (no oversubscription)."""
    env = dict(os.environ)
    if backend == "numpy":
        per = str(max(1, (os.cpu_count() or 1) // n_workers))
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, per)
    return env


def _run(n_workers: int, args: argparse.Namespace) -> dict[str, Any]:
    from shmrpc.client import Pool

    prefix = f"poolbench-{os.getpid()}-{secrets.token_hex(3)}"
    devices = ",".join(str(i) for i in range(n_workers))
    sup = subprocess.Popen([sys.executable, "-m", "shmrpc.server", "serve", "--name", prefix, "--devices", devices,
                            "--backend", args.backend, "--slots", args.slots, "--log-level", "WARNING",
                            *args.worker_args.split()],
                           stdout=subprocess.PIPE, text=True, env=_worker_env(args.backend, n_workers))
    try:
        assert sup.stdout is not None
        for line in sup.stdout:
            if line.startswith(f"shmrpc supervisor {prefix} ready"):
                break
        else:
            raise SystemExit(f"the supervisor did not start (exit {sup.wait()})")
        w = np.random.default_rng(0).standard_normal((args.k, args.n)).astype(args.dtype)
        keeper = Pool(prefix, timeout_s=120.0)  # holds the resident weight for the run (residents are per client)
        keeper.put("w", w, shared=True)
        ctx = mp.get_context("spawn")
        start, q = ctx.Barrier(args.clients), ctx.Queue()
        procs = [ctx.Process(target=_client, args=(prefix, args.m, args.k, args.dtype, args.window, args.seconds,
                                                   start, q)) for _ in range(args.clients)]
        for p in procs:
            p.start()
        got = [q.get(timeout=args.seconds + 120) for _ in procs]
        for p in procs:
            p.join(30)
        keeper.close()
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.communicate(timeout=60)
    calls = sum(g[0] for g in got)
    secs = max(g[1] for g in got)
    per_worker: dict[str, int] = {}
    for _, _, stats in got:
        for name, s in stats.items():
            per_worker[name] = per_worker.get(name, 0) + s["calls"]
    flops = 2.0 * args.m * args.k * args.n
    return {"workers": n_workers, "clients": args.clients, "calls": calls, "seconds": secs,
            "calls_per_s": calls / secs, "tflops": calls * flops / secs / 1e12, "calls_per_worker": per_worker}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="numpy", choices=("numpy", "cupy", "auto"))
    ap.add_argument("--workers", default="1,2", help="worker counts to compare (default 1,2)")
    ap.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--window", type=int, default=2, help="calls in flight per client (default 2)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--k", type=int, default=512)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--slots", default="64K:32,1M:32,16M:16,80M:8")
    ap.add_argument("--worker-args", default="--no-mlock")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from shmrpc.bench._report import machine_facts, now_iso

    started = now_iso()
    rows = [_run(int(k), args) for k in args.workers.split(",")]
    print(f"gemm {args.m}x{args.k}x{args.n} {args.dtype}, {args.backend}, {args.clients} client processes x "
          f"{args.window} in flight, {args.seconds:.0f} s")
    print(f"{'workers':>7} {'calls/s':>10} {'TFLOP/s':>9}  calls per worker")
    for r in rows:
        print(f"{r['workers']:>7} {r['calls_per_s']:>10.0f} {r['tflops']:>9.3f}  {r['calls_per_worker']}")
    if len(rows) >= 2:
        print(f"speed-up {rows[-1]['workers']} vs {rows[0]['workers']} workers: "
              f"{rows[-1]['calls_per_s'] / rows[0]['calls_per_s']:.2f}x")
    doc = {"date": started, "command": " ".join(["python", *sys.argv]), "machine": machine_facts(),
           "config": vars(args), "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
