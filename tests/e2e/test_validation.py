"""Every validation rule: a crafted bad request gets the named error, and the next good request succeeds.

The bad requests are written into the client's own slot with raw bytes and rung with a real CALL,
exactly as a hostile or buggy process sharing the region could.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import zmq
from wire import D, raw_call
from wire import make_desc as _desc

from shmrpc.client import (
    BusyError,
    Client,
    InvalidRequestError,
    KernelError,
    Pipeline,
    RequestError,
    RequestTooLargeError,
    StaleSlotError,
    UnknownOpError,
)
from shmrpc.schema import messages as m
from shmrpc.schema.descriptor import RequestDesc, StepDesc, TensorRef, encode_request
from shmrpc.schema.header import Flag
from shmrpc.schema.messages import NO_RESPONSE
from shmrpc.schema.naming import endpoint

if TYPE_CHECKING:
    from conftest import WorkerProc


pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]



def _good(c: Client) -> None:
    np.testing.assert_array_equal(c.call("vector_add", x=np.ones(3), y=np.ones(3))["out"], 2.0)


CASES: list[tuple[str, dict[str, Any], type[RequestError], str]] = [
    ("request_id", {"header": lambda h: h._replace(request_id=5)}, InvalidRequestError, "request_id"),
    ("flags", {"header": lambda h: h._replace(flags=0x100)}, InvalidRequestError, "flags"),
    ("response flag", {"header": lambda h: h._replace(flags=1)}, InvalidRequestError, "flags"),
    ("generation", {"header": lambda h: h._replace(generation=h.generation + 1)}, StaleSlotError, "generation"),
    ("payload zero", {"header": lambda h: h._replace(payload_length=0)}, InvalidRequestError, "payload_length"),
    ("payload huge", {"header": lambda h: h._replace(payload_length=D)}, InvalidRequestError, "payload_length"),
    ("garbage", {"payload": b"\xff" * 64}, InvalidRequestError, "descriptor"),
    ("unknown op", {"payload": _desc("nope")}, UnknownOpError, "steps[0].op"),
    ("op code", {"payload": _desc(code=999)}, UnknownOpError, "steps[0].op_code"),
    ("step op code of another op", {"payload": _desc(code=3)}, InvalidRequestError, "steps[0].op_code"),
    ("header op code of another op", {"header": lambda h: h._replace(op_code=1)}, InvalidRequestError, "op_code"),
    ("header op code unknown", {"header": lambda h: h._replace(op_code=999)}, UnknownOpError, "op_code"),
    ("outside slot", {"payload": _desc(tensors=(TensorRef("x", "float32", (4,), 65536, 16),
                                                TensorRef("y", "float32", (4,), D, 16)))},
     InvalidRequestError, "inputs[0].offset"),
    ("in descriptor area", {"payload": _desc(tensors=(TensorRef("x", "float32", (4,), 64, 16),
                                                      TensorRef("y", "float32", (4,), D, 16)))},
     InvalidRequestError, "inputs[0].offset"),
    ("huge offset", {"payload": _desc(tensors=(TensorRef("x", "float32", (4,), 2**63, 16),
                                               TensorRef("y", "float32", (4,), D, 16)))},
     InvalidRequestError, "inputs[0].offset"),
    ("misaligned", {"payload": _desc(tensors=(TensorRef("x", "float32", (4,), D + 4, 16),
                                              TensorRef("y", "float32", (4,), D + 64, 16)))},
     InvalidRequestError, "inputs[0].offset"),
    ("nbytes", {"payload": _desc(tensors=(TensorRef("x", "float32", (4,), D, 20),
                                          TensorRef("y", "float32", (4,), D + 64, 16)))},
     InvalidRequestError, "inputs[0].nbytes"),
    ("negative dim", {"payload": _desc(tensors=(TensorRef("x", "float32", (-4,), D, 16),
                                                TensorRef("y", "float32", (4,), D + 64, 16)))},
     InvalidRequestError, "inputs[0].shape"),
    ("duplicate", {"payload": _desc(tensors=(TensorRef("x", "float32", (4,), D, 16),
                                             TensorRef("x", "float32", (4,), D + 64, 16)))},
     InvalidRequestError, "inputs[1].name"),
    ("no outputs", {"payload": _desc(outputs=())}, InvalidRequestError, "outputs"),
    ("output no step produces", {"payload": _desc(outputs=("nope",))}, InvalidRequestError, "outputs"),
    ("output asked twice", {"payload": _desc(outputs=("out", "out"))}, InvalidRequestError, "outputs"),
    ("KEEP flag without keep list", {"header": lambda h: h._replace(flags=int(Flag.KEEP))}, InvalidRequestError, "flags"),
    ("unbound input", {"payload": _desc(tensors=(TensorRef("x", "float32", (4,), D, 16),))}, KernelError, ""),
    ("tensor no step reads", {"payload": encode_request(RequestDesc(
        (StepDesc("vector_add", 0, (("x", "x"), ("y", "y")), (("out", "out"),), ()),),
        (TensorRef("x", "float32", (4,), D, 16), TensorRef("y", "float32", (4,), D + 64, 16),
         TensorRef("a", "float32", (), D + 128, 4)), ("out",)))},
     InvalidRequestError, "inputs[2].name"),
    ("shape mismatch", {"payload": _desc(tensors=(TensorRef("x", "float32", (4,), D, 16),
                                                  TensorRef("y", "float32", (5,), D + 64, 20)))}, KernelError, "shape"),
    ("dtype mismatch", {"payload": _desc(tensors=(TensorRef("x", "float32", (4,), D, 16),
                                                  TensorRef("y", "float64", (4,), D + 64, 32)))}, KernelError, "dtype"),
    ("unknown attr", {"payload": _desc("scale", tensors=(TensorRef("x", "float32", (4,), D, 16),),
                                       attrs=(("zz", 1.0),))}, KernelError, "zz"),
    ("attr type", {"payload": _desc("scale", tensors=(TensorRef("x", "float32", (4,), D, 16),),
                                    attrs=(("a", "two"),))}, KernelError, "a"),
    ("outputs too big", {"payload": _desc(tensors=(TensorRef("x", "uint8", (30000,), D, 30000),
                                                   TensorRef("y", "uint8", (30000,), D + 30016, 30000)))},
     RequestTooLargeError, "outputs"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request_gets_named_error_then_worker_serves(worker: WorkerProc, case: tuple) -> None:
    _, kwargs, exc, field = case
    with Client(worker.name, timeout_s=10) as c:
        with pytest.raises(exc) as e:
            raw_call(c, **kwargs)
        if field:
            assert e.value.field == field, str(e.value)
        assert worker.proc.poll() is None
        _good(c)


def test_slot_of_another_client_is_refused_and_untouched(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as a, Client(worker.name, timeout_s=10) as b:
        with a.loan(64) as la:
            xa = la.array("x", 16, np.float32)
            xa[:] = 42
            sa = la._s
            with pytest.raises(StaleSlotError) as e:
                raw_call(b, call=(sa.region, sa.index, 777, sa.generation))
            assert e.value.field == "slot"
            np.testing.assert_array_equal(xa, 42)  # the worker never wrote into a's slot
            del xa
        _good(a)
        _good(b)


@pytest.mark.parametrize("call", [(0, 10_000, 777, 1), (7, 0, 777, 1)])
def test_nonexistent_slot_is_refused(worker: WorkerProc, call: tuple[int, int, int, int]) -> None:
    with Client(worker.name, timeout_s=10) as c:
        with pytest.raises(StaleSlotError):
            raw_call(c, call=call)
        _good(c)


def test_ringing_twice_refuses_the_second_doorbell(worker: WorkerProc) -> None:
    slow = Pipeline()
    for _ in range(20):
        slow = slow.then("scale", a=1.0)
    with Client(worker.name, timeout_s=10) as c, c.loan(3 << 20) as req:
        req.array("x", 200_000, np.float64)[:] = 1.0  # ~20 passes over 1.6 MB: still running when we ring again
        rid = req._post(slow, {}, False, ())
        s = req._s
        probe = type(s)(s.region, s.index, s.nbytes, s.generation, False, in_flight=4242)
        c._inflight.add(4242, probe)
        c._t.send(m.pack_call(s.region, s.index, 4242, s.generation))
        c._pump(time.monotonic() + 10, lambda: probe.in_flight is None)
        assert probe.status == NO_RESPONSE | BusyError.code
        req._wait(rid, time.monotonic() + 10)
        out = req._response(rid)["19.out"]
        np.testing.assert_array_equal(out, 1.0)
        del out
    with Client(worker.name, timeout_s=10) as c:
        _good(c)


def test_call_before_hello_is_refused_as_not_leased(worker: WorkerProc) -> None:
    """A CALL from a peer without a lease names a slot that is not its own: 0x8000 | StaleSlotError."""
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint(worker.name))
        s.send(m.pack_call(0, 0, 99, 1))
        assert s.poll(10_000), "no DONE for a CALL before HELLO"
        assert m.unpack_done(s.recv()) == (0, 0, 99, NO_RESPONSE | StaleSlotError.code)
        s.close()
    finally:
        ctx.term()
    with Client(worker.name, timeout_s=10) as c:
        _good(c)


def test_malformed_frames_do_not_stop_the_worker(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        for frame in (b"", b"C", b"C" + b"\x00" * 3, b"Z" + b"\x00" * 20, b"H{not json", b"A{}", b"R\x00"):
            c._t.sock.send(frame)
        c._t.sock.send_multipart([b"a", b"b", b"c"])
        _good(c)
        assert worker.proc.poll() is None


def test_busy_fail_mode_raises_busy(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker(slots="64K:2,1M:1", lease="1,0")
    with Client(w.name, timeout_s=10) as a, Client(w.name, timeout_s=2, on_busy="fail") as b:
        la = a.loan(200_000)  # a borrows the only 1M slot
        try:
            with pytest.raises(BusyError):
                b.call("echo", x=np.zeros(100_000, np.uint8))
        finally:
            la.release()
        # RELEASE travels on a's socket, b's ACQUIRE on its own: retry until the worker has seen it (hang guard only)
        deadline = time.monotonic() + 30.0
        while True:
            try:
                out = b.call("echo", x=np.ones(100_000, np.uint8))["out"]
                break
            except BusyError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        np.testing.assert_array_equal(out, 1)



def test_per_client_borrow_limits(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--client-max-slots", "1", "--client-max-bytes", "4M", slots="64K:2,1M:4,4M:2",
                     lease="1,0,0")
    with Client(w.name, timeout_s=5, on_busy="fail") as c, Client(w.name, timeout_s=5, on_busy="fail") as other:
        held = c.loan(500_000)  # borrows one 1M slot: the client's limit of one
        try:
            with pytest.raises(BusyError, match="client-max-slots"):
                c.loan(500_000)
            with other.loan(500_000), other.loan(64):  # the limit is per client: another client still borrows
                pass
        finally:
            held.release()
    w2 = spawn_worker("--client-max-bytes", "1M", slots="64K:2,1M:4,4M:2", lease="1,0,0",
                      name=w.name + "b")
    with Client(w2.name, timeout_s=5, on_busy="fail") as c:
        with c.loan(500_000):
            with pytest.raises(BusyError, match="client-max-bytes"):
                c.loan(500_000)
