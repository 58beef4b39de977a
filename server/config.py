"""Worker configuration: one frozen dataclass, filled by the CLI or by tests."""

from __future__ import annotations

from dataclasses import dataclass

from shmrpc.schema.layout import DEFAULT_GEOMETRY, Geometry, SizeClass
from shmrpc.schema.naming import validate_name

from ._http import parse_addr

__all__ = ["WorkerConfig", "DEFAULT_LEASE", "parse_lease"]

#: Slots of each size class leased to every client at HELLO (smallest class first); the rest are
#: borrowed on demand with ACQUIRE. With DEFAULT_GEOMETRY: 4 x 64K, 2 x 1M, 1 x 16M, 1 x 80M, 0 x 520M.
DEFAULT_LEASE = (4, 2, 1, 1, 0)


def parse_lease(text: str) -> tuple[int, ...]:
    """``"4,2,1,1,0"`` -> per-class lease counts."""
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--lease must be comma-separated counts, one per size class, got {text!r}") from None
    if any(c < 0 for c in counts):
        raise ValueError("--lease counts must be >= 0")
    return counts


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker needs to start.

    Attributes:
        name: the worker's name; clients find it by this alone.
        geometry: slot size classes of the region.
        lease: slots of each class leased to a client at HELLO (shorter tuples are padded with 0).
        backend: ``auto`` (CuPy when it imports and sees a GPU, else NumPy), ``numpy`` or ``cupy``.
        metrics_port: Prometheus HTTP port (``/metrics`` and ``/healthz``); ``None`` for no HTTP server
            (unless ``metrics_addr`` is a Unix socket), 0 for any free port.
        metrics_addr: where the metrics endpoint listens: a host address (``127.0.0.1`` by default)
            or ``unix:PATH`` (a socket of mode 0600).
        metrics_token: when set, ``/metrics`` requires ``Authorization: Bearer <token>``.
        otel: record an OpenTelemetry span for each request whose client traces it (``--otel``).
        mlock: lock the region's pages in RAM (the startup check tells how to allow it).
        inline_max_nbytes: requests moving at most this many bytes run on the event loop thread
            (cheaper than a thread hop); larger ones run in the executor.
        threads: executor threads for larger requests.
        resident_limit_bytes: cap on resident tensors held by the backend.
        allow_uids: uids besides the worker's own that may connect.
        heartbeat_s: how often the loop checks on clients it has no pidfd for.
        isolation: ``"client"`` (default): each client's leased slots live in a region of its own,
            whose name is unlinked as soon as the client has mapped it, so no other process can open
            it; ``"shared"``: leased slots come from the worker's pool region like borrowed ones.
        client_max_slots: most slots one client may borrow beyond its lease at once (0: no limit).
        client_max_bytes: most bytes of borrowed slots one client may hold at once (0: no limit).
        register_host: pin the region for the GPU (cudaHostRegister) on the CuPy backend; off only
            to measure what pinning buys.
        spin_us: after each wake-up, poll this long without sleeping before blocking again (0: never
            spin). Saves a scheduler wake-up per request that arrives within the window, at the cost of
            a busy core while it spins.
    """

    name: str
    geometry: Geometry = DEFAULT_GEOMETRY
    lease: tuple[int, ...] = DEFAULT_LEASE
    backend: str = "auto"
    metrics_port: int | None = None
    mlock: bool = True
    inline_max_nbytes: int = 256 * 1024
    threads: int = 4
    resident_limit_bytes: int = 8 << 30
    allow_uids: tuple[int, ...] = ()
    heartbeat_s: float = 0.5
    register_host: bool = True
    isolation: str = "client"
    client_max_slots: int = 0
    client_max_bytes: int = 0
    spin_us: int = 0
    metrics_addr: str = "127.0.0.1"
    metrics_token: str | None = None
    otel: bool = False

    def __post_init__(self) -> None:
        validate_name(self.name)
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be 0..65535, got {self.metrics_port}")
        parse_addr(self.metrics_addr)
        if self.backend not in ("auto", "numpy", "cupy"):
            raise ValueError(f"--backend must be auto, numpy or cupy, got {self.backend!r}")
        n = len(self.geometry.classes)
        if len(self.lease) > n:
            raise ValueError(f"--lease names {len(self.lease)} classes but --slots has {n}")
        lease = tuple(self.lease) + (0,) * (n - len(self.lease))
        object.__setattr__(self, "lease", lease)
        if self.isolation not in ("client", "shared"):
            raise ValueError(f"--isolation must be client or shared, got {self.isolation!r}")
        if self.client_max_slots < 0 or self.client_max_bytes < 0:
            raise ValueError("--client-max-slots and --client-max-bytes must be >= 0 (0: no limit)")
        if self.threads < 1:
            raise ValueError("--threads must be >= 1")
        if not 0 <= self.spin_us <= 1_000_000:
            raise ValueError(f"--spin-us must be 0..1000000, got {self.spin_us}")

    def private_geometry(self) -> Geometry | None:
        """The geometry of a client's own region: ``lease[c]`` slots of each class (None if the lease is empty)."""
        classes = tuple(SizeClass(c.slot_nbytes, n) for c, n in zip(self.geometry.classes, self.lease) if n > 0)
        return Geometry(classes, self.geometry.desc_nbytes) if classes else None
