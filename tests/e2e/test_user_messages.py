"""What a user is told when something is missing: the otel extra for ``trace=True``, and an op input left
unbound, refused by the client before sending or by the worker (docs/kernels.md, "Errors")."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import numpy as np
import pytest
from wire import D, raw_call
from wire import make_desc as _desc

from shmrpc.client import Client, InvalidRequestError, KernelError, Pipeline
from shmrpc.schema.descriptor import TensorRef

if TYPE_CHECKING:
    from conftest import WorkerProc


pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_trace_without_opentelemetry_names_the_extra(monkeypatch: pytest.MonkeyPatch, worker_name: str) -> None:
    """Checked before connecting (the worker need not exist): an ImportError naming the extra, as ``--otel``'s."""
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # `from opentelemetry import trace` then fails
    with pytest.raises(ImportError) as ei:
        Client(worker_name, trace=True)
    msg = str(ei.value)
    assert msg.startswith("Client(trace=...) needs OpenTelemetry (") and msg.endswith(": pip install 'shmrpc[otel]'")
    assert "\n" not in msg and ei.value.name == "opentelemetry"


def test_an_unbound_input_is_refused_by_the_client_or_the_worker(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        with pytest.raises(InvalidRequestError) as ei:  # one op: the client knows its inputs and sends nothing
            c.call("vector_add", x=np.ones(4, np.float32))
        e = ei.value
        assert type(e) is InvalidRequestError and (e.op, e.step, e.tensor, e.field) == ("vector_add", 0, "y", "y")
        assert e.message == "op 'vector_add' needs input 'y'"
        with pytest.raises(InvalidRequestError) as ei:
            c.submit("vector_add", x=np.ones(4, np.float32))
        assert (ei.value.tensor, ei.value.field) == ("y", "y")
        with c.loan(64) as req, pytest.raises(InvalidRequestError) as ei:
            req.array("x", 4, np.float32)[:] = 1.0
            req.send("vector_add")
        assert (ei.value.tensor, ei.value.field) == ("y", "y")
        # a pipeline's step binds its inputs by name; the worker's plan finds the tensor missing
        with pytest.raises(KernelError) as ki:
            c.call(Pipeline().then("scale", a=2.0).then("vector_add"), x=np.ones(4, np.float32))
        assert (ki.value.op, ki.value.step, ki.value.tensor, ki.value.field) == ("vector_add", 1, "y", "inputs")
        # a descriptor whose step leaves the param without a binding at all
        with pytest.raises(KernelError) as ki:
            raw_call(c, _desc(tensors=(TensorRef("x", "float32", (4,), D, 16),)))
        assert (ki.value.op, ki.value.step, ki.value.tensor, ki.value.field) == ("vector_add", 0, "y", "inputs")
        assert "is not bound to a tensor" in ki.value.message
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(3), y=np.ones(3))["out"], 2.0)
