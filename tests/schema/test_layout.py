"""Region geometry and superblock."""

from __future__ import annotations

import pytest

from shmrpc.schema.layout import (
    DEFAULT_GEOMETRY,
    PAGE,
    SUPERBLOCK_NBYTES,
    Geometry,
    SizeClass,
    Superblock,
    parse_geometry,
    parse_size,
    tensor_align,
)


def test_parse_size_units() -> None:
    assert parse_size("4096") == 4096
    assert parse_size("64K") == 65536
    assert parse_size("16MiB") == 16 << 20
    assert parse_size("1g") == 1 << 30
    with pytest.raises(ValueError):
        parse_size("12Q")


def test_default_geometry_carries_256mib_in_and_out() -> None:
    big = DEFAULT_GEOMETRY.max_slot_nbytes
    assert big >= DEFAULT_GEOMETRY.desc_nbytes + 2 * (256 << 20)
    assert DEFAULT_GEOMETRY.classes[0].n_slots >= 32  # many small requests at once


def test_slot_offsets_are_page_aligned_and_disjoint() -> None:
    g = parse_geometry("64K:3,1M:2")
    offs = [g.slot_offset(i) for i in range(g.n_slots)]
    assert offs[0] == SUPERBLOCK_NBYTES
    assert all(o % PAGE == 0 for o in offs)
    ends = [g.slot_offset(i) + g.slot_nbytes(i) for i in range(g.n_slots)]
    assert all(e <= o for e, o in zip(ends, offs[1:]))
    assert ends[-1] == g.region_nbytes
    assert list(g.slots_of_class(1)) == [3, 4]
    assert g.spec() == "64K:3,1M:2"


@pytest.mark.parametrize("spec", ["1M:1,64K:1", "64K:0", "5000:1", "64K", "2K:1"])
def test_bad_geometries_rejected(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_geometry(spec)


def test_superblock_round_trip() -> None:
    g = Geometry((SizeClass(65536, 4), SizeClass(1 << 20, 1)))
    sb = Superblock.for_geometry(g, worker_pid=123, worker_start_ticks=456, epoch=789)
    buf = memoryview(bytearray(SUPERBLOCK_NBYTES))
    sb.pack_into(buf)
    back = Superblock.unpack_from(buf)
    assert back == sb and back.geometry() == g


def test_superblock_bad_magic() -> None:
    with pytest.raises(ValueError, match="magic"):
        Superblock.unpack_from(bytes(SUPERBLOCK_NBYTES))


def test_tensor_alignment_rule() -> None:
    assert tensor_align(100) == 64
    assert tensor_align(1 << 20) == 4096
