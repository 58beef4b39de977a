"""OpenTelemetry spans (the otel extra): a traced call gives a client span and a worker span, linked as
parent and child across the two processes' sides; untraced calls give none. Skipped without the SDK."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmrpc.client import Client, KernelError
from shmrpc.schema.layout import parse_geometry
from shmrpc.server import Worker, WorkerConfig

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace", reason="opentelemetry-sdk is not installed")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _provider() -> tuple[Any, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture
def traced_worker(worker_name: str) -> Iterator[tuple[Worker, InMemorySpanExporter]]:
    provider, exporter = _provider()
    cfg = WorkerConfig(name=worker_name, geometry=parse_geometry("64K:8,1M:2"), lease=(2, 0), backend="numpy",
                       mlock=False, otel=True)
    w = Worker(cfg, tracer_provider=provider)
    w.start()
    th = threading.Thread(target=w.serve_forever, daemon=True)
    th.start()
    try:
        yield w, exporter
    finally:
        w.stop()
        th.join(10)
        w.close()


def test_client_and_worker_spans_are_linked(traced_worker: tuple[Worker, InMemorySpanExporter]) -> None:
    w, worker_spans = traced_worker
    provider, client_spans = _provider()
    with Client(w.config.name, timeout_s=10, trace=provider) as c:
        np.testing.assert_array_equal(c.call("scale", x=np.ones(4), a=2.0)["out"], 2.0)
        with pytest.raises(KernelError):
            c.call("vector_add", x=np.ones(3), y=np.ones(4))
    with Client(w.config.name, timeout_s=10) as plain:  # not traced: no spans on either side
        plain.call("scale", x=np.ones(4), a=2.0)
    cs = client_spans.get_finished_spans()
    ws = worker_spans.get_finished_spans()
    assert [s.name for s in cs] == ["shmrpc.call scale", "shmrpc.call vector_add"]
    assert [s.name for s in ws] == ["shmrpc.serve scale", "shmrpc.serve vector_add"]
    for client_span, worker_span in zip(cs, ws):
        assert worker_span.context.trace_id == client_span.context.trace_id
        assert worker_span.parent is not None and worker_span.parent.span_id == client_span.context.span_id
        assert client_span.start_time <= worker_span.start_time <= worker_span.end_time <= client_span.end_time
    assert ws[0].attributes["shmrpc.status"] == "ok" and "shmrpc.stage.kernel_s" in ws[0].attributes
    assert ws[1].attributes["shmrpc.status"] == "KernelError" and not ws[1].status.is_ok
    assert cs[1].attributes["error.type"] == "KernelError" and cs[1].attributes["shmrpc.error.field"]


def test_otel_off_by_default(worker_name: str) -> None:
    assert WorkerConfig(name=worker_name).otel is False
