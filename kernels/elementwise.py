"""Elementwise ops: echo, vector_add, scale, gelu.

Each implementation is written once against ``call.xp`` (NumPy or CuPy): the NumPy twin
and the CuPy version are the same function, run on different arrays. Arithmetic on
float16/bfloat16 runs in float32 and is rounded once at the end; float32/float64 run
in their own dtype and write straight into the destination (``out=``) when there is one.

All four are ``batch=True``: each implementation is shape-agnostic (NumPy/CuPy ufuncs,
``copyto``, the bfloat16 conversions and the fused CuPy ``axpb`` kernel work elementwise over
any shape), so a stack of B requests with one more leading axis runs unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._common import TOL_ELEMENTWISE, require_dtype, require_float, require_same
from ._dtypes import DTYPE_NAMES, bf16_to_f32, from_float, to_float
from ._registry import NUMPY_BOUND, AttrSpec, OpCall, OpSpec, TensorSpec
from .api import register_op

__all__ = ["ECHO", "VECTOR_ADD", "SCALE", "GELU", "gelu_float"]

_EX = TensorSpec((4, 8), "float16")
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _same_as_x(inputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> dict[str, TensorSpec]:
    return {"out": inputs["x"]}


def _echo(call: OpCall) -> dict[str, Any]:
    x, d = call.inputs["x"], call.dest("out")
    if d is None or d is x:
        return {"out": x}
    call.xp.copyto(d, x)
    return {"out": d}


def _bound_echo(ins: Mapping[str, Any], dests: Mapping[str, Any], in_specs: Mapping[str, TensorSpec],
                attrs: Mapping[str, Any]) -> Any:
    x, d, copyto = ins["x"], dests.get("out"), np.copyto
    if d is None or d is x:
        return None
    return lambda: copyto(d, x)


ECHO = register_op(OpSpec(
    name="echo", code=1, inputs=("x",), outputs=("out",), attrs={}, infer=_same_as_x,
    numpy=_echo, cupy=_echo, inplace=True, alias=True, elementwise=True, batch=True,
    tolerances={n: (0.0, 0.0) for n in DTYPE_NAMES},
    doc="out = x (any dtype, any shape). Alias: output 0 is input 0; a copy happens only when the "
        "caller gives a distinct destination.",
    example={"x": _EX},
))


def _infer_vector_add(inputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> dict[str, TensorSpec]:
    x, y = inputs["x"], inputs["y"]
    require_dtype(x, [n for n in DTYPE_NAMES if n != "bool"], "x")
    require_same(x, y, "y", "x")
    return {"out": x}


def _vector_add(call: OpCall) -> dict[str, Any]:
    xp, x, y, d = call.xp, call.inputs["x"], call.inputs["y"], call.dest("out")
    dt = call.in_specs["x"].dtype
    if dt == "bfloat16":
        f = bf16_to_f32(xp, x)
        f += bf16_to_f32(xp, y)
        return {"out": from_float(xp, f, dt, d)}
    return {"out": xp.add(x, y, out=d)}


def _bound_vector_add(ins: Mapping[str, Any], dests: Mapping[str, Any], in_specs: Mapping[str, TensorSpec],
                      attrs: Mapping[str, Any]) -> Any:
    x, y, d, add = ins["x"], ins["y"], dests.get("out"), np.add
    if d is None or in_specs["x"].dtype == "bfloat16":
        return None
    return lambda: add(x, y, d)  # out= given by position: the ufunc's keyword path costs more


VECTOR_ADD = register_op(OpSpec(
    name="vector_add", code=2, inputs=("x", "y"), outputs=("out",), attrs={}, infer=_infer_vector_add,
    numpy=_vector_add, cupy=_vector_add, inplace=True, elementwise=True, batch=True, tolerances=TOL_ELEMENTWISE,
    doc="out = x + y, elementwise. x and y: same shape (no broadcasting) and dtype, any dtype but bool; "
        "integers wrap around; bfloat16 adds in float32 and rounds to nearest even. In place allowed (out over x).",
    example={"x": _EX, "y": _EX},
))


def _infer_scale(inputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> dict[str, TensorSpec]:
    require_float(inputs["x"], "x")
    return {"out": inputs["x"]}


_AXPB: dict[int, Any] = {}


def _fused_axpb(xp: Any) -> Any:
    """``y = a*x + b`` as one CuPy kernel (one read, one write, one launch), built once."""
    k = _AXPB.get(id(xp))
    if k is None:
        k = _AXPB[id(xp)] = xp.ElementwiseKernel("T x, T a, T b", "T y", "y = a * x + b", "shmrpc_axpb")
    return k


def _scale(call: OpCall) -> dict[str, Any]:
    xp, x, d = call.xp, call.inputs["x"], call.dest("out")
    a, b = call.attrs["a"], call.attrs["b"]
    dt = call.in_specs["x"].dtype
    if dt in ("float32", "float64") and xp.__name__ == "cupy":
        t = x.dtype.type
        return {"out": _fused_axpb(xp)(x, t(a), t(b), d) if d is not None else _fused_axpb(xp)(x, t(a), t(b))}
    if dt in ("float32", "float64"):
        r = xp.multiply(x, a, out=d)
        return {"out": xp.add(r, b, out=r)}
    f = to_float(xp, x, dt)  # a fresh float32 array for float16/bfloat16
    f *= a
    f += b
    return {"out": from_float(xp, f, dt, d)}


def _bound_scale(ins: Mapping[str, Any], dests: Mapping[str, Any], in_specs: Mapping[str, TensorSpec],
                 attrs: Mapping[str, Any]) -> Any:
    x, d, a, b, multiply, add = ins["x"], dests.get("out"), attrs["a"], attrs["b"], np.multiply, np.add
    if d is None or in_specs["x"].dtype not in ("float32", "float64"):
        return None

    def run() -> None:
        multiply(x, a, out=d)
        add(d, b, out=d)
    return run


SCALE = register_op(OpSpec(
    name="scale", code=3, inputs=("x",), outputs=("out",),
    attrs={"a": AttrSpec("float", 1.0), "b": AttrSpec("float", 0.0)}, infer=_infer_scale,
    numpy=_scale, cupy=_scale, inplace=True, elementwise=True, batch=True, tolerances=TOL_ELEMENTWISE,
    doc="out = a*x + b (attrs a=1.0, b=0.0). Float dtypes only. float32/float64 compute in their dtype "
        "(a*x rounded, then +b rounded); float16/bfloat16 compute in float32 and round once. In place allowed.",
    example={"x": _EX},
))


NUMPY_BOUND.update({_echo: _bound_echo, _vector_add: _bound_vector_add, _scale: _bound_scale})


def gelu_float(xp: Any, f: Any) -> Any:
    """tanh-approximate GELU of float array ``f`` into a new array: 0.5*f*(1 + tanh(sqrt(2/pi)*(f + 0.044715 f^3)))."""
    t = xp.multiply(f, f, out=xp.empty_like(f))  # (an array even for a 0-d f, where f * f is a NumPy scalar)
    t *= 0.044715
    t += 1.0
    t *= f
    t *= _SQRT_2_OVER_PI
    xp.tanh(t, out=t)
    t += 1.0
    t *= f
    t *= 0.5
    return t


def _infer_gelu(inputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> dict[str, TensorSpec]:
    require_float(inputs["x"], "x")
    return {"out": inputs["x"]}


def _gelu(call: OpCall) -> dict[str, Any]:
    xp, x, d = call.xp, call.inputs["x"], call.dest("out")
    dt = call.in_specs["x"].dtype
    return {"out": from_float(xp, gelu_float(xp, to_float(xp, x, dt)), dt, d)}


GELU = register_op(OpSpec(
    name="gelu", code=12, inputs=("x",), outputs=("out",), attrs={}, infer=_infer_gelu,
    numpy=_gelu, cupy=_gelu, inplace=True, elementwise=True, batch=True, tolerances=TOL_ELEMENTWISE,
    doc="out = 0.5*x*(1 + tanh(sqrt(2/pi)*(x + 0.044715*x**3))) (the tanh approximation), any float dtype; "
        "float16/bfloat16 compute in float32 and round once.",
    example={"x": _EX},
))
