"""Worker configuration: one frozen dataclass, filled by the CLI or by tests."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from shmrpc.schema.lane import LINGER_NS
from shmrpc.schema.layout import DEFAULT_GEOMETRY, Geometry, SizeClass
from shmrpc.schema.naming import validate_name

from ._http import parse_addr

__all__ = ["WorkerConfig", "DEFAULT_LEASE", "DEFAULT_LEASE_MAX", "parse_lease", "parse_cpus", "pin_process"]

#: Slots of each size class leased to a client at HELLO when it asks for nothing (smallest class
#: first); the rest are borrowed on demand with ACQUIRE. With DEFAULT_GEOMETRY: 4 x 64K and 2 x 1M,
#: a private region of 2.3 MiB, so that connecting is cheap and a flood of HELLOs pins little.
DEFAULT_LEASE = (4, 2, 0, 0, 0)
#: The most slots of each class a client may ask for in its HELLO: 4 x 64K, 2 x 1M, 1 x 16M, 1 x 80M.
DEFAULT_LEASE_MAX = (4, 2, 1, 1, 0)


def parse_lease(text: str, flag: str = "--lease") -> tuple[int, ...]:
    """``"4,2,1,1,0"`` -> per-class lease counts (a usage error names ``flag``)."""
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated counts, one per size class, got {text!r}") from None
    if any(c < 0 for c in counts):
        raise ValueError(f"{flag} counts must be >= 0")
    return counts


_CPU_MAX = 1 << 16  # CPU numbers at or above this are refused before a set of them is built


def parse_cpus(text: str, flag: str = "--cpus") -> frozenset[int]:
    """``"2"``, ``"2,10"``, ``"0-3,8"`` -> a set of CPU numbers below 65536 (a usage error names ``flag``)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first or last >= _CPU_MAX:
                raise ValueError
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ValueError(f"{flag} must be CPU numbers (0..{_CPU_MAX - 1}) and ranges like 2,10 or 0-3, got {text!r}") from None
    return frozenset(cpus)


def pin_process(cpus: Iterable[int]) -> None:
    """Run this process, every thread it has and every thread or child it starts later, on ``cpus`` only.

    Raises:
        OSError: none of ``cpus`` is a CPU this process may use.
    """
    cpus = frozenset(cpus)
    os.sched_setaffinity(0, cpus)
    for tid in os.listdir("/proc/self/task"):  # threads started before (a BLAS pool at import) are moved too
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # it ended meanwhile
            pass


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to start.

    Attributes:
        name: the worker's name; clients find it by this alone.
        geometry: slot size classes of the region.
        lease: slots of each class leased to a client at HELLO that asks for none (shorter tuples are
            padded with 0).
        lease_max: the most slots of each class a client may ask for in its HELLO (each class at
            least ``lease``); its private region is sized to what it asked for.
        backend: ``auto`` (CuPy when it imports and sees a GPU, else NumPy), ``numpy`` or ``cupy``.
        metrics_port: Prometheus HTTP port (``/metrics`` and ``/healthz``); ``None`` for no HTTP server
            (unless ``metrics_addr`` is a Unix socket), 0 for any free port.
        metrics_addr: where the metrics endpoint listens: a host address (``127.0.0.1`` by default)
            or ``unix:PATH`` (a socket of mode 0600).
        metrics_token: when set, ``/metrics`` requires ``Authorization: Bearer <token>``.
        otel: record an OpenTelemetry span for each request whose client traces it (``--otel``).
        mlock: lock the region's pages in RAM (the startup check tells how to allow it).
        inline_max_nbytes: requests touching at most this many bytes of tensors (inputs,
            intermediates and outputs, from the plan) may run on the event loop thread (cheaper than
            a thread hop); larger ones run in the executor.
        threads: executor threads for larger requests.
        resident_limit_bytes: cap on resident tensors held by the backend.
        allow_uids: uids besides the worker's own that may connect (the runtime directory becomes 0711 and
            the sockets 0666; the kernel's credentials on the attach socket decide who is admitted).
        dumpable: leave the worker dumpable (core dumps, debuggers and profilers of the same uid can attach);
            by default it makes itself non-dumpable, which shuts /proc/<pid>/fd and /proc/<pid>/mem, and so
            every client's region, to other non-root processes.
        heartbeat_s: how often the loop checks on clients it has no pidfd for.
        isolation: ``"client"`` (default): each client's leased slots live in a region of its own,
            a memfd with no name, handed to that client alone; ``"shared"``: leased slots come from the worker's pool region like borrowed ones.
        client_max_slots: most slots one client may borrow beyond its lease at once (0: no limit).
        client_max_bytes: most bytes of borrowed slots one client may hold at once (0: no limit).
        register_host: pin the region for the GPU (cudaHostRegister) on the CuPy backend; off only
            to measure what pinning buys.
        max_clients: most clients connected at once (0: no limit); a HELLO over it is refused.
        max_clients_per_uid: most clients of one uid connected at once (0: no limit).
        request_memory_limit_bytes: most bytes of intermediates and outputs one request's plan may
            need (0: no limit); a larger request is refused before it runs with a ResourceError.
        inline_max_flops: requests estimated at most this many floating-point operations (and at
            most ``inline_max_nbytes`` of tensors touched) run on the loop thread; all others in
            the executor, so the loop thread never computes for long.
        client_max_waiters: most ACQUIREs one client may have waiting for a slot at once.
        op_budget_s: a request whose run takes longer is counted in ``shmrpc_over_budget_total{op}``
            (an op's own ``budget_s`` wins); 0: no budget. Nothing is stopped.
        spin_us: after each wake-up, poll this long without sleeping before blocking again (0: never
            spin). Saves a scheduler wake-up per request that arrives within the window, at the cost of
            a busy core while it spins.
        lane_linger_us: after answering a lane whose client came back soon after its answer before, read the lanes
            this long before sleeping, so a client that comes back at once finds the worker awake (schema/lane.py,
            Linger); 0: never. Off on a host with one CPU.
        lanes: grant a lane (``shmrpc.schema.lane``: a shared page and eventfds beside ZeroMQ) to a
            client whose HELLO asks for one.
        max_batch: most requests of one plan that the loop serves with one batched run when they arrive
            in the same turn of the loop (dynamic batching: see ``server/_batch.py``); 1 turns batching off.
        batch_wait_us: after a batched run of N >= 2 requests, parked requests fewer than N wait up to this
            long, the loop spinning, for the others to arrive (answered clients sending again), before they
            run; 0 (default): never wait. Only soon after a batched run (2 ms, or 20 times the setting if
            longer), so a lone client never waits.
        io_threads: libzmq I/O threads of the worker's context. Each client's connection is served by one of them
            (libzmq gives a new connection to the least loaded); with one, a single thread moves every client's
            messages between the sockets and the loop, one after another.
    """

    name: str
    geometry: Geometry = DEFAULT_GEOMETRY
    lease: tuple[int, ...] = DEFAULT_LEASE
    lease_max: tuple[int, ...] = DEFAULT_LEASE_MAX
    backend: str = "auto"
    metrics_port: int | None = None
    mlock: bool = True
    inline_max_nbytes: int = 256 * 1024
    threads: int = 4
    resident_limit_bytes: int = 8 << 30
    allow_uids: tuple[int, ...] = ()
    dumpable: bool = False
    heartbeat_s: float = 0.5
    register_host: bool = True
    isolation: str = "client"
    client_max_slots: int = 0
    client_max_bytes: int = 0
    spin_us: int = 0
    lane_linger_us: int = LINGER_NS // 1000
    lanes: bool = True
    max_clients: int = 64
    max_clients_per_uid: int = 16
    request_memory_limit_bytes: int = 2 << 30
    inline_max_flops: int = 8_000_000
    client_max_waiters: int = 4
    op_budget_s: float = 1.0
    metrics_addr: str = "127.0.0.1"
    #: Tests only: the first request fails as a device error would ("cuda_error", or "fatal": a sticky one).
    #: ``shmrpc serve`` fills it once, at start, from ``SHMRPC_INJECT_FAULT``; nothing reads that variable later.
    inject_fault: str | None = None
    metrics_token: str | None = None
    otel: bool = False
    max_batch: int = 64
    batch_wait_us: int = 0
    io_threads: int = 1

    def __post_init__(self) -> None:
        validate_name(self.name)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        parse_addr(self.metrics_addr)
        if self.metrics_port is None and not self.metrics_addr.startswith("unix:"):  # no metrics server: said so
            if self.metrics_addr != "127.0.0.1":
                raise ValueError(f"--metrics-addr {self.metrics_addr} needs --metrics-port (unix:PATH needs none)")
            if self.metrics_token is not None:
                raise ValueError("--metrics-token-file needs --metrics-port or --metrics-addr unix:PATH")
        if self.backend not in ("auto", "numpy", "cupy"):
            raise ValueError(f"--backend must be auto, numpy or cupy, got {self.backend!r}")
        n = len(self.geometry.classes)
        if len(self.lease) > n:
            raise ValueError(f"--lease names {len(self.lease)} classes but --slots has {n}")
        lease = tuple(self.lease) + (0,) * (n - len(self.lease))
        object.__setattr__(self, "lease", lease)
        most = (tuple(self.lease_max) + (0,) * n)[:n]  # the default is cut to the geometry's classes
        object.__setattr__(self, "lease_max", tuple(max(a, b) for a, b in zip(lease, most)))
        for flag, v in (("--max-clients", self.max_clients), ("--max-clients-per-uid", self.max_clients_per_uid),
                        ("--request-memory-limit", self.request_memory_limit_bytes),
                        ("--inline-max-flops", self.inline_max_flops)):
            if v < 0:
                raise ValueError(f"{flag} must be >= 0, got {v}")
        if not self.op_budget_s >= 0:
            raise ValueError(f"--op-budget must be >= 0 seconds, got {self.op_budget_s}")
        if self.client_max_waiters < 0:
            raise ValueError(f"--client-max-waiters must be >= 0, got {self.client_max_waiters}")
        if self.isolation not in ("client", "shared"):
            raise ValueError(f"--isolation must be client or shared, got {self.isolation!r}")
        if self.client_max_slots < 0 or self.client_max_bytes < 0:
            raise ValueError("--client-max-slots and --client-max-bytes must be >= 0 (0: no limit)")
        if self.threads < 1:
            raise ValueError("--threads must be >= 1")
        if not 0 <= self.spin_us <= 1_000_000:
            raise ValueError(f"--spin-us must be 0..1000000, got {self.spin_us}")
        if not 0 <= self.lane_linger_us <= 10_000:
            raise ValueError(f"--lane-linger-us must be 0..10000, got {self.lane_linger_us}")
        if not 0 <= self.batch_wait_us <= 10_000:
            raise ValueError(f"--batch-wait-us must be 0..10000, got {self.batch_wait_us}")
        if not 1 <= self.io_threads <= 64:
            raise ValueError(f"--io-threads must be 1..64, got {self.io_threads}")
        if not 1 <= self.max_batch <= 4096:
            raise ValueError(f"--max-batch must be 1..4096 (1: no batching), got {self.max_batch}")

    def first_client_nbytes(self) -> int:
        """Bytes of the region a client asking for the default ``--lease`` gets of its own (``--isolation client``;
        0 without one): its HELLO creates and locks it, so the start checks count one beside the pool."""
        private = self.private_geometry() if self.isolation == "client" else None
        return 0 if private is None else private.region_nbytes

    def private_geometry(self, lease: tuple[int, ...] | None = None) -> Geometry | None:
        """The geometry of a client's own region: ``lease[c]`` slots of each class (default: ``self.lease``;
        None if the lease is empty)."""
        counts = self.lease if lease is None else lease
        classes = tuple(SizeClass(c.slot_nbytes, n) for c, n in zip(self.geometry.classes, counts) if n > 0)
        return Geometry(classes, self.geometry.desc_nbytes) if classes else None
