"""The descriptor's FlatBuffers tables read and written by hand, for speed (the generated code stays the reference).

The generated Python (``_fb.py``) builds a message back to front through a generic builder and reads it through one
object and several calls per field; every first call of a signature pays both, and the worker's response too
(``bench/descriptor_codec.py`` times both codecs: this one about 2.5 to 4 times as fast). This module reads and writes the same binary format
(FlatBuffers' wire rules: a root offset, tables with a vtable, strings, vectors) for the five tables of
``shmrpc.fbs`` that a call carries, with one ``struct`` call per table or vector where it can.

Reading is defensive, as ``descriptor.py`` asks: every position is checked against the buffer before it is read (a
table's vtable and its fields inside the table's own size, a string's and a vector's length inside the buffer), so
hostile bytes raise :class:`Malformed` (which ``descriptor.py`` turns into ``InvalidRequestError``), never read
outside the buffer and never wrap around to its end. It is stricter than the generated reader (which slices strings
short and follows negative vtable offsets); a message the generated builder or this writer makes reads the same
through both (``tests/schema/test_flat.py`` checks both ways and against mutated bytes).

Writing lays the message out front to back: the root offset, then each table after its vtable, then the table's
strings, vectors and child tables after it (FlatBuffers' offsets to children point forward, the table's offset to
its vtable either way; equal vtables are written once). Scalars sit at their natural alignment, 8-byte fields of a
table first. Fields equal to their schema default are left out, as the generated builder does.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

__all__ = ["Malformed", "Reader", "Writer"]

_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_HH = struct.Struct("<HH")
_u32 = _U32.unpack_from
_i32 = _I32.unpack_from
_hh = _HH.unpack_from
_VT = [struct.Struct(f"<{k}H").unpack_from for k in range(9)]  # a vtable's first k field offsets
_VT_PACK = [struct.Struct(f"<HH{k}H").pack for k in range(9)]
_SIZE = {"B": 1, "H": 2, "i": 4, "Q": 8, "q": 8, "d": 8, "s": 4, "vq": 4, "vs": 4, "vt": 4}
_PACK = {k: struct.Struct("<" + k).pack_into for k in ("B", "H", "i", "Q", "q", "d")}


def _larger(f: tuple[int, int, str, Any]) -> int:
    return -f[0]


class Malformed(Exception):
    """The bytes break FlatBuffers' rules or a limit; ``field`` says where ("descriptor" for the structure)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Reader:
    """The tables of one buffer ``b`` (bytes): each method checks what it reads against ``len(b)``."""

    __slots__ = ("b", "n")

    def __init__(self, b: bytes) -> None:
        self.b, self.n = b, len(b)

    def root(self) -> int:
        """The root table's position."""
        if self.n < 8:
            raise Malformed("descriptor", "descriptor shorter than a FlatBuffers root")
        return self.at(0)

    def at(self, pos: int) -> int:
        """The position the offset at ``pos`` points to (a child table, string or vector: always forward)."""
        if pos + 4 > self.n:
            raise Malformed("descriptor", f"an offset at {pos} runs past the descriptor's {self.n} bytes")
        return pos + _u32(self.b, pos)[0]

    def table(self, pos: int, k: int) -> tuple[int, tuple[int, ...]]:
        """(table size, the first ``k`` fields' offsets in the table, 0 where absent) of the table at ``pos``."""
        n, b = self.n, self.b
        if pos + 4 > n:
            raise Malformed("descriptor", f"a table at {pos} runs past the descriptor's {n} bytes")
        vt = pos - _i32(b, pos)[0]
        if vt < 0 or vt + 4 > n:
            raise Malformed("descriptor", f"the table at {pos} has its vtable outside the descriptor")
        vt_nbytes, t_nbytes = _hh(b, vt)
        if vt_nbytes < 4 or vt_nbytes & 1 or vt + vt_nbytes > n or t_nbytes < 4 or pos + t_nbytes > n:
            raise Malformed("descriptor", f"the table at {pos} has a malformed vtable")
        have = (vt_nbytes - 4) >> 1
        if have >= k:
            return t_nbytes, _VT[k](b, vt + 4)
        return t_nbytes, _VT[have](b, vt + 4) + (0,) * (k - have)

    def scalar(self, pos: int, t_nbytes: int, voff: int, fmt: struct.Struct, default: Any) -> Any:
        """The scalar field at ``voff`` of the table at ``pos`` (``default`` when absent), inside the table."""
        if not voff:
            return default
        if voff + fmt.size > t_nbytes:
            raise Malformed("descriptor", f"a field of the table at {pos} lies outside the table")
        return fmt.unpack_from(self.b, pos + voff)[0]

    def ref(self, pos: int, t_nbytes: int, voff: int) -> int:
        """Where the offset field at ``voff`` of the table at ``pos`` points, or -1 when absent."""
        if not voff:
            return -1
        if voff + 4 > t_nbytes:
            raise Malformed("descriptor", f"a field of the table at {pos} lies outside the table")
        return self.at(pos + voff)

    def string(self, at: int) -> bytes:
        """The bytes of the string at ``at``."""
        if at + 4 > self.n:
            raise Malformed("descriptor", f"a string at {at} runs past the descriptor")
        end = at + 4 + _u32(self.b, at)[0]
        if end > self.n:
            raise Malformed("descriptor", f"a string at {at} runs past the descriptor")
        return self.b[at + 4:end]

    def vector(self, at: int, elem_nbytes: int, limit: int, field: str) -> int:
        """The length of the vector at ``at`` (elements of ``elem_nbytes`` from ``at + 4``), at most ``limit``."""
        if at + 4 > self.n:
            raise Malformed("descriptor", f"a vector at {at} runs past the descriptor")
        count = _u32(self.b, at)[0]
        if count > limit or count * elem_nbytes > self.n:
            raise Malformed(field, f"{field} has {count} entries, at most {limit} allowed")
        if at + 4 + count * elem_nbytes > self.n:
            raise Malformed("descriptor", f"{field} runs past the descriptor")
        return count


class Writer:
    """One message built front to back (:meth:`finish` writes it, given its root table).

    A table is given as a list of fields ``(slot, kind, value)``; ``kind`` is a ``struct`` format of one scalar
    (``"B"``, ``"H"``, ``"i"``, ``"Q"``, ``"q"``, ``"d"``), ``"s"`` (a string), ``"vq"`` (a vector of int64),
    ``"vs"`` (a vector of strings) or ``"vt"`` (a vector of tables, each a list of fields). Children follow their
    table in the order of its fields.
    """

    __slots__ = ("buf", "_vts")

    def __init__(self) -> None:
        self.buf = bytearray(4)  # the root offset, written by finish()
        self._vts: dict[bytes, int] = {}

    def finish(self, fields: Sequence[tuple[int, str, Any]]) -> bytes:
        """The message whose root table has ``fields``."""
        _U32.pack_into(self.buf, 0, self._table(fields))
        return bytes(self.buf)

    def _pad(self, align: int, plus: int = 0) -> int:
        """Zeros up to the next position p with (p + plus) % align == 0; returns p."""
        buf = self.buf
        p = len(buf)
        gap = -(p + plus) % align
        if gap:
            buf += bytes(gap)
        return p + gap

    def _table(self, fields: Sequence[tuple[int, str, Any]]) -> int:
        inline = sorted([(_SIZE[kind], slot, kind, value) for slot, kind, value in fields], key=_larger)
        n_slots = 1 + max([f[1] for f in inline], default=-1)
        voffs = [0] * n_slots
        t_nbytes = 4
        for size, slot, _, _ in inline:
            voffs[slot] = t_nbytes
            t_nbytes += size
        t_nbytes += -t_nbytes % 4
        vt = _VT_PACK[n_slots](4 + 2 * n_slots, t_nbytes, *voffs)
        vt_pos = self._vts.get(vt)
        if vt_pos is None:
            self._pad(2)
            vt_pos = self._vts[vt] = len(self.buf)
            self.buf += vt
        wide = bool(inline) and inline[0][0] == 8
        pos = self._pad(8, 4) if wide else self._pad(4)
        buf = self.buf
        buf += bytes(t_nbytes)
        _I32.pack_into(buf, pos, pos - vt_pos)
        later = []
        for size, slot, kind, value in inline:
            if size == 4 and kind != "i":
                later.append((pos + voffs[slot], kind, value))
            else:
                _PACK[kind](buf, pos + voffs[slot], value)
        for at, kind, value in later:
            _U32.pack_into(self.buf, at, self._child(kind, value) - at)
        return pos

    def _child(self, kind: str, value: Any) -> int:
        buf = self.buf
        if kind == "s":
            return self._string(value)
        if kind == "vq":
            pos = self._pad(8, 4)
            buf += struct.pack(f"<I{len(value)}q", len(value), *value)
            return pos
        pos = self._pad(4)
        buf += bytes(4 + 4 * len(value))
        _U32.pack_into(buf, pos, len(value))
        make = self._string if kind == "vs" else self._table
        for j, item in enumerate(value):
            at = pos + 4 + 4 * j
            _U32.pack_into(self.buf, at, make(item) - at)
        return pos

    def _string(self, s: str) -> int:
        raw = s.encode()
        pos = self._pad(4)
        self.buf += _U32.pack(len(raw)) + raw + b"\0"
        return pos
