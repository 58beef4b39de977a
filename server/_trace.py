"""Optional OpenTelemetry spans on the worker side (``shmrpc serve --otel``; the ``otel`` extra).

The worker records a SERVER span ``shmrpc.serve <op>`` for each request whose CALL carried a
trace context (a client with ``trace=True``), as a child of the client's span, from CALL received
to DONE sent, with the stage times (queue, h2d, kernel, d2h) as attributes. Requests without a
context are not traced: the client decides, the worker follows.

Where the spans go: the given ``TracerProvider``; else the global one if the process configured
one; else, with opentelemetry-sdk installed, a provider for service ``shmrpc-worker`` exporting
by ``OTEL_TRACES_EXPORTER`` (``otlp``, needing opentelemetry-exporter-otlp and honouring the
``OTEL_EXPORTER_OTLP_*`` variables, or ``console``), read once at start.
"""

from __future__ import annotations

import os
from typing import Any

from shmrpc.schema.messages import TRACE_STRUCT

__all__ = ["WorkerTracing"]


def _default_provider() -> Any:
    from opentelemetry import trace

    current = trace.get_tracer_provider()
    if type(current).__name__ not in ("ProxyTracerProvider", "NoOpTracerProvider"):
        return current  # the process configured one
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        return None  # API only: spans are no-ops
    provider = TracerProvider(resource=Resource.create({"service.name": "shmrpc-worker"}))
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")[0].strip()
    if kind == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    elif kind == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            return provider  # no exporter installed: spans are recorded and dropped
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


class WorkerTracing:
    """Records worker spans from CALL trace tails.

    Args:
        provider: a ``TracerProvider``; None picks one as the module docstring says.

    Raises:
        ImportError: opentelemetry-api is not installed.
    """

    def __init__(self, provider: Any = None) -> None:
        from opentelemetry import trace

        self._trace = trace
        self.provider = provider if provider is not None else _default_provider()
        self._tracer = trace.get_tracer("shmrpc.server", tracer_provider=self.provider)

    def record(self, tail: bytes, op: str, status: str, seconds: float, end_ns: int, stages: dict[str, float],
               client_pid: int, slot: tuple[int, int]) -> None:
        """One finished request's span, ``seconds`` long and ending at ``end_ns`` (``time.time_ns()``), child
        of the context in ``tail``."""
        try:
            trace_id, span_id, flags = TRACE_STRUCT.unpack(tail)
        except Exception:  # noqa: BLE001 - a malformed tail from a client: no span, the request is unaffected
            return
        t = self._trace
        parent = t.SpanContext(int.from_bytes(trace_id, "big"), int.from_bytes(span_id, "big"), is_remote=True,
                               trace_flags=t.TraceFlags(flags & 0xFF))
        if not parent.is_valid:
            return
        attrs: dict[str, Any] = {"rpc.system": "shmrpc", "rpc.method": op, "shmrpc.status": status,
                                 "shmrpc.client_pid": client_pid, "shmrpc.region": slot[0], "shmrpc.slot": slot[1]}
        for stage, stage_s in stages.items():
            attrs[f"shmrpc.stage.{stage}_s"] = float(stage_s)
        span = self._tracer.start_span(f"shmrpc.serve {op}", context=t.set_span_in_context(t.NonRecordingSpan(parent)),
                                       kind=t.SpanKind.SERVER, attributes=attrs,
                                       start_time=end_ns - int(seconds * 1e9))
        if status != "ok" and status != "guess_too_small":  # a refused guess is sent again (metrics.GUESS_TOO_SMALL)
            span.set_status(t.Status(t.StatusCode.ERROR, status))
            span.set_attribute("error.type", status)
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Flush the spans of a provider this module made."""
        shutdown = getattr(self.provider, "force_flush", None)
        if shutdown is not None:
            shutdown()
