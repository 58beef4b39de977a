"""shmrpc.ray: shmrpc workers on a Ray cluster (the ``ray`` extra: ``pip install 'shmrpc[ray]'``).

One shmrpc worker per node (or per GPU) runs as the child process of a Ray actor
that holds the node's GPU resources. Callers reach it two ways::

    node A                                         node B
    ┌────────────────────────────────┐             ┌───────────────────────────────┐
    │ task/actor ─Client (shm, zero  │             │ task/actor                    │
    │   copy)──▶ shmrpc worker A     │             │   │ workers.call(..., worker=A)│
    │             ▲ child of         │  Ray RPC +  │   ▼                           │
    │        ShmrpcNode actor A ◀────┼─object store┼── arrays (serialized, copied) │
    └────────────────────────────────┘             └───────────────────────────────┘

* Same node: :meth:`Workers.client` is the normal :class:`~shmrpc.client.Client`
  to the local worker, zero copy through shared memory.
* Another node: :meth:`Workers.call` with a ``worker`` on another node (or when none
  is local) calls the actor, and the arrays travel through Ray's object store both
  ways (serialized and copied, at Ray's speed; bench/ray_rtt.py measures it).

Example::

    import ray, shmrpc.ray as sr
    ray.init()
    workers = sr.start_workers(prefix="demo", per="node", backend="numpy")
    @ray.remote
    def job(workers, x):
        return workers.call("scale", x=x, a=2.0)["out"]     # local worker: shared memory
    ray.get(job.remote(workers, np.ones(4)))
    workers.shutdown()
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("shmrpc.ray needs Ray: pip install 'shmrpc[ray]'") from e

from shmrpc.client import Client
from shmrpc.schema.naming import socket_path

__all__ = ["ShmrpcNode", "Workers", "WorkerInfo", "start_workers"]

# The clients of this process, by worker name and Client keywords. A task gets its Workers unpickled anew each time,
# and a Ray worker process runs many tasks: the clients are the process's, not the Workers object's, so a process
# holds one lease per worker however many tasks it runs (before, each task's copy connected a client of its own that
# was never closed, and the 17th task of a reused process was refused with ClientLimitError).
_clients: dict[tuple[str, tuple[tuple[str, Any], ...]], Client] = {}
_clients_pid = os.getpid()
_clients_lock = threading.Lock()


def _process_client(name: str, kwargs: dict[str, Any]) -> Client:
    """This process's client of worker ``name`` with these keywords: made once, made again when its worker is gone."""
    global _clients_pid
    key = (name, tuple(sorted(kwargs.items())))
    with _clients_lock:
        if _clients_pid != os.getpid():  # a forked child: the parent's clients are not its own (ForkedClientError)
            _clients.clear()
            _clients_pid = os.getpid()
        c = _clients.get(key)
        if c is not None and (c._closed or not c.worker_alive):  # closed by the caller, or its worker restarted
            c.close()
            c = None
        if c is None:
            c = _clients[key] = Client(name, **kwargs)
        return c


def _close_clients(names: set[str]) -> None:
    with _clients_lock:
        if _clients_pid != os.getpid():
            return
        for key in [k for k in _clients if k[0] in names]:
            _clients.pop(key).close()


@dataclass(frozen=True)
class WorkerInfo:
    """Where one shmrpc worker runs: its name, the Ray node id, the GPU it holds (or None)."""

    name: str
    node_id: str
    device: int | None


def _forward(stream: Any) -> None:
    """Copy a worker's stdout to this process's until the worker closes it."""
    with stream:
        for line in stream:
            sys.stdout.write(line)
            sys.stdout.flush()


class ShmrpcNode:
    """The Ray actor that runs one ``shmrpc serve`` on its node and answers calls from other nodes."""

    def __init__(self, name: str, backend: str, serve_args: list[str], use_gpu: bool) -> None:
        self.device: int | None = None
        argv = [sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--backend", backend, *serve_args]
        if use_gpu:
            ids = ray.get_gpu_ids()
            self.device = int(ids[0]) if ids else None
        env = dict(os.environ)
        if self.device is not None:
            argv += ["--device", str(self.device)]
            env.pop("CUDA_VISIBLE_DEVICES", None)  # the worker picks its device by --device
        self.name = name
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env, stdin=subprocess.DEVNULL)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if " ready " not in line or not socket_path(name).exists():
            self.proc.kill()
            raise RuntimeError(f"shmrpc worker {name} did not start: {line.strip()} (exit {self.proc.wait()})")
        # the rest of the worker's stdout (a user's op may print) goes on to this actor's, which Ray logs: left
        # unread, the pipe filled at 64 KiB and the worker blocked in its next print, every call then timing out
        threading.Thread(target=_forward, args=(self.proc.stdout,), name=f"shmrpc-stdout-{name}", daemon=True).start()
        self._client: Client | None = None

    def info(self) -> WorkerInfo:
        """This worker's name, node and device."""
        return WorkerInfo(self.name, ray.get_runtime_context().get_node_id(), self.device)

    def call(self, op: Any, kwargs: dict[str, Any]) -> dict[str, np.ndarray]:
        """Run ``op`` for a caller on another node (its arrays came, and go back, through the object store)."""
        if self._client is not None and not self._client.worker_alive:
            self._client.close()
            self._client = None
        if self._client is None:
            self._client = Client(self.name, timeout_s=120.0)
        return self._client.call(op, **kwargs)

    def stop(self) -> int:
        """Stop the worker (SIGTERM: it drains and cleans up); returns its exit status."""
        if self._client is not None:
            self._client.close()
            self._client = None
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)


@dataclass
class Workers:
    """The shmrpc workers of a Ray cluster; picklable, so it can be passed to tasks and actors."""

    infos: list[WorkerInfo]
    actors: list[Any]

    def local(self) -> list[str]:
        """Names of the workers on the node this process runs on."""
        here = ray.get_runtime_context().get_node_id()
        return [w.name for w in self.infos if w.node_id == here]

    def client(self, worker: str | None = None, **kwargs: Any) -> Client:
        """The shared-memory :class:`Client` of a worker on this node (the first local one by default).

        The client is this process's: every task a Ray worker process runs gets the same one for the same worker
        and keywords (do not close it; :meth:`shutdown` does), a new one once its worker was restarted.

        Raises:
            LookupError: no worker of this set runs on this node (use :meth:`call`, which goes through Ray).
        """
        names = self.local()
        name = worker or (names[0] if names else None)
        if name is None or name not in names:
            raise LookupError(f"no shmrpc worker {'named ' + repr(worker) + ' ' if worker else ''}on this node; "
                              "call it through Ray with Workers.call")
        return _process_client(name, {"timeout_s": 120.0, **kwargs})

    def call(self, op: Any, *, worker: str | None = None, **kwargs: Any) -> dict[str, np.ndarray]:
        """Run ``op``: through shared memory on a local worker, else through Ray on ``worker``'s actor.

        ``worker`` (a name from :attr:`infos`) picks the worker; by default a local one, else the first.

        Raises:
            LookupError: ``worker`` is not one of this set's workers, or the set has none.
        """
        names = self.local()
        if (worker is None and names) or worker in names:
            return self.client(worker).call(op, **kwargs)
        all_names = [w.name for w in self.infos]
        target = worker or (all_names[0] if all_names else None)
        if target is None or target not in all_names:
            raise LookupError(f"no shmrpc worker named {target!r} in this set (its workers: {all_names})"
                              if target else "this set has no shmrpc workers")
        actor = self.actors[all_names.index(target)]
        return ray.get(actor.call.remote(op, kwargs))  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        """Stop every worker and its actor."""
        _close_clients({w.name for w in self.infos})
        ray.get([a.stop.remote() for a in self.actors])
        for a in self.actors:
            ray.kill(a)


def start_workers(prefix: str = "shmrpc", *, per: str = "node", backend: str = "auto",
                  serve_args: tuple[str, ...] = (), timeout_s: float = 120.0) -> Workers:
    """Start one shmrpc worker per alive node (``per="node"``) or per GPU (``per="gpu"``, each actor holding
    ``num_gpus=1``, its worker bound to that GPU with ``--device``).

    Worker names are ``<prefix>-<node id prefix>[-<gpu index>]``; each worker is pinned to its node.

    Raises:
        ValueError: ``per`` is neither "node" nor "gpu".
        RuntimeError: a worker did not start, or not within ``timeout_s`` (its actor's error); the workers of this
            call that did start are stopped.
    """
    if per not in ("node", "gpu"):
        raise ValueError("per is 'node' or 'gpu'")
    actor_cls: Any = ray.remote(ShmrpcNode)
    actors, names = [], []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        n_gpus = int(node.get("Resources", {}).get("GPU", 0))
        slots = range(n_gpus) if per == "gpu" else [None]
        for g in slots:
            name = f"{prefix}-{node_id[:12]}" + ("" if g is None else f"-{g}")
            opts: dict[str, Any] = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False),
                                    "num_cpus": 0}
            if g is not None:
                opts["num_gpus"] = 1
            actors.append(actor_cls.options(**opts).remote(name, backend, list(serve_args), g is not None))
            names.append(name)
    deadline = time.monotonic() + timeout_s
    try:
        infos = ray.get([a.info.remote() for a in actors], timeout=max(1.0, deadline - time.monotonic()))
    except ray.exceptions.RayError as e:  # an actor's worker did not start, or not in time: stop the others too
        _stop_actors(actors)
        why = [ln.strip() for ln in str(e).splitlines() if "did not start" in ln]
        raise RuntimeError(f"shmrpc workers {names} did not all start: "
                           f"{why[-1] if why else type(e).__name__ + ': ' + str(e).splitlines()[0]}") from e
    return Workers(list(infos), actors)


def _stop_actors(actors: list[Any]) -> None:
    """Stop the workers of these actors that run (each drains and cleans up), then end every actor."""
    refs = [a.stop.remote() for a in actors]
    for r in refs:
        try:
            ray.get(r, timeout=60)
        except ray.exceptions.RayError:  # its worker never started (the actor died in __init__), or is stuck
            pass
    for a in actors:
        ray.kill(a)
