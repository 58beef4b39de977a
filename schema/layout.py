"""Region and slot geometry: the superblock, size classes, slot offsets, tensor alignment.

A region is one POSIX shared-memory object::

    0                4096                                                    nbytes
    +----------------+--------+--------+-----+--------+--------+-----+--------+
    |   superblock   | slot 0 | slot 1 | ... | slot k | slot   | ... | slot   |
    | (one page)     |  class 0 (small)      | class 1 (larger) ...           |
    +----------------+--------+--------+-----+--------+--------+-----+--------+

Slots are grouped in size classes, every slot starts on a 4096-byte boundary,
and a slot is named by ``(region, slot)`` where ``slot`` counts across classes
in order. Inside a slot::

    0        16                         desc_nbytes                      slot_nbytes
    +--------+--------------------------+--------------------------------+
    | header | FlatBuffers descriptor   | tensors, each at an aligned     |
    | 16 B   | (payload_length bytes)   | offset (64 B; 4096 B if >= 1MiB)|
    +--------+--------------------------+--------------------------------+

The response header and descriptor are written over the request's, in the same
first ``desc_nbytes`` bytes; outputs go after the inputs (or over the first
input for in-place ops). All positions are offsets from the slot start.

Superblock (little-endian, ``SUPERBLOCK`` struct, at region offset 0):

=======  ======  ======================================================
offset   type    field
=======  ======  ======================================================
0        8s      magic ``b"SHMRPC\\x00\\x01"``
8        u32     layout_version
12       u32     desc_nbytes (descriptor area at the start of every slot)
16       8s      schema_hash (``SCHEMA_HASH``'s 16 hex digits as 8 raw bytes)
24       u32     worker_pid
28       u32     n_classes
32       u64     worker_start_ticks (field 22 of /proc/<pid>/stat)
40       u64     epoch (the worker's start time, ns since the Unix epoch)
48       u64     region_nbytes
56       ...     n_classes x (u64 slot_nbytes, u64 n_slots)
=======  ======  ======================================================
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import NamedTuple

from ._hash import SCHEMA_HASH

__all__ = [
    "MAGIC",
    "LAYOUT_VERSION",
    "PAGE",
    "SUPERBLOCK_NBYTES",
    "DESC_NBYTES",
    "TENSOR_ALIGN",
    "LARGE_ALIGN",
    "LARGE_TENSOR",
    "SizeClass",
    "Geometry",
    "Superblock",
    "parse_size",
    "parse_geometry",
    "format_size", "format_size_approx",
    "align_up",
    "tensor_align",
    "DEFAULT_GEOMETRY",
]

MAGIC = b"SHMRPC\x00\x01"
LAYOUT_VERSION = 1
PAGE = 4096
SUPERBLOCK_NBYTES = PAGE
DESC_NBYTES = 4096
TENSOR_ALIGN = 64
LARGE_ALIGN = 4096
LARGE_TENSOR = 1 << 20

_SB_HEAD = struct.Struct("<8sII8sIIQQQ")
_SB_CLASS = struct.Struct("<QQ")
_MAX_CLASSES = (SUPERBLOCK_NBYTES - _SB_HEAD.size) // _SB_CLASS.size


def align_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align`` (a power of two)."""
    return (n + align - 1) & ~(align - 1)


def tensor_align(nbytes: int) -> int:
    """The alignment a client uses for a tensor of ``nbytes``: 64 B, or 4096 B from 1 MiB up."""
    return LARGE_ALIGN if nbytes >= LARGE_TENSOR else TENSOR_ALIGN


_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"64K"``, ``"1MiB"``, ``"520M"``, ``"4096"`` -> bytes (binary units).

    Raises:
        ValueError: the text is not a size.
    """
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64K, 16M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def format_size(nbytes: int) -> str:
    """Bytes as the shortest exact ``K``/``M``/``G`` form (``65536`` -> ``"64K"``)."""
    for unit, mult in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes % mult == 0 and nbytes >= mult:
            return f"{nbytes // mult}{unit}"
    return str(nbytes)


def format_size_approx(nbytes: int) -> str:
    """Bytes rounded for people (``"60.0 MiB"``, KiB/GiB when that reads better); :func:`format_size` is exact."""
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if nbytes >= mult:
            return f"{nbytes / mult:.1f} {unit}"
    if nbytes >= 1 << 10:
        return f"{nbytes / (1 << 10):.1f} KiB"
    return f"{nbytes} B"


class SizeClass(NamedTuple):
    """``n_slots`` slots of ``slot_nbytes`` each."""

    slot_nbytes: int
    n_slots: int


@dataclass(frozen=True)
class Geometry:
    """The slot layout of a region: size classes, smallest first, after a one-page superblock."""

    classes: tuple[SizeClass, ...]
    desc_nbytes: int = DESC_NBYTES

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("a region needs at least one size class")
        if len(self.classes) > _MAX_CLASSES:
            raise ValueError(f"at most {_MAX_CLASSES} size classes")
        if self.desc_nbytes % TENSOR_ALIGN or self.desc_nbytes < 256:
            raise ValueError("desc_nbytes must be a multiple of 64 and at least 256")
        for c in self.classes:
            if c.slot_nbytes % PAGE or c.slot_nbytes <= self.desc_nbytes:
                raise ValueError(
                    f"slot size {c.slot_nbytes} must be a multiple of {PAGE} and larger than "
                    f"the descriptor area ({self.desc_nbytes})"
                )
            if c.n_slots < 1:
                raise ValueError("every size class needs at least one slot")
        sizes = [c.slot_nbytes for c in self.classes]
        if sizes != sorted(set(sizes)):
            raise ValueError("size classes must be listed smallest first, each size once")
        offsets = []
        pos = SUPERBLOCK_NBYTES
        for c in self.classes:
            for _ in range(c.n_slots):
                offsets.append(pos)
                pos += c.slot_nbytes
        object.__setattr__(self, "_offsets", tuple(offsets))
        object.__setattr__(self, "_class_of", tuple(i for i, c in enumerate(self.classes) for _ in range(c.n_slots)))
        object.__setattr__(self, "_nbytes", pos)

    @property
    def n_slots(self) -> int:
        """Slots in the region, all classes together."""
        return len(self._offsets)  # type: ignore[attr-defined]

    @property
    def region_nbytes(self) -> int:
        """Bytes of the whole region, superblock included."""
        return self._nbytes  # type: ignore[attr-defined]

    @property
    def max_slot_nbytes(self) -> int:
        """The largest slot's size."""
        return self.classes[-1].slot_nbytes

    def slot_offset(self, slot: int) -> int:
        """Offset of ``slot`` from the region start."""
        return self._offsets[slot]  # type: ignore[attr-defined, no-any-return]

    def slot_nbytes(self, slot: int) -> int:
        """Size of ``slot`` in bytes."""
        return self.classes[self._class_of[slot]].slot_nbytes  # type: ignore[attr-defined]

    def class_of(self, slot: int) -> int:
        """Index of the size class ``slot`` belongs to."""
        return self._class_of[slot]  # type: ignore[attr-defined, no-any-return]

    def slots_of_class(self, cls: int) -> range:
        """The slot numbers of size class ``cls``."""
        first = sum(c.n_slots for c in self.classes[:cls])
        return range(first, first + self.classes[cls].n_slots)

    def spec(self) -> str:
        """The ``--slots`` text that builds this geometry (``"64K:64,1M:16"``)."""
        return ",".join(f"{format_size(c.slot_nbytes)}:{c.n_slots}" for c in self.classes)

    def to_json(self) -> dict[str, object]:
        """The geometry as told to clients at WELCOME."""
        return {"desc_nbytes": self.desc_nbytes, "classes": [list(c) for c in self.classes]}

    @classmethod
    def from_json(cls, obj: dict[str, object]) -> Geometry:
        """Inverse of :meth:`to_json`."""
        classes = tuple(SizeClass(int(a), int(b)) for a, b in obj["classes"])  # type: ignore[attr-defined]
        return cls(classes, int(obj["desc_nbytes"]))  # type: ignore[call-overload]


def parse_geometry(spec: str, desc_nbytes: int = DESC_NBYTES) -> Geometry:
    """``"64K:64,1M:16,520M:1"`` (slot size : count, smallest first) -> :class:`Geometry`.

    Raises:
        ValueError: the text is malformed or describes an invalid geometry.
    """
    classes = []
    for part in spec.split(","):
        size, sep, count = part.partition(":")
        if not sep:
            raise ValueError(f"slot class {part!r} must be SIZE:COUNT, e.g. 64K:64")
        classes.append(SizeClass(parse_size(size), int(count)))
    return Geometry(tuple(classes), desc_nbytes)


#: One 256 MiB tensor in and one out (520M), 64 MiB in place (80M), and many small ones at once.
DEFAULT_GEOMETRY = parse_geometry("64K:64,1M:16,16M:8,80M:4,520M:1")


class Superblock(NamedTuple):
    """The decoded superblock of a region."""

    magic: bytes
    layout_version: int
    desc_nbytes: int
    schema_hash: bytes
    worker_pid: int
    worker_start_ticks: int
    epoch: int
    region_nbytes: int
    classes: tuple[SizeClass, ...]

    @classmethod
    def for_geometry(cls, geometry: Geometry, *, worker_pid: int, worker_start_ticks: int, epoch: int) -> Superblock:
        """The superblock a worker writes for ``geometry``."""
        return cls(MAGIC, LAYOUT_VERSION, geometry.desc_nbytes, bytes.fromhex(SCHEMA_HASH), worker_pid,
                   worker_start_ticks, epoch, geometry.region_nbytes, geometry.classes)

    def pack_into(self, buf: memoryview) -> None:
        """Write the superblock at offset 0 of ``buf``."""
        _SB_HEAD.pack_into(buf, 0, self.magic, self.layout_version, self.desc_nbytes, self.schema_hash,
                           self.worker_pid, len(self.classes), self.worker_start_ticks, self.epoch,
                           self.region_nbytes)
        for i, c in enumerate(self.classes):
            _SB_CLASS.pack_into(buf, _SB_HEAD.size + i * _SB_CLASS.size, *c)

    @classmethod
    def unpack_from(cls, buf: memoryview | bytes) -> Superblock:
        """Read a superblock; raises ValueError when it is not a shmrpc region of this layout."""
        if len(buf) < SUPERBLOCK_NBYTES:
            raise ValueError("region smaller than its superblock")
        magic, version, desc, shash, pid, n_classes, ticks, epoch, nbytes = _SB_HEAD.unpack_from(buf, 0)
        if magic != MAGIC:
            raise ValueError("not a shmrpc region (bad magic)")
        if version != LAYOUT_VERSION:
            raise ValueError(f"region layout version {version}, this code reads {LAYOUT_VERSION}")
        if n_classes > _MAX_CLASSES:
            raise ValueError("superblock names too many size classes")
        classes = tuple(
            SizeClass(*_SB_CLASS.unpack_from(buf, _SB_HEAD.size + i * _SB_CLASS.size)) for i in range(n_classes)
        )
        return cls(magic, version, desc, shash, pid, ticks, epoch, nbytes, classes)

    def geometry(self) -> Geometry:
        """The slot geometry this superblock describes."""
        return Geometry(self.classes, self.desc_nbytes)
