"""The steady path of a slot: a request identical to the last one there skips decoding, but never checking.

The worker keeps the last validated request per slot and serves an identical one (same descriptor
bytes, op code, flags and owner) from it. These tests send a request many times from one loan, then
change one byte of the descriptor, or the header, in that same slot, and expect the full validation's
named error; the next good request in the slot is answered again.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pytest
from wire import D, make_desc

from shmrpc.client import Client, InvalidRequestError, RequestError, StaleSlotError
from shmrpc.schema import messages as m
from shmrpc.schema.descriptor import TensorRef
from shmrpc.schema.header import HEADER, Header

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _ring(c: Client, loan: object, payload: bytes, rid: int, edit_header: object = None) -> dict[str, np.ndarray]:
    """Write ``payload`` and a header into ``loan``'s slot by hand, ring it and return the outputs."""
    s, mv = loan._s, loan._live()  # type: ignore[attr-defined]
    h = Header(rid, 0, len(payload), 0, s.generation)
    if edit_header is not None:
        h = edit_header(h)  # type: ignore[operator]
    mv[16:16 + len(payload)] = payload
    HEADER.pack_into(mv, 0, *h)
    s.in_flight = rid
    c._inflight.add(rid, s)
    c._t.send(m.pack_call(s.region, s.index, rid, s.generation))
    loan._wait(rid, time.monotonic() + 10)  # type: ignore[attr-defined]
    loan._outputs = ("out",)  # type: ignore[attr-defined]
    return loan._response(rid)  # type: ignore[attr-defined,no-any-return]


def test_identical_requests_are_answered_and_a_changed_byte_is_validated(worker: WorkerProc) -> None:
    good = make_desc()
    # the same request with y's offset moved outside the slot's data area: only its bytes differ
    bad = make_desc(tensors=(TensorRef("x", "float32", (4,), D, 16), TensorRef("y", "float32", (4,), 1 << 40, 16)))
    assert len(bad) == len(good)
    with Client(worker.name) as c, c.loan(1024) as loan:
        x = np.frombuffer(loan._s.buf, dtype=np.float32, count=4, offset=D)
        y = np.frombuffer(loan._s.buf, dtype=np.float32, count=4, offset=D + 64)
        x[...] = [1, 2, 3, 4]
        y[...] = 10
        for rid in range(1, 50):  # the steady path
            np.testing.assert_array_equal(_ring(c, loan, good, rid)["out"], [11, 12, 13, 14])
        with pytest.raises(InvalidRequestError) as e:
            _ring(c, loan, bad, 50)
        assert e.value.field == "inputs[1].offset"
        np.testing.assert_array_equal(_ring(c, loan, good, 51)["out"], [11, 12, 13, 14])
        # a header that disagrees with the doorbell is refused even when the descriptor is the primed one
        with pytest.raises(StaleSlotError) as e2:
            _ring(c, loan, good, 52, lambda h: h._replace(generation=h.generation + 1))
        assert e2.value.field == "generation"
        with pytest.raises(InvalidRequestError) as e3:
            _ring(c, loan, good, 53, lambda h: h._replace(flags=0x100))
        assert e3.value.field == "flags"
        y[...] = 20  # the tensor bytes are data, read afresh by every request
        np.testing.assert_array_equal(_ring(c, loan, good, 54)["out"], [21, 22, 23, 24])


def test_one_byte_flipped_anywhere_in_a_primed_descriptor_never_crashes(worker: WorkerProc) -> None:
    good = make_desc()
    with Client(worker.name) as c, c.loan(1024) as loan:
        x = np.frombuffer(loan._s.buf, dtype=np.float32, count=8, offset=D)
        x[...] = 1
        rid = 1
        for i in range(len(good)):
            _ring(c, loan, good, rid)
            rid += 1
            flipped = bytearray(good)
            flipped[i] ^= 0xFF
            try:
                _ring(c, loan, bytes(flipped), rid)
            except RequestError:
                pass
            rid += 1
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(3), y=np.ones(3))["out"], 2.0)


def test_requests_taking_turns_in_one_slot_are_answered_and_a_bad_one_drops_none_of_their_answers(
        worker: WorkerProc) -> None:
    """Three requests in turn from one loan (the worker keeps each one's checks: up to PER_SLOT per slot); a changed
    byte among them gets the full validation's named error, and the three are answered right again after it."""
    add = make_desc()
    scale = make_desc("scale", tensors=(TensorRef("x", "float32", (4,), D, 16),), attrs=(("a", 3.0), ("b", 1.0)))
    add8 = make_desc(tensors=(TensorRef("x", "float32", (2,), D, 8), TensorRef("y", "float32", (2,), D + 64, 8)))
    bad = make_desc(tensors=(TensorRef("x", "float32", (4,), D, 16), TensorRef("y", "float32", (4,), 1 << 40, 16)))
    with Client(worker.name) as c, c.loan(1024) as loan:
        x = np.frombuffer(loan._s.buf, dtype=np.float32, count=4, offset=D)
        y = np.frombuffer(loan._s.buf, dtype=np.float32, count=4, offset=D + 64)
        want = {add: [11, 12, 13, 14], scale: [4, 7, 10, 13], add8: [11, 12]}
        rid, first = 1, 1.0
        for turn in range(2):
            for _ in range(10):
                for payload, out in want.items():
                    x[...] = first + np.arange(4)  # each request's inputs (an output may land where y was)
                    y[...] = 10
                    np.testing.assert_array_equal(_ring(c, loan, payload, rid)["out"][:len(out)], out)
                    rid += 1
            if turn == 0:
                with pytest.raises(InvalidRequestError) as e:
                    _ring(c, loan, bad, rid)
                assert e.value.field == "inputs[1].offset"
                rid += 1
                first = 2.0  # the tensor bytes are data, read afresh by every request
                want = {add: [12, 13, 14, 15], scale: [7, 10, 13, 16], add8: [12, 13]}
