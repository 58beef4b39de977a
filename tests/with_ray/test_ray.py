"""shmrpc.ray on Ray's multi-node test cluster (two nodes on this machine): a worker per node as an actor,
same-node calls through shared memory, cross-node calls through Ray. Skipped where Ray is not installed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'shmrpc[ray]' to run these)")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    try:
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


def _on(node_id: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def _job(workers: Any, how: str, x: np.ndarray) -> tuple[np.ndarray, str]:
    """Runs as a Ray task: call the local worker through shared memory, or the other node's through Ray."""
    if how == "local":
        c = workers.client()  # a plain shmrpc Client: zero copy through the local worker's region
        return c.call("scale", x=x, a=2.0, b=1.0)["out"], c.name
    other = next(w.name for w in workers.infos if w.name not in workers.local())
    return workers.call("scale", worker=other, x=x, a=2.0, b=1.0)["out"], other


def test_a_worker_per_node_called_locally_and_across_nodes(cluster: Any, worker_name: str) -> None:
    import shmrpc.ray as sr

    workers = sr.start_workers(prefix=worker_name, per="node", backend="numpy", serve_args=("--no-mlock",))
    try:
        assert len(workers.infos) == 2 and len({w.node_id for w in workers.infos}) == 2
        job = ray.remote(num_cpus=1)(_job)
        x = np.arange(1000, dtype=np.float64)
        for info in workers.infos:
            out, used = ray.get(job.options(scheduling_strategy=_on(info.node_id)).remote(workers, "local", x))
            np.testing.assert_array_equal(out, 2 * x + 1)
            assert used == info.name  # the worker on the task's own node
            out, used = ray.get(job.options(scheduling_strategy=_on(info.node_id)).remote(workers, "remote", x))
            np.testing.assert_array_equal(out, 2 * x + 1)
            assert used != info.name
        with pytest.raises(LookupError):
            workers.client("no-such-worker")
    finally:
        workers.shutdown()
