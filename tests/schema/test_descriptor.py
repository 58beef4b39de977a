"""Descriptors: FlatBuffers round trip, hostile bytes become InvalidRequestError naming a field."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmrpc.schema.descriptor import (
    MAX_DIMS,
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

REQ = RequestDesc(
    steps=(StepDesc("scale", 3, (("x", "x"),), (("out", "t"),), (("a", 2.5), ("n", 3), ("s", "hi"), ("on", True))),
           StepDesc("vector_add", 2, (("x", "t"), ("y", "y")), (("out", "z"),))),
    inputs=(TensorRef("x", "float32", (4, 5), 4096, 80), TensorRef("y", "float32", (4, 5), 4160, 80),
            TensorRef("w", "float16", (8,), 0, 0, resident="weights")),
    outputs=("z",), keep=("t",),
)


def test_request_round_trip() -> None:
    assert decode_request(encode_request(REQ)) == REQ


def test_response_round_trip() -> None:
    ok = ResponseDesc(outputs=(TensorRef("z", "bfloat16", (2, 3), 8192, 12),))
    assert decode_response(encode_response(ok)) == ok
    err = ResponseDesc(status=6, message="shape mismatch", op="vector_add", step=1, tensor="y", field="shape")
    assert decode_response(encode_response(err)) == err


def test_unknown_dtype_code_names_field() -> None:
    raw = bytearray(encode_request(RequestDesc((), (TensorRef("x", "uint8", (1,), 4096, 1),), ("x",))))
    other = encode_request(RequestDesc((), (TensorRef("x", "int8", (1,), 4096, 1),), ("x",)))
    # the dtype byte is the one byte where the two differ; set it to 200
    (idx,) = [i for i, (p, q) in enumerate(zip(raw, other)) if p != q]
    assert raw[idx] == DTYPE_CODES["uint8"]
    raw[idx] = 200
    with pytest.raises(InvalidRequestError) as e:
        decode_request(bytes(raw))
    assert e.value.field == "inputs[0].dtype"


def test_too_many_dims_names_field() -> None:
    desc = RequestDesc((), (TensorRef("x", "uint8", (1,) * (MAX_DIMS + 1), 4096, 1),), ("x",))
    with pytest.raises(InvalidRequestError) as e:
        decode_request(encode_request(desc))
    assert e.value.field == "inputs[0].shape"


@pytest.mark.parametrize("raw", [b"", b"\x00" * 7, b"\xff" * 64, b"\x04\x00\x00\x00" + b"\xff" * 12])
def test_garbage_is_invalid_request(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError) as e:
        decode_request(raw)
    assert e.value.field


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_escape_as_other_errors(raw: bytes) -> None:
    try:
        decode_request(raw)
    except InvalidRequestError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_valid_messages_never_escape(data: st.DataObject) -> None:
    raw = bytearray(encode_request(REQ))
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode_request(bytes(raw))
    except InvalidRequestError:
        pass
