"""Round-trip latency of ``echo`` at 64 B, 4 KiB, 1 MiB and 64 MiB: shmrpc next to bare pyzmq ping-pong.

The request path's yardstick. shmrpc is measured on its zero-copy path
(payload already in a loaned slot, ``send`` timed) and through ``Client.call``
(copy in and out); the baseline is a pyzmq DEALER/ROUTER ping-pong over
``ipc://`` carrying the same payload through the socket (``copy=False``). The
worker is started here (``--backend``) unless ``--name`` names a running one.

Usage::

    .venv/bin/python bench/rtt.py                   # writes bench/results/rtt-<date>.json
    .venv/bin/python bench/rtt.py --iters 5000 --backend cupy --out /tmp/rtt.json

It is a thin wrapper around ``shmrpc.bench`` with fixed sizes and transports.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

from shmrpc.bench import RunConfig, finish_document, run_benchmark, write_json
from shmrpc.bench._report import latency_table, verdict_lines
from shmrpc.bench._stats import size_label

__all__ = ["SIZES", "TRANSPORTS", "main"]

SIZES = [64, 4 << 10, 1 << 20, 64 << 20]
TRANSPORTS = ["shmrpc", "shmrpc-call", "zmq"]
RESULTS = Path(__file__).resolve().parent / "results"


def summary(doc: dict) -> str:
    """p50/p99 per size, one column pair per transport, and each one's p50 over shmrpc's."""
    lat = {(r["transport"], r["nbytes"]): r["latency"] for r in doc["results"] if "latency" in r}
    keys = [k for k in TRANSPORTS if doc["transports"].get(k, {}).get("status") == "ok"]
    head = f"{'size':>6} " + " ".join(f"{k + ' p50/p99 µs':>26}" for k in keys)
    lines = [head]
    for n in SIZES:
        cells = []
        for k in keys:
            p = lat.get((k, n))
            cells.append(f"{p['p50_us']:12.1f} / {p['p99_us']:11.1f}" if p else f"{'-':>26}")
        lines.append(f"{size_label(n):>6} " + " ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the fixed comparison; print the tables; write the JSON. Returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="bench/rtt.py", description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000, help="timed round trips per size (cut for 64 MiB by a 2 GiB budget)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    p.add_argument("--name", help="a running worker to use instead of starting one")
    p.add_argument("--worker-args", default="", help="more arguments for the worker it starts")
    p.add_argument("--out", help="JSON path (default bench/results/rtt-<date>.json)")
    p.add_argument("--quiet", "-q", action="store_true")
    args = p.parse_args(argv)
    cfg = RunConfig(mode="lat", sizes=SIZES, iters=args.iters, warmup=args.warmup, backend=args.backend,
                    transports=TRANSPORTS, name=args.name, worker_args=args.worker_args)
    doc = run_benchmark(cfg, quiet=args.quiet, log=lambda s: print(s, file=sys.stderr))
    finish_document(doc, ["bench/rtt.py", *argv])
    doc["program"] = "bench/rtt.py"
    print(latency_table(doc))
    print()
    print(summary(doc))
    print()
    print(verdict_lines(doc))
    out = Path(args.out) if args.out else RESULTS / f"rtt-{dt.date.today().isoformat()}.json"
    print(f"\nJSON: {write_json(doc, out)}")
    return 0 if any(v["status"] == "ok" for v in doc["transports"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
