"""The 16-byte header: golden bytes, flag bits."""

from __future__ import annotations

import pytest

from shmrpc.schema.header import HEADER_NBYTES, Flag, Header, pack_into, unpack_from


def test_golden_bytes() -> None:
    h = Header(request_id=0x01020304, op_code=0x0506, payload_length=0x0708090A, flags=0x0B0C, generation=0x0D0E0F10)
    assert h.pack() == bytes.fromhex("04030201" "0605" "0a090807" "0c0b" "100f0e0d")
    assert HEADER_NBYTES == 16


def test_field_offsets_match_design_table() -> None:
    raw = Header(1, 2, 3, 4, 5).pack()
    assert int.from_bytes(raw[0:4], "little") == 1
    assert int.from_bytes(raw[4:6], "little") == 2
    assert int.from_bytes(raw[6:10], "little") == 3
    assert int.from_bytes(raw[10:12], "little") == 4
    assert int.from_bytes(raw[12:16], "little") == 5


def test_round_trip_at_offset_is_a_copy() -> None:
    buf = bytearray(64)
    pack_into(buf, 8, Header(7, 1, 100, int(Flag.RESPONSE | Flag.ERROR), 9))
    h = unpack_from(buf, 8)
    buf[8:24] = bytes(16)
    assert h == Header(7, 1, 100, 3, 9)


def test_flag_bits() -> None:
    assert [int(f) for f in (Flag.RESPONSE, Flag.ERROR, Flag.IN_PLACE, Flag.KEEP, Flag.GUESS)] == [1, 2, 4, 8, 16]
    assert Flag.request_mask() == 0b11100


def test_out_of_range_value_rejected() -> None:
    import struct

    with pytest.raises(struct.error):
        Header(1 << 32, 0, 0, 0, 0).pack()
