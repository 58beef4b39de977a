"""Where the worker's loop spends its time under many small same-shape requests: a worker under cProfile.

    python bench/gpu/gemm_profile.py --clients 8 --transport shmrpc-lane-spin --out bench/out/gpu/gemm-profile

Starts ``shmrpc serve`` (CuPy backend by default, the worker arguments ``shmrpc bench`` gives the
small-gemm sweep) under ``python -m cProfile``, runs ``shmrpc bench lat`` against it (``--clients``
client processes of gemm x=16x256 @ w=256x256 float16, x and w sent with every request), stops the
worker with SIGTERM and writes its top functions by own and by cumulative time, with the bench's
requests/s, to ``<out>/profile.txt`` and ``<out>/profile.json``. cProfile slows the worker's Python
(several times per call), so the requests/s here are below an unprofiled run: read the shares, not the
rates.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pstats
import secrets
import signal
import subprocess
import sys
import time


def gemm_client_args(doc: str | None) -> argparse.ArgumentParser:
    """A parser with the arguments of :func:`gemm_clients`'s runs: --clients, --transport, --iters, --backend."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--transport", default="shmrpc-lane-spin")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--backend", default="cupy")
    return ap


def gemm_clients(worker_cmd: list[str], tag: str, transport: str, clients: int, iters: int, backend: str,
                 bench_json: str, worker_args: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess[str], float,
                                                                      dict[str, tuple[int, float | None]]]:
    """Start a worker by ``worker_cmd`` (the command before ``serve``: e.g. ``python -m shmrpc.server``) with the
    arguments of the small-gemm sweep, run ``shmrpc bench lat`` against it (``clients`` processes of gemm x=16x256 @
    w=256x256 float16 through ``transport``, its JSON to ``bench_json``), stop the worker with SIGTERM and wait for it.
    Returns the bench's process, its seconds, and (requests/s, mean batch) per transport and client count."""
    name = f"{tag}-{os.getpid()}-{secrets.token_hex(3)}"
    worker = subprocess.Popen([*worker_cmd, "serve", "--name", name, "--backend", backend, "--log-level", "WARNING",
                               "--slots", "1M:64", "--lease", "4", "--max-clients-per-uid", "20", *worker_args],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None
        line = worker.stdout.readline()  # the ready line
        if "ready" not in line:
            raise SystemExit(f"the worker did not start: {line!r}")
        t0 = time.monotonic()
        bench = subprocess.run([sys.executable, "-m", "shmrpc.bench", "lat", "--name", name, "--transports", transport,
                                "--clients", str(clients), "--iters", str(iters), "--warmup", "50", "--backend", backend,
                                "--op", "gemm", "--shape", "x=16x256", "--shape", "w=256x256", "--dtype", "float16",
                                "-q", "--out", bench_json], capture_output=True, text=True, timeout=240)
        elapsed = time.monotonic() - t0
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    rates: dict[str, tuple[int, float | None]] = {}
    try:
        with open(bench_json) as f:
            for r in json.load(f).get("scaling", []):
                rates[f"{r['transport']} x{r['clients']}"] = (round(r["calls_per_s"]), r.get("worker", {}).get("mean_batch"))
    except (OSError, ValueError):
        pass
    return bench, elapsed, rates


def main() -> int:
    ap = gemm_client_args(__doc__)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--out", default="bench/out/gpu/gemm-profile")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    prof = os.path.join(args.out, "worker.prof")
    bench, elapsed, rates = gemm_clients([sys.executable, "-m", "cProfile", "-o", prof, "-m", "shmrpc.server"], "gprof",
                                         args.transport, args.clients, args.iters, args.backend,
                                         os.path.join(args.out, "bench.json"))
    st = pstats.Stats(prof)
    total = st.total_tt  # type: ignore[attr-defined]
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        text.write(f"===== worker: top {args.top} by {key} (total {total:.2f} s)\n")
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(args.top)
    out_txt = os.path.join(args.out, "profile.txt")
    with open(out_txt, "w") as f:
        f.write(f"bench: {' '.join(bench.args)}\nexit {bench.returncode}, {elapsed:.1f} s; (requests/s, mean batch) {rates}\n")
        f.write(bench.stdout[-3000:] + bench.stderr[-2000:] + "\n")
        f.write(text.getvalue())
    rows = []
    for (file, line, fn), (_cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{os.path.basename(file)}:{line}({fn})", "calls": nc, "own_s": round(tt, 4),
                     "cum_s": round(ct, 4)})
    rows.sort(key=lambda r: -r["own_s"])
    with open(os.path.join(args.out, "profile.json"), "w") as f:
        json.dump({"command": " ".join(sys.argv), "clients": args.clients, "transport": args.transport,
                   "requests_per_s": rates, "total_s": total, "top_by_own": rows[:80]}, f, indent=1)
    print(f"(requests/s, mean batch) with the profiled worker: {rates}; profile in {out_txt}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
