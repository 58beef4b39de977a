"""Round trips to a shmrpc worker on Ray: from a task on the worker's node (shared memory, the normal Client)
and from a task on another node (through Ray: the actor, arrays via the object store), at 64 B, 1 MiB, 64 MiB.

Runs Ray's multi-node test cluster on this machine (``ray.cluster_utils.Cluster``, two nodes), so "another
node" shares this host's memory bus: the cross-node figures are Ray's serialization and object-store path,
without a network in between (a real network adds its own transfer time).

    python bench/ray_rtt.py --out bench/results/ray-rtt-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _measure(workers: Any, how: str, sizes: list[int], iters: dict[int, int]) -> list[dict[str, Any]]:
    local = workers.local()
    other = next(w.name for w in workers.infos if w.name not in local)
    rows = []
    for n in sizes:
        x = np.ones(n, np.uint8)
        if how == "same-node (shm)":
            c = workers.client()

            def call(c: Any = c, x: np.ndarray = x) -> Any:
                return c.call("echo", x=x)["out"]
        else:
            def call(x: np.ndarray = x) -> Any:
                return workers.call("echo", worker=other, x=x)["out"]
        for _ in range(3):
            call()
        ts = []
        for _ in range(iters[n]):
            t0 = time.perf_counter()
            out = call()
            ts.append(time.perf_counter() - t0)
        assert out.nbytes == n
        a = np.asarray(ts) * 1e6
        rows.append({"path": how, "nbytes": n, "iters": iters[n], "p50_us": float(np.percentile(a, 50)),
                     "p90_us": float(np.percentile(a, 90)), "min_us": float(a.min())})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import shmrpc.ray as sr
    from shmrpc.bench._report import machine_facts, now_iso

    started = now_iso()
    sizes = [64, 1 << 20, 64 << 20]
    iters = {64: 500, 1 << 20: 100, 64 << 20: 10}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "object_store_memory": 1 << 30})
    cluster.add_node(num_cpus=1, object_store_memory=1 << 30)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        workers = sr.start_workers(prefix="raybench", per="node", backend="numpy",
                                   serve_args=("--no-mlock", "--slots", "64K:8,4M:4,160M:2", "--lease", "2,1,1"))
        try:
            job = ray.remote(num_cpus=1)(_measure)
            node = workers.infos[0].node_id
            opts = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
            rows = ray.get(job.options(**opts).remote(workers, "same-node (shm)", sizes, iters))
            rows += ray.get(job.options(**opts).remote(workers, "cross-node (Ray)", sizes, iters))
        finally:
            workers.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(f"{'path':<18} {'size':>10} {'p50 µs':>10} {'p90 µs':>10} {'min µs':>10}")
    for r in rows:
        print(f"{r['path']:<18} {r['nbytes']:>10} {r['p50_us']:>10.1f} {r['p90_us']:>10.1f} {r['min_us']:>10.1f}")
    doc = {"date": started, "command": " ".join(["python", *sys.argv]), "machine": machine_facts(),
           "ray": ray.__version__, "cluster": "ray.cluster_utils.Cluster, 2 nodes on this machine", "results": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1, default=str) + "\n")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
