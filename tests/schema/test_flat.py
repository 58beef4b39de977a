"""The hand-written FlatBuffers codec (schema/_flat.py, through descriptor.py) against the generated code's.

The generated code (``_fb.py``, driven by ``support/fbref.py``: the product's codec before 2026-12-04) is the
reference: random messages built by either side read the same through the other, and a mutated message the
hand-written reader accepts reads as the generated reader reads it (the hand-written one refuses more: it never
reads outside the buffer, where the generated one slices short or wraps around).
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import fbref

from shmrpc.schema.descriptor import (
    MAX_ATTRS,
    MAX_DIMS,
    MAX_NAME,
    MAX_STEPS,
    RequestDesc,
    ResponseDesc,
    StepDesc,
    TensorRef,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from shmrpc.schema.dtypes import DTYPE_CODES
from shmrpc.schema.errors import InvalidRequestError

_names = st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=12)
_u64 = st.integers(0, 2**64 - 1)
_attr_values = st.one_of(st.floats(allow_nan=False), st.integers(-(2**63), 2**63 - 1), st.booleans(),
                         st.text(st.characters(codec="utf-8"), max_size=12))
_tensors = st.builds(TensorRef, _names, st.sampled_from(sorted(DTYPE_CODES)),
                     st.lists(st.integers(-(2**63), 2**63 - 1), max_size=MAX_DIMS).map(tuple), _u64, _u64,
                     st.one_of(st.just(""), _names))
_bindings = st.lists(st.tuples(_names, _names), max_size=4).map(tuple)
_steps = st.builds(StepDesc, _names, st.integers(0, 65535), _bindings, _bindings,
                   st.lists(st.tuples(_names, _attr_values), max_size=4).map(tuple))
_requests = st.builds(RequestDesc, st.lists(_steps, max_size=3).map(tuple), st.lists(_tensors, max_size=4).map(tuple),
                      st.lists(_names, max_size=4).map(tuple), st.lists(_names, max_size=3).map(tuple))
_responses = st.builds(ResponseDesc, st.integers(0, 65535), st.text(max_size=40), st.text(max_size=12),
                       st.integers(-(2**31), 2**31 - 1), st.text(max_size=12), st.text(max_size=12),
                       st.lists(_tensors, max_size=4).map(tuple))


_CODECS = {RequestDesc: (encode_request, decode_request, fbref.encode_request, fbref.decode_request),
           ResponseDesc: (encode_response, decode_response, fbref.encode_response, fbref.decode_response)}


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_requests, _responses))
def test_messages_read_the_same_through_both_codecs(msg: RequestDesc | ResponseDesc) -> None:
    encode, decode, ref_encode, ref_decode = _CODECS[type(msg)]
    mine, theirs = encode(msg), ref_encode(msg)
    assert ref_decode(mine) == msg
    assert decode(theirs) == msg
    assert decode(mine) == msg


def _reference(raw: bytes) -> RequestDesc | None:
    try:
        return fbref.decode_request(raw)  # type: ignore[no-any-return]
    except InvalidRequestError:
        return None


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_requests, st.booleans(), st.data())
def test_mutated_messages_are_refused_or_read_as_the_reference_reads_them(req: RequestDesc, generated: bool,
                                                                        data: st.DataObject) -> None:
    raw = bytearray((fbref.encode_request if generated else encode_request)(req))
    for _ in range(data.draw(st.integers(1, 6))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    raw = raw[:cut] if data.draw(st.booleans()) else raw
    try:
        got = decode_request(bytes(raw))
    except InvalidRequestError as e:
        assert e.field
        return
    assert got == _reference(bytes(raw))


def test_every_prefix_of_a_message_is_refused() -> None:
    raw = encode_request(fbref_request())
    for n in range(len(raw) - 4):  # (the last bytes are the end of the last string's padding)
        with pytest.raises(InvalidRequestError) as e:
            decode_request(raw[:n])
        assert e.value.field


def fbref_request() -> RequestDesc:
    return RequestDesc(steps=(StepDesc("scale", 3, (("x", "x"),), (("out", "out"),), (("a", 2.5), ("s", "hi"))),),
                       inputs=(TensorRef("x", "float32", (4, 5), 4096, 80), TensorRef("w", "int8", (2,), 0, 0, "w")),
                       outputs=("out",), keep=("k",))


def test_a_vtable_before_the_buffer_is_refused_not_wrapped_around() -> None:
    raw = bytearray(encode_request(fbref_request()))
    root = struct.unpack_from("<I", raw, 0)[0]
    struct.pack_into("<i", raw, root, root + 8)  # vtable at -8: the generated reader would read the buffer's end
    with pytest.raises(InvalidRequestError) as e:
        decode_request(bytes(raw))
    assert e.value.field == "descriptor"


def test_a_string_longer_than_the_buffer_is_refused_not_cut_short() -> None:
    raw = bytearray(encode_request(fbref_request()))
    at = raw.rindex(b"\x01\x00\x00\x00k\x00")  # the last string: keep[0]
    struct.pack_into("<I", raw, at, len(raw) - at - 4 + 3)
    with pytest.raises(InvalidRequestError) as e:
        decode_request(bytes(raw))
    assert e.value.field == "descriptor"
    assert fbref.decode_request(bytes(raw)).keep[0].startswith("k")  # the reference slices it short


@pytest.mark.parametrize(("desc", "field"), [
    (RequestDesc((StepDesc("echo", 0, (), ()),) * (MAX_STEPS + 1), (), ("x",)), "steps"),
    (RequestDesc((StepDesc("scale", 0, (), (), tuple((f"a{i}", i) for i in range(MAX_ATTRS + 1))),), (), ("x",)),
     "steps[0].attrs"),
    (RequestDesc((), (TensorRef("x" * (MAX_NAME + 1), "uint8", (1,), 4096, 1),), ("x",)), "inputs[0].name"),
    (RequestDesc((), (TensorRef("x", "uint8", (1,) * (MAX_DIMS + 1), 4096, 1),), ("x",)), "inputs[0].shape"),
    (RequestDesc((StepDesc("scale", 0, (("x", "y" * (MAX_NAME + 1)),), ()),), (), ("x",)), "steps[0].inputs[0].tensor"),
])
def test_limits_name_their_field(desc: RequestDesc, field: str) -> None:
    for encode in (encode_request, fbref.encode_request):
        with pytest.raises(InvalidRequestError) as e:
            decode_request(encode(desc))
        assert e.value.field == field


def test_bytes_are_the_same_every_time_and_vtables_are_shared() -> None:
    req = fbref_request()
    assert encode_request(req) == encode_request(req)
    one = len(encode_request(RequestDesc((), (TensorRef("x", "uint8", (1,), 4096, 1),), ("x",))))
    two = len(encode_request(RequestDesc((), (TensorRef("x", "uint8", (1,), 4096, 1),) * 2, ("x",))))
    assert two - one < 60  # the second tensor's table, name and shape, not a second vtable of 16 bytes as well
