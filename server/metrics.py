"""Prometheus metrics of one worker, in a registry of its own.

=====================================  =========  ==========================================
metric                                 type       labels
=====================================  =========  ==========================================
shmrpc_requests_total                  counter    op, status (``ok``, an error class name, or
                                                  ``guess_too_small``)
shmrpc_request_duration_seconds        histogram  op (CALL received -> DONE sent: the total)
shmrpc_stage_seconds                   histogram  op, stage (queue, h2d, kernel, d2h; where the backend
                                                  knows it)
shmrpc_bytes_in_total                  counter    (tensor bytes read from slots)
shmrpc_bytes_out_total                 counter    (tensor bytes written to slots)
shmrpc_clients_refused_total           counter    reason (a handshake the worker refused: ``max_clients``,
                                                  ``max_clients_per_uid``, ``fds``, ``identity``, ``region``, ``lane``,
                                                  ``stopping``, ``protocol``, ``bad_message``)
shmrpc_slots_leased                    gauge      (every slot clients hold, their own regions' included)
shmrpc_pool_slots_held                 gauge      (slots of the pool region not free: clients hold them, leased or
                                                  borrowed, or a gone client's request still runs there; against
                                                  ``shmrpc_slots_total``, how full the pool is)
shmrpc_ready                           gauge      (1 while the worker serves, 0 while it stops, after a fatal
                                                  backend error, or with its loop stuck: what ``/healthz`` says)
shmrpc_clients_connected               gauge
shmrpc_requests_in_flight              gauge
shmrpc_batch_size                      histogram  op (requests served by one batched run; a request
                                                  served alone is not a batch and not counted here)
shmrpc_gpu_memory_bytes                gauge      (device memory the backend holds)
shmrpc_resident_bytes                  gauge      (named resident tensors)
shmrpc_resident_limit_bytes            gauge      (``--resident-limit``)
shmrpc_slots_total                     gauge      (slots in the pool region)
shmrpc_build_info                      gauge      version, backend, device (always 1)
process_*, python_info                            the standard process metrics (CPU, memory, fds)
=====================================  =========  ==========================================

``op`` is the request's op: the first step's name for one-step requests, ``pipeline`` for
chains of several steps, ``put`` for :meth:`Client.put` uploads, and ``unknown`` for a request
whose op the worker could not tell (an unknown name, a descriptor that did not parse, or a call refused before
its slot was read: BusyError while draining, StaleSlotError ...), so the label's values are bounded by the op table. ``status`` is ``ok`` or the error class name, or
``guess_too_small`` (:data:`GUESS_TOO_SMALL`): a request whose room for outputs was the client's guess
(the header's GUESS flag: ``Client.call``'s first call of a signature) and too small for them, refused
before anything ran and sent again by the client once it knows their sizes; not a failure (no log line).

Each :class:`Metrics` owns a ``CollectorRegistry`` (several workers can live in one
test process); :meth:`Metrics.serve` exposes it over HTTP on ``/metrics``, with ``/healthz``
beside it (see :mod:`shmrpc.server._http`).
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Gauge, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from ._http import HealthFn, MetricsServer

__all__ = ["Metrics", "DURATION_BUCKETS_S", "BATCH_BUCKETS", "STAGES", "GUESS_TOO_SMALL", "REFUSAL_REASONS"]

#: 10 µs to 10 s, about three buckets per decade.
DURATION_BUCKETS_S: tuple[float, ...] = (
    1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
)

#: The stage names the worker reports in :meth:`Metrics.observe`.
STAGES = ("queue", "h2d", "kernel", "d2h")

_GAUGES = {
    "slots_leased": ("shmrpc_slots_leased", "Slots currently leased to clients (their own regions' included)."),
    "pool_slots_held": ("shmrpc_pool_slots_held", "Slots of the pool region not free: held by clients (leased or "
                        "borrowed), or running a gone client's request."),
    "ready": ("shmrpc_ready", "1 while the worker serves requests (what /healthz says), else 0."),
    "clients": ("shmrpc_clients_connected", "Clients with a live lease."),
    "inflight": ("shmrpc_requests_in_flight", "Requests received and not yet answered."),
    "gpu_memory": ("shmrpc_gpu_memory_bytes", "Device memory held by the backend, in bytes."),
    "resident": ("shmrpc_resident_bytes", "Bytes of named resident tensors."),
    "resident_limit": ("shmrpc_resident_limit_bytes", "Cap on resident tensors (--resident-limit), in bytes."),
    "slots_total": ("shmrpc_slots_total", "Slots in the worker's pool region."),
}

#: The ``reason`` label values of ``shmrpc_clients_refused_total`` (each exported from the start, at 0).
REFUSAL_REASONS = ("max_clients", "max_clients_per_uid", "fds", "identity", "region", "lane", "stopping", "protocol",
                   "bad_message")


class _Refusals:
    """``shmrpc_clients_refused_total{reason}``: counts the loop thread adds to, read by a scrape."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(REFUSAL_REASONS, 0)

    def collect(self) -> Iterator[Metric]:
        fam = CounterMetricFamily("shmrpc_clients_refused", "Handshakes (HELLOs) the worker refused, by reason.",
                                  labels=["reason"])
        for reason, n in list(self.counts.items()):
            fam.add_metric([reason], n)
        yield fam


#: the status label of a refused guess (see the module's docstring): the client sends the request again
GUESS_TOO_SMALL = "guess_too_small"

#: Batch sizes (requests served by one batched run), powers of two up to the largest ``--max-batch``.
BATCH_BUCKETS: tuple[float, ...] = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

_STAGE_SET = frozenset(STAGES)

#: Observations queued without a fold (the loop folds every turn) that make the next observation fold them.
_FOLD_AT = 4096
#: A fold of this many observations or more counts the histograms' buckets with NumPy (:meth:`_RequestStats._fold_many`).
_MANY = 32
#: Observations the spinning loop folds at a time while no request waits (:meth:`Metrics.fold_few`): about 1 µs each.
TRICKLE = 2


class _Hist:
    """A histogram as plain numbers: a count per bucket (the last one is +Inf) and the sum."""

    __slots__ = ("counts", "sum", "bounds")

    def __init__(self, bounds: tuple[float, ...] = DURATION_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket le=b holds values <= b
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        counts, total = list(self.counts), 0
        out: list[tuple[str, float]] = []
        for bound, n in zip((*self.bounds, float("inf")), counts):
            total += n
            out.append((floatToGoString(bound), total))
        return out


_BOUNDS_ARRAYS: dict[tuple[float, ...], np.ndarray] = {}


def _add_many(h: _Hist, values: Sequence[float] | np.ndarray) -> None:
    """Count ``values`` into ``h`` (bucket le=b holds values <= b, as :meth:`_Hist.observe`), and add their sum."""
    bounds = _BOUNDS_ARRAYS.get(h.bounds)
    if bounds is None:
        bounds = _BOUNDS_ARRAYS[h.bounds] = np.asarray(h.bounds, dtype=np.float64)
    arr = np.asarray(values, dtype=np.float64)
    counts = h.counts
    for i, n in enumerate(np.bincount(np.searchsorted(bounds, arr, side="left"), minlength=len(counts)).tolist()):
        if n:
            counts[i] += n
    h.sum += float(arr.sum())


class _OpStats:
    """One op label's numbers: answers by status, the duration histogram, stage histograms, over-budget runs."""

    __slots__ = ("status", "duration", "stage", "over", "budget_s")

    def __init__(self, budget_s: float) -> None:
        self.status: dict[str, int] = {}
        self.duration = _Hist()
        self.stage: dict[str, _Hist] = {}
        self.over = 0
        self.budget_s = budget_s


class _Level:
    """A gauge kept as a plain number by the loop thread (``inc``/``dec``/``set``), exported when scraped."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, n: float = 1) -> None:
        self.value += n

    def dec(self, n: float = 1) -> None:
        self.value -= n

    def set(self, v: float) -> None:
        self.value = v


class _RequestStats:
    """Per-request counters and histograms, kept as plain numbers and turned into metric families
    when scraped.

    Only the worker's loop thread records (it answers every request), and an observation is one
    ``deque.append`` of its numbers (:attr:`queued`): prometheus_client's own Counter, Gauge and
    Histogram lock on every call, and even plain counters and histograms updated per request cost
    more per tiny request than the rest of the bookkeeping. :meth:`fold` adds the queued
    observations into the counters and histograms, under :attr:`lock`: a scrape (or a snapshot)
    folds first, so it sees every request answered before it, and the worker's loop folds at the end
    of each turn, after its answers went out (``Metrics.fold``), so the work is off the answers' way, and
    a few at a time while it spins with no request waiting (``Metrics.fold_few``); an observer that
    queues :data:`_FOLD_AT` without a fold folds then. A fold of :data:`_MANY` or more counts the buckets
    with NumPy (:meth:`_fold_many`), for a fraction of the per-observation cost. Each op label has one
    :class:`_OpStats`.
    """

    def __init__(self) -> None:
        self.queued: deque[tuple[str, str, float, int, int, dict[str, float] | None]] = deque()
        self.lock = threading.Lock()  # held while folding: by the loop thread or by a scrape
        self.ops: dict[str, _OpStats] = {}
        self.batches: dict[str, _Hist] = {}  # op label -> sizes of the batched runs
        self.inflight = _Level()
        self.bytes_in = 0
        self.bytes_out = 0
        self.budgets: dict[str, float] = {}  # op label -> seconds; others get default_budget_s (0: no budget)
        self.default_budget_s = 0.0

    def op(self, op: str) -> _OpStats:
        o = self.ops.get(op)
        if o is None:
            o = self.ops[op] = _OpStats(self.budgets.get(op, self.default_budget_s))
        return o

    def fold(self, limit: int = 0) -> None:
        """Add the queued observations into the counters and histograms (any thread): every one, or the first
        ``limit`` (> 0)."""
        q = self.queued
        # NOTE: this runs once per request answered: the histograms' buckets are counted here, not through
        # _Hist.observe, and an op label's numbers are looked up again only when the label changes (a turn's
        # requests are mostly of one op)
        with self.lock:
            n = len(q) if limit <= 0 else min(limit, len(q))
            if n >= _MANY:
                # NOTE: popped one by one: the loop thread may append meanwhile (a scrape folds on its own thread)
                self._fold_many([q.popleft() for _ in range(n)])
                return
            last: str | None = None
            b_in = b_out = 0
            for _ in range(n):
                op, status, seconds, nbytes_in, nbytes_out, stages = q.popleft()
                if op is not last:
                    last, o = op, self.ops.get(op) or self.op(op)
                    counts, dur, per_stage, budget_s = o.status, o.duration, o.stage, o.budget_s
                    dur_counts, bounds = dur.counts, dur.bounds
                counts[status] = counts.get(status, 0) + 1
                dur_counts[bisect_left(bounds, seconds)] += 1  # bucket le=b holds values <= b
                dur.sum += seconds
                b_in += nbytes_in
                b_out += nbytes_out
                if stages:
                    if budget_s and stages.get("total", seconds) > budget_s:
                        o.over += 1
                    for stage, stage_s in stages.items():
                        if stage_s > 0 and stage in _STAGE_SET:
                            h = per_stage.get(stage)
                            if h is None:
                                h = per_stage[stage] = _Hist()
                            h.counts[bisect_left(h.bounds, stage_s)] += 1
                            h.sum += stage_s
                elif budget_s and seconds > budget_s:
                    o.over += 1
            self.bytes_in += b_in
            self.bytes_out += b_out

    def _fold_many(self, items: list[tuple[str, str, float, int, int, dict[str, float] | None]]) -> None:
        """:meth:`fold` of many observations at once (the caller holds :attr:`lock`): the histograms' buckets counted
        by NumPy (``searchsorted`` on the left, as ``bisect_left``; ``bincount``), statuses and bytes summed, per op
        label; the same counts as one observation after another."""
        ops, statuses, secs, b_in, b_out, stages = zip(*items)
        self.bytes_in += sum(b_in)
        self.bytes_out += sum(b_out)
        first = ops[0]
        if ops.count(first) == len(ops):  # the usual fold: one op label
            self._fold_op(first, statuses, secs, stages)
            return
        by_op: dict[str, list[int]] = {}
        for i, op in enumerate(ops):
            by_op.setdefault(op, []).append(i)
        for op, idx in by_op.items():
            self._fold_op(op, [statuses[i] for i in idx], [secs[i] for i in idx], [stages[i] for i in idx])

    def _fold_op(self, op: str, statuses: Sequence[str], secs: Sequence[float],
                 stages: Sequence[dict[str, float] | None]) -> None:
        o = self.ops.get(op) or self.op(op)
        counts = o.status
        s0 = statuses[0]
        if statuses.count(s0) == len(statuses):
            counts[s0] = counts.get(s0, 0) + len(statuses)
        else:
            for status, n in Counter(statuses).items():
                counts[status] = counts.get(status, 0) + n
        _add_many(o.duration, secs)
        budget_s = o.budget_s
        if budget_s:  # the run's own total when it has one, else the request's seconds
            o.over += sum(1 for sec, st in zip(secs, stages) if (st.get("total", sec) if st else sec) > budget_s)
        for stage in STAGES:
            values = [v for st in stages if st and (v := st.get(stage, 0.0)) > 0]
            if values:
                h = o.stage.get(stage)
                if h is None:
                    h = o.stage[stage] = _Hist()
                _add_many(h, values)

    def collect(self) -> Iterator[Metric]:
        self.fold()
        ops = list(self.ops.items())
        req = CounterMetricFamily("shmrpc_requests", "Requests answered, by op and status.", labels=["op", "status"])
        for op, o in ops:
            for status, n in list(o.status.items()):
                req.add_metric([op, status], n)
        yield req
        dur = HistogramMetricFamily("shmrpc_request_duration_seconds", "Time from CALL received to DONE sent.",
                                    labels=["op"])
        for op, o in ops:
            dur.add_metric([op], o.duration.cumulative(), o.duration.sum)
        yield dur
        stage = HistogramMetricFamily("shmrpc_stage_seconds", "Time spent per stage of a request.",
                                      labels=["op", "stage"])
        for op, o in ops:
            for name, h in list(o.stage.items()):
                stage.add_metric([op, name], h.cumulative(), h.sum)
        yield stage
        over = CounterMetricFamily("shmrpc_over_budget", "Requests whose run took longer than their op's time budget "
                                   "(the op's budget_s, else --op-budget), by op.", labels=["op"])
        for op, o in ops:
            if o.over:
                over.add_metric([op], o.over)
        yield over
        batch = HistogramMetricFamily("shmrpc_batch_size", "Requests served by one batched run (dynamic batching; "
                                      "a request served alone is not counted), by op.", labels=["op"])
        for op, h in list(self.batches.items()):
            batch.add_metric([op], h.cumulative(), h.sum)
        yield batch
        yield CounterMetricFamily("shmrpc_bytes_in", "Tensor bytes read from slots.", value=self.bytes_in)
        yield CounterMetricFamily("shmrpc_bytes_out", "Tensor bytes written to slots.", value=self.bytes_out)
        yield GaugeMetricFamily(*_GAUGES["inflight"], value=self.inflight.value)


class Metrics:
    """The worker's counters, histograms and gauges.

    Args:
        registry: where to register; a fresh ``CollectorRegistry`` by default.

    Example:
        >>> m = Metrics()
        >>> m.observe("matmul", "ok", 0.002, 1 << 20, 1 << 20, {"kernel": 0.001})
        >>> m.snapshot()["requests"]
        {'matmul': {'ok': 1}}
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self._stats = _RequestStats()
        self._queued = self._stats.queued
        r.register(self._stats)  # type: ignore[arg-type]
        self._refusals = _Refusals()
        r.register(self._refusals)  # type: ignore[arg-type]
        self.slots_leased = Gauge(*_GAUGES["slots_leased"], registry=r)
        self.pool_slots_held = Gauge(*_GAUGES["pool_slots_held"], registry=r)
        self.ready = Gauge(*_GAUGES["ready"], registry=r)
        self.clients = Gauge(*_GAUGES["clients"], registry=r)
        self.inflight = self._stats.inflight  # plain number: inc/dec per request on the loop thread
        self.gpu_memory = Gauge(*_GAUGES["gpu_memory"], registry=r)
        self.resident = Gauge(*_GAUGES["resident"], registry=r)
        self.resident_limit = Gauge(*_GAUGES["resident_limit"], registry=r)
        self.slots_total = Gauge(*_GAUGES["slots_total"], registry=r)
        self._build = Gauge("shmrpc_build_info", "Version, backend and device of this worker (always 1).",
                            ["version", "backend", "device"], registry=r)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.port: int | None = None
        self.url: str | None = None
        self._server: MetricsServer | None = None

    def set_build_info(self, version: str, backend: str, device: str) -> None:
        """Set ``shmrpc_build_info{version, backend, device} 1`` (once the backend is known)."""
        self._build.clear()
        self._build.labels(version, backend, device).set(1)

    def set_budgets(self, default_s: float, per_op: dict[str, float]) -> None:
        """Time budgets of a request's run by op label (``default_s`` for the others; 0: none)."""
        st = self._stats
        st.fold()  # the requests answered so far are judged by the budgets they ran under
        with st.lock:  # a scrape's fold may add an op label meanwhile
            st.default_budget_s = default_s
            st.budgets = dict(per_op)
            for op, o in st.ops.items():
                o.budget_s = st.budgets.get(op, default_s)

    def observe(self, op: str, status: str, seconds: float, nbytes_in: int, nbytes_out: int,
                stages: dict[str, float] | None = None) -> None:
        """Record one answered request (from the worker's loop thread only: see :class:`_RequestStats`).

        Args:
            op: op name (or pipeline name).
            status: ``"ok"`` or the error class name.
            seconds: CALL received to DONE sent.
            nbytes_in: tensor bytes read from the slot.
            nbytes_out: tensor bytes written to the slot.
            stages: seconds per stage (see :data:`STAGES`).
        """
        q = self._queued
        q.append((op, status, seconds, nbytes_in, nbytes_out, stages))
        if len(q) >= _FOLD_AT:
            self._stats.fold()

    def fold(self) -> None:
        """Add the observations queued by :meth:`observe` into the metrics (the loop calls it after a turn's
        answers; a scrape and :meth:`snapshot` fold too)."""
        if self._queued:
            self._stats.fold()

    def fold_few(self, n: int = TRICKLE) -> None:
        """Fold the first ``n`` observations queued, if any: the loop's fold while it spins with no request waiting,
        a few at a time, so that a request rung meanwhile waits for at most those few."""
        if self._queued:
            self._stats.fold(n)

    def client_refused(self, reason: str) -> None:
        """Count one refused handshake (loop thread); ``reason``: one of :data:`REFUSAL_REASONS`."""
        counts = self._refusals.counts
        counts[reason] = counts.get(reason, 0) + 1

    def observe_batch(self, op: str, size: int) -> None:
        """Record one batched run of ``size`` requests of op label ``op`` (loop thread only)."""
        h = self._stats.batches.get(op)
        if h is None:
            h = self._stats.batches[op] = _Hist(BATCH_BUCKETS)
        h.observe(size)

    def serve(self, port: int = 0, addr: str = "127.0.0.1", token: str | None = None,
              health: HealthFn | None = None) -> None:
        """Serve ``/metrics`` and ``/healthz`` over HTTP in a daemon thread; :attr:`url` and :attr:`port`
        tell where.

        Args:
            port: TCP port; 0 picks a free one.
            addr: address to bind (loopback by default: metrics are not for the network unless
                asked), or ``unix:PATH`` for a Unix socket of mode 0600.
            token: when set, ``/metrics`` requires ``Authorization: Bearer <token>``.
            health: ``() -> (ready, reason)`` for ``/healthz`` (always ready by default).

        Raises:
            RuntimeError: already serving.
            OSError: the port is taken or the address invalid.
        """
        if self._server is not None:
            raise RuntimeError(f"metrics already served on {self.url}; call shutdown() first")
        self._server = MetricsServer(self.registry, health or (lambda: (True, "")), addr, port, token)
        self.port, self.url = self._server.port, self._server.url

    def shutdown(self) -> None:
        """Stop the HTTP server and free its port; idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self.port = self.url = None

    def snapshot(self) -> dict[str, Any]:
        """The metrics as plain numbers, for ``shmrpc status``.

        Returns:
            ``{"requests": {op: {status: n}}, "duration": {op: {"count": n, "sum_s": s}}, "over_budget": {op: n},
            "bytes_in": n, "bytes_out": n, "slots_leased": n, "clients": n, "inflight": n,
            "gpu_memory": n, "resident": n}``
        """
        requests: dict[str, dict[str, int]] = {}
        duration: dict[str, dict[str, float]] = {}
        over: dict[str, int] = {}
        out: dict[str, Any] = {"requests": requests, "duration": duration, "over_budget": over}
        gauge_keys = {metric_name: key for key, (metric_name, _) in _GAUGES.items()}
        for family in self.registry.collect():
            for s in family.samples:
                if s.name == "shmrpc_requests_total":
                    requests.setdefault(s.labels["op"], {})[s.labels["status"]] = int(s.value)
                elif s.name == "shmrpc_request_duration_seconds_count":
                    duration.setdefault(s.labels["op"], {})["count"] = int(s.value)
                elif s.name == "shmrpc_request_duration_seconds_sum":
                    duration.setdefault(s.labels["op"], {})["sum_s"] = s.value
                elif s.name == "shmrpc_over_budget_total":
                    over[s.labels["op"]] = int(s.value)
                elif s.name == "shmrpc_bytes_in_total":
                    out["bytes_in"] = int(s.value)
                elif s.name == "shmrpc_bytes_out_total":
                    out["bytes_out"] = int(s.value)
                elif s.name in gauge_keys:
                    out[gauge_keys[s.name]] = s.value
        return out

    def __repr__(self) -> str:
        where = f"serving on {self.url}" if self.url is not None else "not served"
        return f"<Metrics {where}>"
