"""The worker's error responses: any error a request fails with is answered, its texts escaped and cut to fit."""

from __future__ import annotations

import os

import pytest

from shmrpc.schema.descriptor import decode_response
from shmrpc.schema.errors import InternalError, KernelError
from shmrpc.schema.header import HEADER_NBYTES
from shmrpc.server._dispatch import encode_error

SURROGATE = "cannot open " + os.fsdecode(b"w\xff.bin")  # a file name decoded with surrogateescape: not UTF-8


@pytest.mark.parametrize("room", [256 - HEADER_NBYTES, 1024 - HEADER_NBYTES, 4096 - HEADER_NBYTES])
def test_a_lone_surrogate_is_escaped_and_the_error_keeps_its_class_and_place(room: int) -> None:
    err = KernelError(SURROGATE, op="t_op", step=0, tensor="x" + os.fsdecode(b"\xfe"), field="infer")
    payload = encode_error(err, room)
    r = decode_response(payload)
    assert len(payload) <= room
    assert (r.status, r.message, r.op, r.step, r.tensor, r.field) == (
        KernelError.code, r"cannot open w\udcff.bin", "t_op", 0, r"x\udcfe", "infer")


@pytest.mark.parametrize("room", [256 - HEADER_NBYTES, 4096 - HEADER_NBYTES])
def test_texts_larger_than_the_descriptor_area_are_cut_to_fit(room: int) -> None:
    err = KernelError("m" * 100_000, op="t_op", step=3, tensor="t" * 100_000, field="€" * 100_000)
    payload = encode_error(err, room)
    r = decode_response(payload)
    assert len(payload) <= room
    assert (r.status, r.op, r.step) == (KernelError.code, "t_op", 3)
    assert r.message and set(r.message) == {"m"} and set(r.tensor) == {"t"} and set(r.field) == {"€"}


def test_an_error_no_descriptor_can_carry_is_answered_as_an_internal_error() -> None:
    class Odd:
        def __str__(self) -> str:
            raise RuntimeError("no text")

    err = KernelError("fine", op="t_op", step=1 << 40, tensor=Odd(), field=Odd())  # type: ignore[arg-type]
    r = decode_response(encode_error(err, 240))
    assert (r.status, r.op, r.step, r.tensor, r.field) == (KernelError.code, "t_op", -1, "<Odd>", "<Odd>")
    r = decode_response(encode_error(KernelError("x" * 10, op="é" * 1000), 60))  # a room nothing fits
    assert r.status == InternalError.code and "could not be encoded" in r.message
