"""The op table: what the worker announces at WELCOME about each op, built and parsed here.

The WELCOME's ``op_table`` is a JSON object, op name -> entry, listed by code::

    {"scale": {"code": 3, "inputs": ["x"], "outputs": ["out"],
               "attrs": {"a": {"kind": "float", "default": 1.0, "required": false}, ...},
               "inplace": true, "alias": false, "doc": "out = a * x + b",
               "backends": ["numpy", "cupy"]}, ...}

=========  ===============  ==============================================================
key        JSON type        meaning
=========  ===============  ==============================================================
code       int 1..65535     the op's stable wire code (header ``op_code``, ``Step.op_code``)
inputs     [str]            tensor parameters, in order (a step binds each to a tensor)
outputs    [str]            output parameters, in order
attrs      {str: attr}      attribute -> ``{"kind", "default", "required"}``; ``kind`` is one
                            of ``float``, ``int``, ``str``, ``bool``; ``default`` is null
                            when ``required``
inplace    bool             output 0 may overwrite input 0 (request flag ``IN_PLACE``)
alias      bool             output 0 *is* input 0: nothing is computed (``echo``)
doc        str              one line for people
backends   [str]            the backends the op has an implementation for, of ``numpy``,
                            ``cupy`` (a request for an op without the worker's backend is
                            refused with KernelError field ``op``); absent: unknown
=========  ===============  ==============================================================

Codes below 4096 (0x1000) are the built-in ops'; users' ops (loaded with ``shmrpc serve
--ops``) have codes in 4096..65535.

Keys not listed are ignored by :func:`parse_op_table` (a newer worker may add some); a
listed key with the wrong type, a code out of range or twice, or an unknown attribute kind
is a :class:`ValueError` naming the op and the key.

The worker's kernels produce this table as plain data (they do not import the schema); the
worker passes it through :func:`parse_op_table` and :func:`build_op_table` before sending it,
and the client parses it with :func:`parse_op_table`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ATTR_KINDS", "USER_CODE_MIN", "AttrEntry", "OpEntry", "build_op_table", "parse_op_table", "fits_kind",
           "with_article"]

ATTR_KINDS: tuple[str, ...] = ("float", "int", "str", "bool")
_KIND_TYPES: dict[str, tuple[type, ...]] = {"float": (float, int), "int": (int,), "str": (str,), "bool": (bool,)}


def fits_kind(kind: str, value: object) -> bool:
    """Whether ``value`` is a Python value of attribute kind ``kind`` (an int is a float's; a bool is only a bool's)."""
    return isinstance(value, _KIND_TYPES.get(kind, ())) and (kind == "bool" or not isinstance(value, bool))


def with_article(word: str) -> str:
    """``word`` after its indefinite article, by its first letter: "a float", "an int"."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"
_MAX_NAME = 128
#: Op codes from here up are users' ops; below, the built-in ones.
USER_CODE_MIN = 0x1000


@dataclass(frozen=True)
class AttrEntry:
    """An op attribute: its kind, and its default unless ``required``."""

    kind: str
    default: float | int | str | bool | None = None
    required: bool = False

    def to_json(self) -> dict[str, Any]:
        """The attribute's JSON object."""
        return {"kind": self.kind, "default": None if self.required else self.default, "required": self.required}


@dataclass(frozen=True)
class OpEntry:
    """One op of the table (see the module docstring for the meaning of each field).

    Example::

        >>> OpEntry("scale", 3, ("x",), ("out",), {"a": AttrEntry("float", 1.0)}).to_json()["code"]
        3
    """

    name: str
    code: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, AttrEntry] = field(default_factory=dict)
    inplace: bool = False
    alias: bool = False
    doc: str = ""
    backends: tuple[str, ...] = ()

    @property
    def builtin(self) -> bool:
        """True for the worker's built-in ops (codes below :data:`USER_CODE_MIN`)."""
        return self.code < USER_CODE_MIN

    def to_json(self) -> dict[str, Any]:
        """The entry's JSON object (without the name, which is its key in the table)."""
        return {"code": self.code, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "attrs": {a: s.to_json() for a, s in self.attrs.items()},
                "inplace": self.inplace, "alias": self.alias, "doc": self.doc, "backends": list(self.backends)}

    @classmethod
    def from_json(cls, name: str, obj: Any) -> OpEntry:
        """Parse and check one entry; raises ValueError naming the op and the key."""

        def bad(key: str, want: str) -> ValueError:
            return ValueError(f"op table entry {name!r}: {key} must be {want}")

        if not isinstance(name, str) or not 0 < len(name.encode()) <= _MAX_NAME:
            raise ValueError(f"op table: op name {name!r} must be a string of 1..{_MAX_NAME} bytes")
        if not isinstance(obj, dict):
            raise bad("the entry", "an object")
        code = obj.get("code")
        if not isinstance(code, int) or isinstance(code, bool) or not 1 <= code <= 0xFFFF:
            raise bad("code", "an integer 1..65535")
        names = {}
        for key in ("inputs", "outputs"):
            v = obj.get(key, [])
            if not isinstance(v, list) or not all(isinstance(p, str) and p for p in v):
                raise bad(key, "a list of names")
            names[key] = tuple(v)
        raw_attrs = obj.get("attrs", {})
        if not isinstance(raw_attrs, dict):
            raise bad("attrs", "an object")
        attrs = {a: _attr(name, a, s) for a, s in raw_attrs.items()}
        flags = {}
        for key in ("inplace", "alias"):
            v = obj.get(key, False)
            if not isinstance(v, bool):
                raise bad(key, "true or false")
            flags[key] = v
        doc = obj.get("doc", "")
        if not isinstance(doc, str):
            raise bad("doc", "a string")
        backends = obj.get("backends", [])
        if not isinstance(backends, list) or not all(isinstance(b, str) and b for b in backends):
            raise bad("backends", "a list of names")
        return cls(name, code, names["inputs"], names["outputs"], attrs, flags["inplace"], flags["alias"], doc,
                   tuple(backends))


def _attr(op: str, name: str, obj: Any) -> AttrEntry:
    where = f"op table entry {op!r}: attribute {name!r}"
    if not isinstance(obj, dict):
        raise ValueError(f"{where} must be an object")
    kind, required = obj.get("kind"), obj.get("required", False)
    default: Any = obj.get("default")
    if kind not in ATTR_KINDS:
        raise ValueError(f"{where} has kind {kind!r}, not one of {', '.join(ATTR_KINDS)}")
    if not isinstance(required, bool):
        raise ValueError(f"{where}: required must be true or false")
    if required:
        default = None
    elif default is not None and not fits_kind(kind, default):
        raise ValueError(f"{where}: default {default!r} is not {with_article(kind)}")
    return AttrEntry(kind, default, required)


def parse_op_table(obj: Any) -> dict[str, OpEntry]:
    """A WELCOME's ``op_table`` (or the kernels' plain table) -> ``{name: OpEntry}``.

    Raises:
        ValueError: not an object, a malformed entry, or a code used twice.
    """
    if not isinstance(obj, dict):
        raise ValueError("op table must be an object of op name -> entry")
    table = {name: OpEntry.from_json(name, entry) for name, entry in obj.items()}
    by_code: dict[int, str] = {}
    for e in table.values():
        if e.code in by_code:
            raise ValueError(f"op table: ops {by_code[e.code]!r} and {e.name!r} share code {e.code}")
        by_code[e.code] = e.name
    return table


def build_op_table(entries: Iterable[OpEntry]) -> dict[str, dict[str, Any]]:
    """The JSON-able ``op_table`` of ``entries``, listed by code.

    Raises:
        ValueError: two entries share a name or a code.
    """
    out: dict[str, dict[str, Any]] = {}
    codes: set[int] = set()
    for e in sorted(entries, key=lambda e: e.code):
        if e.name in out or e.code in codes:
            raise ValueError(f"op table: {e.name!r} (code {e.code}) is listed twice")
        out[e.name] = e.to_json()
        codes.add(e.code)
    return out
