"""Descriptors of one op's calls that differ only in numeric attribute values, made by patching bytes.

A caller whose attribute values change from call to call (``call("scale", x=x, a=t)`` with a new ``t`` each time)
makes a new descriptor every call; building FlatBuffers in Python is most of what that costs the client (about 26 µs
of 32 for a one-step call on the development machine). The bytes of two such descriptors differ only where the values
sit, as long as every value is encoded the same way: the encoder leaves a field equal to its default (0) out, so a
zero and a non-zero value lay the message out differently, and a bool or a string is part of the layout. So a
template is kept per *layout* (the op, the input tensors, the flags, the kept outputs, and per attribute its name, its
type and, for a number, whether it is zero; a bool's or a string's value itself): the descriptor encoded once with a
distinct sentinel in each non-zero number, and the position of each sentinel (found exactly once in the bytes, or no
template is made). A later descriptor of that layout is the template with the values packed over the sentinels: the
same bytes the encoder makes (``tests/schema/test_desc_template.py`` compares them), in a few µs.

The worker decodes and checks every descriptor as before: nothing here is trusted by it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from typing import Any

from ._caches import bounded_put

__all__ = ["DescTemplates"]

_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")
#: sentinels: values whose 8 bytes do not occur in a descriptor otherwise (each is checked to occur exactly once)
_FLOAT_SENTINEL = float.fromhex("0x1.5a3c96e1b7d2fp+301")
_INT_SENTINEL = 0x5A3C96E1B7D20000

Desc = tuple[bytes, int, int, tuple[str, ...]]


def layout_key(op: str, tensors: Any, attrs: Mapping[str, Any], flags: int, keep: tuple[str, ...]) -> Any:
    """The template's key of a descriptor (see the module's docstring), or None when it has no number to patch."""
    parts: list[Any] = [op, tensors, flags, keep]
    numbers = False
    for k, v in attrs.items():
        t = type(v)
        if t is float or t is int:
            parts += (k, t, v != 0)
            numbers = numbers or v != 0
        else:
            parts += (k, t, v)
    return tuple(parts) if numbers else None


class DescTemplates:
    """Templates of one client (see the module's docstring). ``encode(op, tensors, attrs, flags, keep)`` is the
    client's descriptor builder (``Client._encode``); ``kinds(op)`` the op table's attribute kinds of ``op``."""

    def __init__(self, encode: Callable[..., Desc], kinds: Callable[[str], Mapping[str, str] | None]) -> None:
        self._encode = encode
        self._kinds = kinds
        # layout key -> (template Desc, ((attr name, position, pack, as float), ...)), or None: no template possible
        self._made: dict[Any, tuple[Desc, tuple[tuple[str, int, Any, bool], ...]] | None] = {}

    def make(self, op: str, tensors: Any, attrs: Mapping[str, Any], flags: int, keep: tuple[str, ...]) -> Desc:
        """The descriptor of this call: from its layout's template when there is one (made at the layout's first
        call), else from the encoder."""
        key = layout_key(op, tensors, attrs, flags, keep)
        if key is None:
            return self._encode(op, tensors, attrs, flags, keep)
        try:
            made = self._made[key]
        except KeyError:
            made = self._template(op, tensors, attrs, flags, keep)
            bounded_put(self._made, key, made)
        if made is None:
            return self._encode(op, tensors, attrs, flags, keep)
        desc, spots = made
        buf = bytearray(desc[0])
        try:
            for name, pos, pack, as_float in spots:
                v = attrs[name]
                pack(buf, pos, float(v) if as_float else v)
        except (OverflowError, struct.error):  # a number past the wire's range: the encoder says so as it would
            return self._encode(op, tensors, attrs, flags, keep)
        return bytes(buf), desc[1], desc[2], desc[3]

    def _template(self, op: str, tensors: Any, attrs: Mapping[str, Any], flags: int, keep: tuple[str, ...]
                  ) -> tuple[Desc, tuple[tuple[str, int, Any, bool], ...]] | None:
        kinds = self._kinds(op)
        if kinds is None:
            return None
        sentinels: dict[str, Any] = {}
        spots: list[tuple[str, int, Any, bool]] = []
        marks: list[tuple[str, bytes, Any, bool]] = []
        for i, (k, v) in enumerate(attrs.items()):
            if type(v) not in (float, int) or v == 0:
                sentinels[k] = v
                continue
            kind = kinds.get(k)
            if kind == "float":  # (an int given for a float attribute travels as a float: the same bytes)
                s: Any = _FLOAT_SENTINEL * (1 + i / 64)
                sentinels[k] = s
                marks.append((k, _F64.pack(s), _F64.pack_into, True))
            elif kind == "int" and type(v) is int:
                s = _INT_SENTINEL + i
                sentinels[k] = s
                marks.append((k, _I64.pack(s), _I64.pack_into, False))
            else:  # not an attribute of the op, or of another kind: the encoder's error, every time
                return None
        desc = self._encode(op, tensors, sentinels, flags, keep)
        payload = desc[0]
        for k, pattern, pack, as_float in marks:
            pos = payload.find(pattern)
            if pos < 0 or payload.find(pattern, pos + 1) >= 0:
                return None
            spots.append((k, pos, pack, as_float))
        return desc, tuple(spots)
