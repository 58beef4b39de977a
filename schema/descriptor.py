"""Request and response descriptors: plain dataclasses <-> FlatBuffers bytes.

Both directions go through ``_flat.py``'s hand-written reader and writer of the same FlatBuffers
format (the generated code in ``_fb.py`` is the reference they are tested against: about 2.5 and 3.5
times as long to build and to read a one-step request, which every first call of a signature paid;
``bench/descriptor_codec.py``).
Decoding is defensive: it reads a ``bytes`` copy of exactly the payload (never
shared memory, which the writer could change under us), checks every vector
length against the buffer and the limits below before iterating, and turns any
malformation into :class:`~shmrpc.schema.errors.InvalidRequestError` naming the
field. It does not check tensors against a slot: that is the worker's job.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

from ._flat import Malformed, Reader, Writer
from .dtypes import DTYPE_NAMES, code_of
from .errors import InvalidRequestError

__all__ = [
    "AttrValue",
    "TensorRef",
    "StepDesc",
    "RequestDesc",
    "ResponseDesc",
    "encode_request",
    "decode_request",
    "encode_response",
    "decode_response",
    "MAX_STEPS",
    "MAX_TENSORS",
    "MAX_DIMS",
    "MAX_ATTRS",
    "MAX_NAME",
]

AttrValue = float | int | str | bool

MAX_STEPS = 32
MAX_TENSORS = 64
MAX_DIMS = 8
MAX_ATTRS = 16
MAX_NAME = 128


class TensorRef(NamedTuple):
    """A tensor of a request or response: in the slot at (offset, nbytes), or resident by name.

    A NamedTuple rather than a dataclass: it is hashed on every call (descriptor caches), and a
    tuple's hash is computed in C.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = 0
    nbytes: int = 0
    resident: str = ""


@dataclass(frozen=True)
class StepDesc:
    """One op of a pipeline: parameter -> tensor-name bindings and attributes."""

    op: str
    op_code: int
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    attrs: tuple[tuple[str, AttrValue], ...] = ()


@dataclass(frozen=True)
class RequestDesc:
    """A whole request descriptor."""

    steps: tuple[StepDesc, ...]
    inputs: tuple[TensorRef, ...]
    outputs: tuple[str, ...]
    keep: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResponseDesc:
    """A response descriptor: status 0 with outputs, or an error code with its location."""

    status: int = 0
    message: str = ""
    op: str = ""
    step: int = -1
    tensor: str = ""
    field: str = ""
    outputs: tuple[TensorRef, ...] = dataclasses.field(default_factory=tuple)


# ---------------------------------------------------------------- encoding
# Field slots of shmrpc.fbs's tables (declaration order); the generated code (_fb.py) is the reference.

_F64, _I64, _U64, _U16, _U8, _I32S = (struct.Struct(f) for f in ("<d", "<q", "<Q", "<H", "<B", "<i"))
_KIND_FLOAT, _KIND_INT, _KIND_STR, _KIND_BOOL = 0, 1, 2, 3  # enum AttrKind


def _tensor(t: TensorRef) -> list[tuple[int, str, Any]]:
    f: list[tuple[int, str, Any]] = [(0, "s", t.name), (1, "B", code_of(t.dtype)), (2, "vq", t.shape)]
    if t.offset:
        f.append((3, "Q", t.offset))
    if t.nbytes:
        f.append((4, "Q", t.nbytes))
    if t.resident:
        f.append((5, "s", t.resident))
    return f


def _attr(name: str, value: AttrValue) -> list[tuple[int, str, Any]]:
    f: list[tuple[int, str, Any]] = [(0, "s", name)]
    if isinstance(value, bool):
        f.append((1, "B", _KIND_BOOL))
        if value:
            f.append((3, "q", 1))
    elif isinstance(value, int):
        f.append((1, "B", _KIND_INT))
        if value:
            f.append((3, "q", value))
    elif isinstance(value, float):
        if value != 0.0:
            f.append((2, "d", value))
    else:
        f += [(1, "B", _KIND_STR), (4, "s", value)]
    return f


def _step(s: StepDesc) -> list[tuple[int, str, Any]]:
    f: list[tuple[int, str, Any]] = [(0, "s", s.op)]
    if s.op_code:
        f.append((1, "H", s.op_code))
    return f + [(2, "vt", [[(0, "s", p), (1, "s", t)] for p, t in s.inputs]),
                (3, "vt", [[(0, "s", p), (1, "s", t)] for p, t in s.outputs]),
                (4, "vt", [_attr(k, v) for k, v in s.attrs])]


def encode_request(req: RequestDesc) -> bytes:
    """The FlatBuffers bytes of ``req``."""
    return Writer().finish([(0, "vt", [_step(s) for s in req.steps]), (1, "vt", [_tensor(t) for t in req.inputs]),
                            (2, "vs", req.outputs), (3, "vs", req.keep)])


def encode_response(resp: ResponseDesc) -> bytes:
    """The FlatBuffers bytes of ``resp``."""
    f: list[tuple[int, str, Any]] = [(6, "vt", [_tensor(t) for t in resp.outputs])]
    if resp.status:
        f.append((0, "H", resp.status))
    for slot, s in ((1, resp.message), (2, resp.op), (4, resp.tensor), (5, resp.field)):
        if s:
            f.append((slot, "s", s))
    if resp.step != -1:
        f.append((3, "i", resp.step))
    return Writer().finish(f)


# ---------------------------------------------------------------- decoding


def _name(r: Reader, at: int, field: str, required: bool = True) -> str:
    if at < 0:
        if required:
            raise Malformed(field, f"{field} is missing")
        return ""
    raw = r.string(at)
    if len(raw) > MAX_NAME:
        raise Malformed(field, f"{field} is longer than {MAX_NAME} bytes")
    return raw.decode("utf-8")


def _dec_tensor(r: Reader, pos: int, field: str) -> TensorRef:
    tn, (name, dtype, shape, offset, nbytes, resident) = r.table(pos, 6)
    nm = _name(r, r.ref(pos, tn, name), f"{field}.name")
    code = r.scalar(pos, tn, dtype, _U8, 0)
    if code not in DTYPE_NAMES:
        raise Malformed(f"{field}.dtype", f"tensor {nm!r} has unknown dtype code {code}")
    at = r.ref(pos, tn, shape)
    dims: tuple[int, ...] = ()
    if at >= 0:
        ndim = r.vector(at, 8, MAX_DIMS, f"{field}.shape")
        dims = struct.unpack_from(f"<{ndim}q", r.b, at + 4)
    return TensorRef(nm, DTYPE_NAMES[code], dims, r.scalar(pos, tn, offset, _U64, 0), r.scalar(pos, tn, nbytes, _U64, 0),
                     _name(r, r.ref(pos, tn, resident), f"{field}.resident", required=False))


def _dec_attr(r: Reader, pos: int, field: str) -> tuple[str, AttrValue]:
    tn, (name, kind_at, f, i, s) = r.table(pos, 5)
    nm = _name(r, r.ref(pos, tn, name), f"{field}.name")
    kind = r.scalar(pos, tn, kind_at, _U8, 0)
    if kind == _KIND_FLOAT:
        return nm, float(r.scalar(pos, tn, f, _F64, 0.0))
    if kind == _KIND_INT:
        return nm, int(r.scalar(pos, tn, i, _I64, 0))
    if kind == _KIND_BOOL:
        return nm, bool(r.scalar(pos, tn, i, _I64, 0))
    if kind == _KIND_STR:
        return nm, _name(r, r.ref(pos, tn, s), f"{field}.s", required=False)
    raise Malformed(f"{field}.kind", f"attribute {nm!r} has unknown kind {kind}")


def _items(r: Reader, at: int, limit: int, field: str) -> list[int]:
    """The positions the offset vector at ``at`` (absent: -1) points to."""
    if at < 0:
        return []
    return [r.at(at + 4 + 4 * j) for j in range(r.vector(at, 4, limit, field))]


def _dec_bindings(r: Reader, at: int, field: str) -> tuple[tuple[str, str], ...]:
    out = []
    for j, pos in enumerate(_items(r, at, MAX_TENSORS, field)):
        tn, (p, t) = r.table(pos, 2)
        out.append((_name(r, r.ref(pos, tn, p), f"{field}[{j}].param"), _name(r, r.ref(pos, tn, t), f"{field}[{j}].tensor")))
    return tuple(out)


def _dec_step(r: Reader, pos: int, i: int) -> StepDesc:
    f = f"steps[{i}]"
    tn, (op, code, ins, outs, attrs) = r.table(pos, 5)
    name = _name(r, r.ref(pos, tn, op), f"{f}.op")
    return StepDesc(name, r.scalar(pos, tn, code, _U16, 0), _dec_bindings(r, r.ref(pos, tn, ins), f"{f}.inputs"),
                    _dec_bindings(r, r.ref(pos, tn, outs), f"{f}.outputs"),
                    tuple(_dec_attr(r, p, f"{f}.attrs[{j}]")
                          for j, p in enumerate(_items(r, r.ref(pos, tn, attrs), MAX_ATTRS, f"{f}.attrs"))))


def _guard(what: str, buf: bytes, fn):  # type: ignore[no-untyped-def]
    """Run a decoder; any malformation becomes InvalidRequestError naming the field."""
    try:
        return fn(Reader(buf))
    except Malformed as e:
        raise InvalidRequestError(str(e), field=e.field) from None
    except Exception as e:  # noqa: BLE001 - arbitrary bytes may break the reader anywhere (bad UTF-8, say)
        raise InvalidRequestError(f"{what} is not a valid FlatBuffers message ({type(e).__name__})", field="descriptor") from None


def decode_request(buf: bytes) -> RequestDesc:
    """Parse request descriptor bytes (a copy, not shared memory).

    Raises:
        InvalidRequestError: malformed, over a limit, or an unknown dtype/attr kind; ``field`` says where.
    """

    def dec(r: Reader) -> RequestDesc:
        pos = r.root()
        tn, (steps, inputs, outputs, keep) = r.table(pos, 4)
        return RequestDesc(
            tuple(_dec_step(r, p, i) for i, p in enumerate(_items(r, r.ref(pos, tn, steps), MAX_STEPS, "steps"))),
            tuple(_dec_tensor(r, p, f"inputs[{i}]")
                  for i, p in enumerate(_items(r, r.ref(pos, tn, inputs), MAX_TENSORS, "inputs"))),
            tuple(_name(r, p, f"outputs[{i}]") for i, p in enumerate(_items(r, r.ref(pos, tn, outputs), MAX_TENSORS, "outputs"))),
            tuple(_name(r, p, f"keep[{i}]") for i, p in enumerate(_items(r, r.ref(pos, tn, keep), MAX_TENSORS, "keep"))),
        )

    return _guard("request descriptor", buf, dec)  # type: ignore[no-any-return]


def decode_response(buf: bytes) -> ResponseDesc:
    """Parse response descriptor bytes.

    Raises:
        InvalidRequestError: the bytes are not a valid response (the worker broke the contract).
    """

    def dec(r: Reader) -> ResponseDesc:
        pos = r.root()
        tn, (status, message, op, step, tensor, field, outputs) = r.table(pos, 7)
        outs = tuple(_dec_tensor(r, p, f"outputs[{i}]")
                     for i, p in enumerate(_items(r, r.ref(pos, tn, outputs), MAX_TENSORS, "outputs")))

        def s(voff: int) -> str:
            at = r.ref(pos, tn, voff)
            return r.string(at).decode("utf-8", "replace") if at >= 0 else ""

        return ResponseDesc(r.scalar(pos, tn, status, _U16, 0), s(message), s(op), r.scalar(pos, tn, step, _I32S, -1),
                            s(tensor), s(field), outs)

    return _guard("response descriptor", buf, dec)  # type: ignore[no-any-return]
