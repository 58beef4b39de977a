"""What a worker tells the outside about its requests, besides the answers: the metrics endpoint and
build info, a rate-limited log line per failed request, and OpenTelemetry spans of traced calls.

The loop owns an :class:`Observer` and calls it at three points of a request's life (begin, failure,
done); each call costs nothing beyond a dictionary check unless the request failed or is traced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from shmrpc import kernels
from shmrpc.schema.descriptor import decode_response
from shmrpc.schema.errors import RequestError
from shmrpc.schema.header import HEADER_NBYTES, unpack_from

from ._logs import RateLimited
from .checks import StartupError
from .cli import version
from .config import WorkerConfig
from .metrics import Metrics

__all__ = ["Observer"]

#: A traced request's span, pending: (trace context tail, seconds from CALL to DONE, DONE's time_ns).
Traced = tuple[bytes, float, int]


class Observer:
    """The worker's metrics endpoint, failed-request log lines and trace spans.

    Args:
        config: the worker's configuration (metrics address, port, token; ``otel``).
        metrics: the worker's :class:`Metrics`.
        log: where failed-request lines go (at INFO, rate-limited).
        tracer_provider: where spans go with ``otel`` (None: see ``server/_trace.py``).
    """

    def __init__(self, config: WorkerConfig, metrics: Metrics, log: logging.Logger, tracer_provider: Any = None) -> None:
        self.config, self.metrics, self.log = config, metrics, log
        self.failures = RateLimited(log, rate_per_s=5.0, burst=20)
        self.traces: dict[tuple[int, int], bytes] = {}  # (region, slot) -> the CALL's trace context
        self._tracer_provider = tracer_provider
        self._tracing: Any = None
        self._op_names = {spec.code: name for name, spec in kernels.REGISTRY.items()}

    def start(self, backend: Any, health: Callable[[], tuple[bool, str]]) -> None:
        """Build info and fixed gauges, the HTTP endpoint, tracing.

        Raises:
            StartupError: the metrics port or socket cannot be bound, or ``otel`` without OpenTelemetry.
        """
        cfg, mt = self.config, self.metrics
        device = getattr(backend, "device", None)
        mt.set_build_info(version(), backend.name, "cpu" if device is None else f"cuda:{device}")
        mt.slots_total.set(sum(c.n_slots for c in cfg.geometry.classes))
        mt.ready.set_function(lambda: 1.0 if health()[0] else 0.0)  # read at each scrape
        mt.resident_limit.set(cfg.resident_limit_bytes)
        mt.set_budgets(cfg.op_budget_s, {n: s.budget_s for n, s in kernels.REGISTRY.items() if s.budget_s})
        if cfg.metrics_port is not None or cfg.metrics_addr.startswith("unix:"):
            try:
                mt.serve(cfg.metrics_port or 0, cfg.metrics_addr, cfg.metrics_token, health)
            except OSError as e:
                if cfg.metrics_addr.startswith("unix:"):  # the reason names the path and the remedy
                    raise StartupError(f"cannot serve metrics on --metrics-addr {cfg.metrics_addr}: "
                                       f"{e.strerror or e}") from None
                raise StartupError(f"cannot serve metrics on {cfg.metrics_addr}:{cfg.metrics_port}: "
                                   f"{e.strerror or e}; choose another --metrics-port (0 picks a free one) or "
                                   f"--metrics-addr") from None
            self.log.info("metrics on %s/metrics (health: /healthz)", mt.url)
        if cfg.otel:
            try:
                from ._trace import WorkerTracing

                self._tracing = WorkerTracing(self._tracer_provider)
            except ImportError as e:
                raise StartupError(f"--otel needs OpenTelemetry ({e}): pip install 'shmrpc[otel]'") from None

    def close(self) -> None:
        """Stop the endpoint, flush spans; idempotent."""
        self.metrics.shutdown()
        if self._tracing is not None:
            self._tracing.shutdown()
            self._tracing = None
        self.traces.clear()

    # ------------------------------------------------------------ per request

    def op_of(self, err: RequestError, op_code: int) -> str:
        """The metrics label of a request refused before it was planned: bounded by the op table (and ``put``, a
        Client.put refused: its label when it succeeds)."""
        return err.op if err.op in kernels.REGISTRY or err.op == "put" else self._op_names.get(op_code, "unknown")

    def begin(self, region: int, index: int, tail: bytes) -> None:
        """A CALL was accepted: remember its trace context (or forget a stale one of that slot)."""
        if tail and self._tracing is not None:
            self.traces[(region, index)] = tail
        else:
            self.traces.pop((region, index), None)

    def refused(self, client_pid: int, err: RequestError) -> None:
        """A CALL refused before its slot was touched (no lease, stale generation, BusyError while the worker drains,
        a malformed doorbell): counted as a request of op ``unknown`` with the error's class as its status (the slot
        is not read: its op is not known), and a failed-request line (rate-limited)."""
        self.metrics.observe("unknown", type(err).__name__, 0.0, 0, 0)
        self.failures.failed(client_pid, "unknown", type(err).__name__, err.field, err.message)

    def failed(self, client_pid: int, op: str, error: str, view: memoryview | None, desc_nbytes: int) -> None:
        """One INFO line for a failed request (rate-limited), its field read from the error response in
        ``view``; call it before DONE goes out (after DONE the slot is the client's again)."""
        if not self.failures.allow():
            return
        field = message = ""
        if view is not None:
            try:
                n = min(unpack_from(view).payload_length, desc_nbytes)
                r = decode_response(bytes(view[HEADER_NBYTES:HEADER_NBYTES + n]))
                field, message = r.field, r.message
            except Exception:  # noqa: BLE001 - the slot is shared memory; a log line must not fail the request
                pass
        self.failures.emit(client_pid, op, error, field, message)

    def end_trace(self, region: int, index: int, t0: float) -> Traced | None:
        """As DONE goes out: the pending span of a traced request in that slot, if any."""
        tail = self.traces.pop((region, index), None)
        if tail is None:
            return None
        return tail, time.perf_counter() - t0, time.time_ns()

    def record(self, traced: Traced, op: str, status: str, stages: dict[str, float], client_pid: int,
               slot: tuple[int, int]) -> None:
        """Record the span :meth:`end_trace` returned."""
        if self._tracing is not None:
            self._tracing.record(traced[0], op, status, traced[1], traced[2], stages, client_pid, slot)
