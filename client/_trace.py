"""Optional OpenTelemetry spans on the client side (``Client(name, trace=True)``; the ``otel`` extra).

Each traced call gets a CLIENT span ``shmrpc.call <op>`` from submit to result; its context rides
in the CALL frame's optional tail (``schema.messages.TRACE_STRUCT``), so a worker started with
``--otel`` records its SERVER span as a child of it. Like any library, the client uses only the
OpenTelemetry API: the application configures the SDK and its exporter.
"""

from __future__ import annotations

from typing import Any

from shmrpc.schema.messages import TRACE_STRUCT

__all__ = ["ClientTracing"]


class ClientTracing:
    """Starts and ends the client spans.

    Args:
        provider: an OpenTelemetry ``TracerProvider``, or None for the global one.

    Raises:
        ImportError: opentelemetry-api is not installed; the message names the extra (``pip install 'shmrpc[otel]'``).
    """

    def __init__(self, provider: Any = None) -> None:
        try:
            from opentelemetry import trace
        except ImportError as e:
            raise ImportError(f"Client(trace=...) needs OpenTelemetry ({e}): pip install 'shmrpc[otel]'",
                              name=e.name) from None

        self._trace = trace
        self._tracer = trace.get_tracer("shmrpc.client", tracer_provider=provider)

    def start(self, op: str, worker: str) -> tuple[Any, bytes]:
        """A started span for a call of ``op`` and the CALL frame tail carrying its context."""
        span = self._tracer.start_span(f"shmrpc.call {op}", kind=self._trace.SpanKind.CLIENT,
                                       attributes={"rpc.system": "shmrpc", "rpc.method": op, "shmrpc.worker": worker})
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return span, b""
        return span, TRACE_STRUCT.pack(ctx.trace_id.to_bytes(16, "big"), ctx.span_id.to_bytes(8, "big"),
                                       int(ctx.trace_flags))

    def end(self, span: Any, error: BaseException | None) -> None:
        """End ``span``, marking it failed with ``error``'s class and fields when there is one."""
        if error is not None:
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, str(error)[:200]))
            span.set_attribute("error.type", type(error).__name__)
            for key in ("op", "tensor", "field"):
                value = getattr(error, key, "")
                if value:
                    span.set_attribute(f"shmrpc.error.{key}", str(value))
        span.end()
