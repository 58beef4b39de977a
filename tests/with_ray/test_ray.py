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
        # before: a bare ValueError ("'no-such-worker' is not in list")
        with pytest.raises(LookupError, match="no-such-worker"):
            workers.call("scale", worker="no-such-worker", x=x, a=2.0)
    finally:
        workers.shutdown()


def _reused_job(workers: Any, x: np.ndarray) -> tuple[int, int, np.ndarray]:
    import os

    c = workers.client()
    return os.getpid(), id(c), c.call("scale", x=x, a=2.0, b=1.0)["out"]


def test_a_ray_worker_process_reused_for_many_tasks_holds_one_client(cluster: Any, worker_name: str) -> None:
    # Before: each task's unpickled Workers connected a client of its own, never closed; a Ray worker process
    # running its 17th task was refused by the worker (ClientLimitError, --max-clients-per-uid 16).
    import shmrpc.ray as sr

    workers = sr.start_workers(prefix=worker_name, per="node", backend="numpy", serve_args=("--no-mlock",))
    try:
        node = workers.infos[0].node_id
        job = ray.remote(num_cpus=1)(_reused_job).options(scheduling_strategy=_on(node))
        x = np.arange(64, dtype=np.float32)
        clients: dict[int, set[int]] = {}
        for _ in range(20):  # one at a time: the node's one CPU, so the same Ray worker process runs them
            pid, cid, out = ray.get(job.remote(workers, x), timeout=60)
            np.testing.assert_array_equal(out, 2 * x + 1)
            clients.setdefault(pid, set()).add(cid)
        assert all(len(ids) == 1 for ids in clients.values()), clients
        assert len(clients) < 20  # processes were reused (else this test would say nothing)
    finally:
        workers.shutdown()


def test_a_worker_that_does_not_start_is_a_runtime_error_and_the_others_are_stopped(cluster: Any,
                                                                                     worker_name: str) -> None:
    # Before: Ray's ActorDiedError (not the RuntimeError documented), and the workers of the same call that did
    # start on other nodes were left running, their actors alive.
    import subprocess
    import sys

    import shmrpc.ray as sr
    from shmrpc.schema.naming import socket_path

    nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    taken, free = (f"{worker_name}-{n[:12]}" for n in nodes)
    squatter = subprocess.Popen([sys.executable, "-m", "shmrpc.server", "serve", "--name", taken, "--backend", "numpy",
                                 "--no-mlock", "--log-level", "ERROR"], stdout=subprocess.PIPE, text=True)
    try:
        assert squatter.stdout is not None and " ready " in squatter.stdout.readline()
        with pytest.raises(RuntimeError, match=taken):
            sr.start_workers(prefix=worker_name, per="node", backend="numpy", serve_args=("--no-mlock",),
                             timeout_s=60)
        assert not socket_path(free).exists()  # the one that started was stopped, and cleaned up
    finally:
        squatter.terminate()
        squatter.communicate(timeout=30)


@pytest.mark.timeout(60)
def test_a_worker_whose_op_prints_to_stdout_keeps_answering(worker_name: str, monkeypatch: pytest.MonkeyPatch,
                                                          capfd: pytest.CaptureFixture[str]) -> None:
    # Before: the actor read its worker's stdout once (the ready line) and never again; an op printing to it
    # blocked the worker once the pipe held 64 KiB, and every call then timed out.
    import os
    from pathlib import Path

    from shmrpc.client import Client
    from shmrpc.ray import ShmrpcNode

    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p))
    node = ShmrpcNode(worker_name, "numpy", ["--no-mlock", "--ops", "chatty_ops"], use_gpu=False)
    try:
        with Client(worker_name, timeout_s=10) as c:
            for i in range(40):  # 160 KiB printed
                np.testing.assert_array_equal(c.call("chatty", x=np.full(4, float(i)))["out"], float(i))
    finally:
        assert node.stop() == 0
    assert "x" * 4096 in capfd.readouterr().out  # what the op printed went on to the actor's stdout
