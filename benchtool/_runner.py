"""The timing loops, the servers a run needs, and the multi-client mode.

Latency: per size, ``warmup`` untimed round trips, then ``iters`` (cut by the
byte budget for large sizes) timed one by one with ``time.perf_counter_ns``.

Bandwidth: per size, ``window`` requests are sent before the first reply is
awaited; from then on every reply is followed by a new request, so ``window``
stay in flight until the last ones drain. The figure is payload bytes moved
over the elapsed wall time of the whole batch (see ``BandwidthStats``).

Clients: N ``spawn`` processes, each with its own connection, start their
latency loops together (a barrier); aggregate calls/s is all their calls over
the span from the first start to the last finish.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._own import OwnBackendTransport
from ._peers import PEERS, start_peer_server
from ._shm import (
    ShmCallLaneTransport,
    ShmCallTransport,
    ShmLaneSpinTransport,
    ShmLaneTransport,
    ShmLoanTransport,
    SlotPlan,
    WorkerProcess,
    plan_slots,
    tensors_of,
)
from ._stats import bandwidth_stats, iters_for_size, latency_stats
from ._transport import Transport, TransportUnavailable, ctrl_c_left_to_us

__all__ = ["RunConfig", "Servers", "open_servers", "make_transport", "measure_latency", "measure_bandwidth",
           "run_clients", "SHM_KEYS", "TRANSPORT_CLASSES"]

SHM_KEYS = ("shmrpc", "shmrpc-call", "shmrpc-lane", "shmrpc-lane-spin", "shmrpc-call-lane")
#: Every transport key -> its client class.
TRANSPORT_CLASSES: dict[str, type[Transport]] = {
    "shmrpc": ShmLoanTransport,
    "shmrpc-call": ShmCallTransport,
    "shmrpc-lane": ShmLaneTransport,
    "shmrpc-lane-spin": ShmLaneSpinTransport,
    "shmrpc-call-lane": ShmCallLaneTransport,
    "own": OwnBackendTransport,
    **{k: v[0] for k, v in PEERS.items()},
}


@dataclass
class RunConfig:
    """Everything one ``shmrpc bench`` run measures; filled by the CLI or by tests."""

    mode: str = "lat"
    sizes: list[int] = field(default_factory=lambda: [64, 4096, 1 << 20, 64 << 20])
    iters: int = 1000
    warmup: int = 50
    op: str = "echo"
    attrs: dict[str, Any] = field(default_factory=dict)
    dtype: str = "uint8"
    backend: str = "auto"
    window: int = 4
    clients: list[int] = field(default_factory=list)
    clients_max_nbytes: int = 1 << 20
    transports: list[str] = field(default_factory=lambda: ["shmrpc", "shmrpc-call"])
    name: str | None = None
    worker_args: str = ""
    spin_us: int = 0  # the started worker's --spin-us and the shmrpc clients' spin_us
    connect_iters: int = 0  # Client(name) connects timed (0: none)
    in_place: bool = False  # the loan sends with in_place=True (the output over the first input)
    bytes_budget: int = 2 << 30
    min_iters: int = 5
    #: input name -> shape (``--shape``): every shmrpc path and ``own`` send tensors of these shapes; ``sizes`` is then
    #: their bytes together, which the peers move
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    server_cpus: tuple[int, ...] = ()  # every server started runs on these CPUs (the worker: serve --cpus)
    client_cpus: tuple[int, ...] = ()  # this process and its client processes (pinned by the CLI)

    def scaling_sizes(self) -> list[int]:
        """The sizes the multi-client mode runs: those up to ``clients_max_nbytes`` (the smallest if none)."""
        small = [n for n in self.sizes if n <= self.clients_max_nbytes]
        return small or self.sizes[:1]


@dataclass
class Servers:
    """The addresses of the servers a run uses, what is skipped and why, and the worker's facts."""

    addresses: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    plan: SlotPlan | None = None
    metrics_url: str | None = None  # the started worker's /metrics, for the batches of each client point


def make_transport(key: str, address: str, cfg: RunConfig) -> Transport:
    """A connected client of transport ``key`` at ``address`` (shmrpc ones get the op, attrs and dtype)."""
    cls = TRANSPORT_CLASSES[key]
    if key in SHM_KEYS:
        return cls(address, op=cfg.op, attrs=cfg.attrs, dtype=cfg.dtype, spin_us=cfg.spin_us,  # type: ignore[call-arg]
                   in_place=cfg.in_place, shapes=cfg.shapes)
    if key == "own":
        return OwnBackendTransport(address, op=cfg.op, attrs=cfg.attrs, dtype=cfg.dtype, backend=cfg.backend,
                                   shapes=cfg.shapes)
    return cls(address)


@contextmanager
def started_on(cpus: tuple[int, ...]) -> Iterator[None]:
    """Processes started inside run on ``cpus`` (none: where this thread runs): this thread's own CPUs change for
    that time, and a child inherits them."""
    if not cpus:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


@contextmanager
def open_servers(cfg: RunConfig, log: Callable[[str], None] = print,
                 servers: Servers | None = None) -> Iterator[Servers]:
    """Start the worker (unless ``cfg.name``) and the peer servers; stop them all on exit.

    A transport that cannot start is put in ``skipped`` with the reason and logged. ``servers``: the object to fill
    (the caller then has the worker's facts also when a Ctrl-C comes before all are started).
    """
    servers = Servers() if servers is None else servers
    with ExitStack() as stack:
        shm = [k for k in cfg.transports if k in SHM_KEYS]
        if shm and cfg.name:
            servers.addresses.update({k: cfg.name for k in shm})
            servers.worker = {"name": cfg.name, "started_by_bench": False}
        elif shm:
            n_clients = max([1, *cfg.clients])
            plan = plan_slots(cfg.sizes, cfg.window, n_clients, clients_max_nbytes=max(cfg.scaling_sizes()),
                              tensors=tensors_of(cfg.op))
            servers.plan = plan
            try:
                extra = f"{cfg.worker_args} --spin-us {cfg.spin_us}" if cfg.spin_us else cfg.worker_args
                if cfg.server_cpus:
                    extra += f" --cpus {','.join(map(str, cfg.server_cpus))}"
                if n_clients > 8 and "--max-clients-per-uid" not in extra:  # the sweep's processes, this one, spares
                    extra += f" --max-clients-per-uid {n_clients + 4}"
                if n_clients + 4 > 64 and "--max-clients " not in f"{extra} ":  # past the worker's default of 64
                    extra += f" --max-clients {n_clients + 4}"
                worker = stack.enter_context(WorkerProcess(plan, cfg.backend, extra))
                worker.wait_ready()
                servers.addresses.update({k: worker.name for k in shm})
                servers.metrics_url = worker.metrics_url()
                servers.worker = {"name": worker.name, "started_by_bench": True, "argv": ["python", *worker.argv[1:]],
                                  "slots": plan.slots, "lease": plan.lease, "region_nbytes": plan.region_nbytes,
                                  "mlocked": worker.mlocked}
                stack.callback(_record_exit, servers.worker, worker)
            except (OSError, TransportUnavailable) as exc:
                for k in shm:
                    servers.skipped[k] = f"cannot start the worker: {exc}"
        for key in cfg.transports:
            if key in SHM_KEYS:
                continue
            if key == "own":  # no server: each client process runs the op itself
                servers.addresses[key] = ""
                continue
            try:
                with started_on(cfg.server_cpus):
                    srv = stack.enter_context(start_peer_server(key))
                servers.addresses[key] = srv.address
            except TransportUnavailable as exc:
                servers.skipped[key] = str(exc)
        for key, why in servers.skipped.items():
            log(f"skipped {key}: {why}")
        yield servers


def _record_exit(facts: dict[str, Any], worker: WorkerProcess) -> None:
    facts["exit_status"] = worker.close()


def measure_latency(t: Transport, iters: int, warmup: int) -> np.ndarray:
    """``warmup`` untimed then ``iters`` timed round trips of the prepared payload; the samples in ns."""
    for _ in range(warmup):
        t.roundtrip()
    samples = np.empty(iters, dtype=np.int64)
    clock = time.perf_counter_ns
    rt = t.roundtrip
    for i in range(iters):
        t0 = clock()
        rt()
        samples[i] = clock() - t0
    return samples


def measure_bandwidth(t: Transport, messages: int, window: int, warmup: int) -> float:
    """Run ``messages`` round trips with ``window`` in flight (after ``warmup`` untimed ones); elapsed seconds."""
    for _ in range(warmup):
        t.roundtrip()
    window = max(1, min(window, messages))
    start, finish = t.start, t.finish
    t0 = time.perf_counter()
    inflight = [start() for _ in range(window)]
    sent = window
    head = 0
    while head < messages:
        finish(inflight[head % window])
        head += 1
        if sent < messages:
            inflight[(sent) % window] = start()
            sent += 1
    return time.perf_counter() - t0


def bandwidth_point(t: Transport, nbytes: int, cfg: RunConfig, window: int) -> dict[str, Any]:
    """One bandwidth figure: prepare, measure, summarise as a JSON-ready dict."""
    messages = max(window, iters_for_size(nbytes, cfg.iters, cfg.bytes_budget, cfg.min_iters))
    elapsed = measure_bandwidth(t, messages, window, min(cfg.warmup, max(1, messages // 10)))
    return bandwidth_stats(nbytes, messages, window, elapsed).to_json()


# --------------------------------------------------------------------- several client processes


def _client_proc(key: str, address: str, cfg: RunConfig, nbytes: int, iters: int, barrier: Any, queue: Any) -> None:
    """One client process of the multi-client mode: connect, prepare, wait for all, time, report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops these processes
    try:
        with make_transport(key, address, cfg) as t:
            t.prepare(nbytes)
            for _ in range(cfg.warmup):
                t.roundtrip()
            barrier.wait(60)
            t0 = time.perf_counter()
            samples = measure_latency(t, iters, 0)
            t1 = time.perf_counter()
            t.end_size()
        queue.put({"ok": True, "t0": t0, "t1": t1, "samples": samples.tolist()})
    except Exception as exc:  # reported to the parent, which records the failure
        try:
            barrier.abort()
        finally:
            queue.put({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def first_cause(errors: list[str]) -> str:
    """The error that says why a client sweep failed: the first client to fail breaks the barrier the others wait
    at, and their ``BrokenBarrierError`` may reach the parent first."""
    return min(errors, key=lambda e: e.startswith("BrokenBarrierError"))


def run_clients(key: str, address: str, cfg: RunConfig, n_clients: int, nbytes: int) -> dict[str, Any]:
    """``n_clients`` spawn processes run the latency loop at ``nbytes`` at once against one server.

    Returns a JSON-ready dict: aggregate ``calls_per_s``, ``per_client_p99_us``,
    ``p50_us`` / ``p99_us`` over all samples, or ``error`` when a client failed.
    """
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n_clients)
    queue = ctx.Queue()
    iters = iters_for_size(nbytes, cfg.iters, cfg.bytes_budget, cfg.min_iters)
    procs = [ctx.Process(target=_client_proc, args=(key, address, cfg, nbytes, iters, barrier, queue), daemon=True)
             for _ in range(n_clients)]
    with ctrl_c_left_to_us():
        for p in procs:
            p.start()
    reports = []
    try:
        for _ in procs:
            reports.append(queue.get(timeout=300))
    except BaseException:  # Ctrl-C, or a client that never reported: the others are not waited for
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        queue.close()
        queue.join_thread()
    point: dict[str, Any] = {"transport": key, "clients": n_clients, "nbytes": nbytes, "iters_per_client": iters}
    errors = [r["error"] for r in reports if not r["ok"]]
    if errors:
        point["error"] = first_cause(errors)
        return point
    span = max(r["t1"] for r in reports) - min(r["t0"] for r in reports)
    all_samples = np.concatenate([np.asarray(r["samples"]) for r in reports])
    per_client = [latency_stats(r["samples"]) for r in reports]
    overall = latency_stats(all_samples)
    point.update(calls_per_s=all_samples.size / span, span_s=span, p50_us=overall.p50_us, p99_us=overall.p99_us,
                 per_client_p99_us=[s.p99_us for s in per_client], per_client_p50_us=[s.p50_us for s in per_client])
    return point
