"""The descriptor codec as the generated FlatBuffers code (``schema/_fb.py``) builds and reads it: the reference
that ``schema/_flat.py``'s hand-written reader and writer are checked against (``tests/schema/test_flat.py``).

This is the product's codec as it stood before the hand-written one (2026-12-04), kept verbatim but for names.
"""

from __future__ import annotations

import flatbuffers

from shmrpc.schema import _fb as fb
from shmrpc.schema.descriptor import (
    MAX_ATTRS,
    MAX_DIMS,
    MAX_NAME,
    MAX_STEPS,
    MAX_TENSORS,
    AttrValue,
    RequestDesc,
    ResponseDesc,
    StepDesc,
    TensorRef,
)
from shmrpc.schema.dtypes import DTYPE_NAMES, code_of
from shmrpc.schema.errors import InvalidRequestError

# ---------------------------------------------------------------- encoding


def _strings(b: flatbuffers.Builder, items: tuple[str, ...], start) -> int:  # type: ignore[no-untyped-def]
    offs = [b.CreateString(s) for s in items]
    start(b, len(offs))
    for o in reversed(offs):
        b.PrependUOffsetTRelative(o)
    return b.EndVector()


def _tables(b: flatbuffers.Builder, offs: list[int], start) -> int:  # type: ignore[no-untyped-def]
    start(b, len(offs))
    for o in reversed(offs):
        b.PrependUOffsetTRelative(o)
    return b.EndVector()


def _tensor(b: flatbuffers.Builder, t: TensorRef) -> int:
    name = b.CreateString(t.name)
    resident = b.CreateString(t.resident) if t.resident else 0
    fb.TensorStartShapeVector(b, len(t.shape))
    for d in reversed(t.shape):
        b.PrependInt64(d)
    shape = b.EndVector()
    fb.TensorStart(b)
    fb.TensorAddName(b, name)
    fb.TensorAddDtype(b, code_of(t.dtype))
    fb.TensorAddShape(b, shape)
    fb.TensorAddOffset(b, t.offset)
    fb.TensorAddNbytes(b, t.nbytes)
    if resident:
        fb.TensorAddResident(b, resident)
    return fb.TensorEnd(b)  # type: ignore[no-any-return]


def _binding(b: flatbuffers.Builder, param: str, tensor: str) -> int:
    p, t = b.CreateString(param), b.CreateString(tensor)
    fb.BindingStart(b)
    fb.BindingAddParam(b, p)
    fb.BindingAddTensor(b, t)
    return fb.BindingEnd(b)  # type: ignore[no-any-return]


def _attr(b: flatbuffers.Builder, name: str, value: AttrValue) -> int:
    n = b.CreateString(name)
    s = b.CreateString(value) if isinstance(value, str) else 0
    fb.AttrStart(b)
    fb.AttrAddName(b, n)
    if isinstance(value, bool):
        fb.AttrAddKind(b, fb.AttrKind.bool_)
        fb.AttrAddI(b, int(value))
    elif isinstance(value, int):
        fb.AttrAddKind(b, fb.AttrKind.int_)
        fb.AttrAddI(b, value)
    elif isinstance(value, float):
        fb.AttrAddKind(b, fb.AttrKind.float_)
        fb.AttrAddF(b, value)
    else:
        fb.AttrAddKind(b, fb.AttrKind.str_)
        fb.AttrAddS(b, s)
    return fb.AttrEnd(b)  # type: ignore[no-any-return]


def _step(b: flatbuffers.Builder, s: StepDesc) -> int:
    op = b.CreateString(s.op)
    ins = _tables(b, [_binding(b, p, t) for p, t in s.inputs], fb.StepStartInputsVector)
    outs = _tables(b, [_binding(b, p, t) for p, t in s.outputs], fb.StepStartOutputsVector)
    attrs = _tables(b, [_attr(b, k, v) for k, v in s.attrs], fb.StepStartAttrsVector)
    fb.StepStart(b)
    fb.StepAddOp(b, op)
    fb.StepAddOpCode(b, s.op_code)
    fb.StepAddInputs(b, ins)
    fb.StepAddOutputs(b, outs)
    fb.StepAddAttrs(b, attrs)
    return fb.StepEnd(b)  # type: ignore[no-any-return]


def encode_request(req: RequestDesc) -> bytes:
    """The FlatBuffers bytes of ``req``."""
    b = flatbuffers.Builder(256)
    steps = _tables(b, [_step(b, s) for s in req.steps], fb.RequestStartStepsVector)
    inputs = _tables(b, [_tensor(b, t) for t in req.inputs], fb.RequestStartInputsVector)
    outputs = _strings(b, req.outputs, fb.RequestStartOutputsVector)
    keep = _strings(b, req.keep, fb.RequestStartKeepVector)
    fb.RequestStart(b)
    fb.RequestAddSteps(b, steps)
    fb.RequestAddInputs(b, inputs)
    fb.RequestAddOutputs(b, outputs)
    fb.RequestAddKeep(b, keep)
    b.Finish(fb.RequestEnd(b))
    return bytes(b.Output())


def encode_response(resp: ResponseDesc) -> bytes:
    """The FlatBuffers bytes of ``resp``."""
    b = flatbuffers.Builder(256)
    outs = _tables(b, [_tensor(b, t) for t in resp.outputs], fb.ResponseStartOutputsVector)
    strs = [b.CreateString(s) if s else 0 for s in (resp.message, resp.op, resp.tensor, resp.field)]
    fb.ResponseStart(b)
    fb.ResponseAddStatus(b, resp.status)
    for off, add in zip(strs, (fb.ResponseAddMessage, fb.ResponseAddOp, fb.ResponseAddTensor, fb.ResponseAddField)):
        if off:
            add(b, off)
    fb.ResponseAddStep(b, resp.step)
    fb.ResponseAddOutputs(b, outs)
    b.Finish(fb.ResponseEnd(b))
    return bytes(b.Output())


# ---------------------------------------------------------------- decoding


class _Bad(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _count(n: int, limit: int, field: str, buf_len: int, elem_nbytes: int = 4) -> int:
    if n > limit or n * elem_nbytes > buf_len:
        raise _Bad(field, f"{field} has {n} entries, at most {limit} allowed")
    return n


def _name(raw: bytes | None, field: str, required: bool = True) -> str:
    if raw is None:
        if required:
            raise _Bad(field, f"{field} is missing")
        return ""
    if len(raw) > MAX_NAME:
        raise _Bad(field, f"{field} is longer than {MAX_NAME} bytes")
    return raw.decode("utf-8")


def _dec_tensor(t: fb.Tensor, field: str, n: int) -> TensorRef:
    name = _name(t.Name(), f"{field}.name")
    code = t.Dtype()
    if code not in DTYPE_NAMES:
        raise _Bad(f"{field}.dtype", f"tensor {name!r} has unknown dtype code {code}")
    ndim = _count(t.ShapeLength(), MAX_DIMS, f"{field}.shape", n, 8)
    shape = tuple(t.Shape(j) for j in range(ndim))
    resident = _name(t.Resident(), f"{field}.resident", required=False)
    return TensorRef(name, DTYPE_NAMES[code], shape, t.Offset(), t.Nbytes(), resident)


def _dec_attr(a: fb.Attr, field: str) -> tuple[str, AttrValue]:
    name = _name(a.Name(), f"{field}.name")
    kind = a.Kind()
    if kind == fb.AttrKind.float_:
        return name, float(a.F())
    if kind == fb.AttrKind.int_:
        return name, int(a.I())
    if kind == fb.AttrKind.bool_:
        return name, bool(a.I())
    if kind == fb.AttrKind.str_:
        return name, _name(a.S(), f"{field}.s", required=False)
    raise _Bad(f"{field}.kind", f"attribute {name!r} has unknown kind {kind}")


def _dec_bindings(step: fb.Step, length: int, get, field: str, n: int) -> tuple[tuple[str, str], ...]:  # type: ignore[no-untyped-def]
    out = []
    for j in range(_count(length, MAX_TENSORS, field, n)):
        bnd = get(j)
        out.append((_name(bnd.Param(), f"{field}[{j}].param"), _name(bnd.Tensor(), f"{field}[{j}].tensor")))
    return tuple(out)


def _dec_step(s: fb.Step, i: int, n: int) -> StepDesc:
    f = f"steps[{i}]"
    op = _name(s.Op(), f"{f}.op")
    ins = _dec_bindings(s, s.InputsLength(), s.Inputs, f"{f}.inputs", n)
    outs = _dec_bindings(s, s.OutputsLength(), s.Outputs, f"{f}.outputs", n)
    attrs = tuple(_dec_attr(s.Attrs(j), f"{f}.attrs[{j}]") for j in range(_count(s.AttrsLength(), MAX_ATTRS, f"{f}.attrs", n)))
    return StepDesc(op, s.OpCode(), ins, outs, attrs)


def _guard(what: str, buf: bytes, fn):  # type: ignore[no-untyped-def]
    """Run a decoder; any malformation becomes InvalidRequestError naming the field."""
    try:
        return fn(buf)
    except _Bad as e:
        raise InvalidRequestError(str(e), field=e.field) from None
    except Exception as e:  # noqa: BLE001 - arbitrary bytes may break the generated reader anywhere
        raise InvalidRequestError(f"{what} is not a valid FlatBuffers message ({type(e).__name__})", field="descriptor") from None


def decode_request(buf: bytes) -> RequestDesc:
    """Parse request descriptor bytes (a copy, not shared memory).

    Raises:
        InvalidRequestError: malformed, over a limit, or an unknown dtype/attr kind; ``field`` says where.
    """

    def dec(b: bytes) -> RequestDesc:
        n = len(b)
        if n < 8:
            raise _Bad("descriptor", "descriptor shorter than a FlatBuffers root")
        r = fb.Request.GetRootAs(b, 0)
        steps = tuple(_dec_step(r.Steps(i), i, n) for i in range(_count(r.StepsLength(), MAX_STEPS, "steps", n)))
        inputs = tuple(
            _dec_tensor(r.Inputs(i), f"inputs[{i}]", n) for i in range(_count(r.InputsLength(), MAX_TENSORS, "inputs", n))
        )
        outputs = tuple(
            _name(r.Outputs(i), f"outputs[{i}]") for i in range(_count(r.OutputsLength(), MAX_TENSORS, "outputs", n))
        )
        keep = tuple(_name(r.Keep(i), f"keep[{i}]") for i in range(_count(r.KeepLength(), MAX_TENSORS, "keep", n)))
        return RequestDesc(steps, inputs, outputs, keep)

    return _guard("request descriptor", buf, dec)  # type: ignore[no-any-return]


def decode_response(buf: bytes) -> ResponseDesc:
    """Parse response descriptor bytes.

    Raises:
        InvalidRequestError: the bytes are not a valid response (the worker broke the contract).
    """

    def dec(b: bytes) -> ResponseDesc:
        n = len(b)
        r = fb.Response.GetRootAs(b, 0)
        outs = tuple(
            _dec_tensor(r.Outputs(i), f"outputs[{i}]", n) for i in range(_count(r.OutputsLength(), MAX_TENSORS, "outputs", n))
        )

        def s(x: bytes | None) -> str:
            return x.decode("utf-8", "replace") if x else ""

        return ResponseDesc(r.Status(), s(r.Message()), s(r.Op()), r.Step(), s(r.Tensor()), s(r.Field()), outs)

    return _guard("response descriptor", buf, dec)  # type: ignore[no-any-return]
