"""CPU time the worker process spends per small request, A/B between trees, rounds interleaved.

    python bench/worker_cpu.py --calls 20000 --rounds 4 --tree before=PATH --tree after= \\
        --out bench/results/worker-cpu-hotpath-2026-11-30.json

Each ``--tree LABEL=PYTHONPATH`` starts the worker (``shmrpc serve``, NumPy backend) with that
``PYTHONPATH`` (empty: this checkout), so the worker's code is that tree's while the client
(this process) stays the same. Per round and tree, the client sends ``--calls`` 64 B in-place
``vector_add`` loan round trips over ZeroMQ, then as many through a blocking lane, and the
worker's user+system CPU seconds (``/proc/<pid>/stat``, all its threads) are read before and
after each phase. Latency on a loaded machine depends on the scheduler; the CPU a process
burns per request much less, which is why this is the figure to compare for a worker-side
change of a few µs. Medians over the rounds are printed and written to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def _phase(c: object, pid: int, calls: int) -> tuple[float, float]:
    """(worker CPU µs per request, wall µs per round trip) of ``calls`` loan round trips through client ``c``."""
    with c.loan(4096) as req:  # type: ignore[attr-defined]
        x = np.arange(16, dtype=np.float32)
        req.array("x", (16,), np.float32)[...] = x
        req.array("y", (16,), np.float32)[...] = x
        for _ in range(200):
            req.send("vector_add", in_place=True)
        cpu0, t0 = _cpu_s(pid), time.perf_counter()
        for _ in range(calls):
            req.send("vector_add", in_place=True)
        wall, cpu = time.perf_counter() - t0, _cpu_s(pid) - cpu0
    return cpu / calls * 1e6, wall / calls * 1e6


def start_worker(name: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A NumPy worker named ``name`` (``shmrpc serve`` with ``env``, default this process's), once it says it is
    ready; the caller stops it (SIGTERM)."""
    worker = subprocess.Popen([sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--backend", "numpy",
                               "--no-mlock", "--log-level", "WARNING", "--slots", "64K:16", "--lease", "4"],
                              env=env, stdout=subprocess.PIPE, text=True)
    if worker.stdout is None or "ready" not in worker.stdout.readline():
        worker.kill()
        raise SystemExit(f"worker {name} did not start")
    return worker


def _one(label: str, pythonpath: str, calls: int) -> dict[str, float]:
    from shmrpc.client import Client

    name = f"wcpu-{os.getpid()}-{secrets.token_hex(3)}"
    worker = start_worker(name, tree_env(pythonpath))
    try:
        out: dict[str, float] = {}
        with Client(name, timeout_s=30) as c:
            out["zmq_cpu_us"], out["zmq_wall_us"] = _phase(c, worker.pid, calls)
        with Client(name, timeout_s=30, lane="block") as c:
            out["lane_cpu_us"], out["lane_wall_us"] = _phase(c, worker.pid, calls)
        return out
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)


def main() -> int:
    args = ab_parser(__doc__).parse_args()
    ab_rounds("worker-cpu", args.tree, args.rounds, args.calls, lambda label, path: _one(label, path, args.calls),
              "µs per request", args.out)
    return 0


def tree_env(pythonpath: str) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` set to a tree's (empty: none, this checkout)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    else:
        env.pop("PYTHONPATH", None)
    return env


def ab_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options of an A/B between trees: --calls, --rounds, --tree LABEL=PYTHONPATH (repeated), --out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--tree", action="append", required=True, metavar="LABEL=PYTHONPATH")
    ap.add_argument("--out", default=None)
    return ap


def ab_rounds(mode: str, tree_args: list[str], rounds: int, calls: int,
              measure: Callable[[str, str], dict[str, float]], unit: str, out: str | None) -> None:
    """``measure(label, pythonpath)`` of each ``LABEL=PYTHONPATH`` tree, ``rounds`` times interleaved ABBA; prints each
    round and the medians over rounds (in ``unit``), and writes them to ``out`` (``write_probe``) when given."""
    trees = [t.split("=", 1) for t in tree_args]
    runs: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
    for r in range(rounds):
        for label, path in trees if r % 2 == 0 else list(reversed(trees)):  # ABBA: neither goes first each time
            runs[label].append(measure(label, path))
            print(f"round {r + 1} {label:<8} " + "  ".join(f"{k} {v:7.2f}" for k, v in runs[label][-1].items()),
                  flush=True)
    medians = {label: {k: round(statistics.median(x[k] for x in rs), 2) for k in rs[0]} for label, rs in runs.items()}
    print(f"\nmedians over rounds ({unit})")
    for label, med in medians.items():
        print(f"  {label:<8} " + "  ".join(f"{k} {v:7.2f}" for k, v in med.items()))
    if out:
        from shmrpc.bench._report import write_probe

        doc = {"mode": mode, "calls": calls, "rounds": rounds,
               "trees": {label: (path or "this checkout") for label, path in trees}, "runs": runs, "medians": medians}
        write_probe(doc, None, out)


def child_main(doc: str | None, mode: str, prefix: str, child: str, unit: str) -> int:
    """The main of an A/B whose measure is a child program: one NumPy worker named ``prefix-PID-HEX``; per round and
    tree ``python -c child NAME CALLS`` with that tree's ``PYTHONPATH``, whose last line of output is a JSON object of
    figures (floats rounded to 3 places); ``ab_rounds`` over them (``mode``, ``unit``)."""
    args = ab_parser(doc).parse_args()
    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"

    def one(_: str, pythonpath: str) -> dict[str, float]:
        got = subprocess.run([sys.executable, "-c", child, name, str(args.calls)], env=tree_env(pythonpath),
                             capture_output=True, text=True, timeout=600, check=False)
        if got.returncode != 0:
            raise SystemExit(f"the client child failed:\n{got.stderr[-3000:]}")
        figures = json.loads(got.stdout.strip().splitlines()[-1])
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}

    worker = start_worker(name)
    try:
        ab_rounds(mode, args.tree, args.rounds, args.calls, one, unit, args.out)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
