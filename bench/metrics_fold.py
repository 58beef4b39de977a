"""The worker's metrics per request: ``Metrics.observe`` (on the answer's way) and the fold that adds the queued
observations into the counters and histograms (after the loop's turn), A/B between trees, rounds interleaved.

    python bench/metrics_fold.py --calls 4000 --rounds 4 --tree before=PATH --tree after= \\
        --out bench/results/metrics-fold-2026-12-01.json

Per round and tree, a child process with that tree on ``PYTHONPATH`` (empty: this checkout) queues ``--calls``
observations of one op with the NumPy backend's stage seconds (as the loop does for a 64 B request), then folds
them; the best of 9 such runs, per request. Pure CPU on one thread: no worker, no client, no wake-up.
"""

from __future__ import annotations

import json
import subprocess
import sys

from worker_cpu import ab_parser, ab_rounds, tree_env  # (bench/, beside this program)

_CHILD = r"""
import json, sys, time
from shmrpc.server.metrics import Metrics
m, calls = Metrics(), int(sys.argv[1])
stages = {"h2d": 0.0, "kernel": 1e-6, "d2h": 0.0, "total": 1e-6}
best_o = best_f = float("inf")
for _ in range(9):
    t0 = time.perf_counter()
    for _ in range(calls):
        m.observe("vector_add", "ok", 5e-6, 128, 64, stages)
    t1 = time.perf_counter()
    m.fold()
    t2 = time.perf_counter()
    best_o, best_f = min(best_o, t1 - t0), min(best_f, t2 - t1)
assert m._stats.ops["vector_add"].status["ok"] == 9 * calls
print(json.dumps({"observe_us": best_o / calls * 1e6, "fold_us": best_f / calls * 1e6}))
"""


def main() -> int:
    args = ab_parser(__doc__).parse_args()
    if args.calls >= 4096:  # an observer that queues that many folds itself (metrics._FOLD_AT)
        sys.exit("--calls must stay under 4096")

    def measure(label: str, path: str) -> dict[str, float]:
        out = subprocess.run([sys.executable, "-c", _CHILD, str(args.calls)], env=tree_env(path), check=True,
                             capture_output=True, text=True, timeout=120).stdout
        return {k: round(v, 3) for k, v in json.loads(out).items()}

    ab_rounds("metrics-fold", args.tree, args.rounds, args.calls, measure, "µs per request", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
