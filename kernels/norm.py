"""Row-wise ops over the last axis: layernorm, layernorm_gelu (fused), softmax.

NumPy twins compute in float32 (float64 for float64 inputs) and round once. On CuPy,
layernorm and layernorm_gelu run ``cuda/layernorm_gelu.cu`` (one block per row, one read
and one write per element) for float16/bfloat16/float32 rows of up to 16384 elements
(32768 for 16-bit dtypes whose D is a multiple of 8); other cases run the NumPy code on
CuPy arrays. softmax on CuPy runs ``cuda/softmax.cu`` for float16/bfloat16/float32: rows of up to
16384 elements (32768 for 16-bit dtypes whose D is a multiple of 8) are held in registers
(one read, one write); longer rows take an online max/sum pass then a write pass (two reads).
float64 and non-contiguous inputs run the array code.

Batches (``batch=True``): x may carry a leading request axis (rows of all requests are rows
of one launch); gamma/beta sent per request arrive as (B, D) and are applied per request
(NumPy: broadcast; CuPy: one launch per request); resident gamma/beta stay (D,).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._common import TOL_REDUCTION, require_float, require_ndim, require_same
from ._dtypes import from_float, itemsize, to_float
from ._errors import KernelInputError
from ._registry import AttrSpec, OpCall, OpSpec, TensorSpec
from .api import register_op
from .elementwise import gelu_float

__all__ = ["LAYERNORM", "LAYERNORM_GELU", "SOFTMAX", "layernorm_float"]

_KT = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
_VEC_NCH = (1, 2, 4, 8)
_SCALAR_NCH = (1, 2, 4, 8, 16, 32)
_BLOCK = 512
_LN_BLOCK = 256  # layernorm's preferred block (threads), see _ln_cupy


def layernorm_float(xp: Any, f: Any, g: Any, b: Any, eps: float) -> Any:
    """LayerNorm of float array ``f`` over its last axis into a new array (two-pass variance)."""
    mean = f.mean(axis=-1, keepdims=True)
    d = f - mean
    var = (d * d).mean(axis=-1, keepdims=True)
    var += eps
    d *= 1.0 / xp.sqrt(var)
    d *= g
    d += b
    return d


def _infer_ln(inputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> dict[str, TensorSpec]:
    x = inputs["x"]
    require_float(x, "x")
    require_ndim(x, "x", min_ndim=1)
    d = x.shape[-1]
    if d < 1:
        raise KernelInputError("'x' has an empty last axis", tensor="x", field="shape")
    for p in ("gamma", "beta"):
        require_same(TensorSpec((d,), x.dtype), inputs[p], p, "x[-1]")
    if not attrs["eps"] > 0.0:
        raise KernelInputError(f"eps must be > 0, got {attrs['eps']}", field="eps")
    return {"out": x}


def _per_request(p: Any, out_ndim: int) -> Any:
    """gamma/beta of a batch, (B, D), shaped to broadcast against the batch's (B, ..., D); (D,) as it is."""
    return p if p.ndim == 1 else p.reshape(p.shape[0], *([1] * (out_ndim - 2)), p.shape[1])


def _ln_numpy(call: OpCall, gelu: bool) -> dict[str, Any]:
    xp, dt = call.xp, call.in_specs["x"].dtype
    nd = len(call.out_specs["out"].shape)
    f = to_float(xp, call.inputs["x"], dt)
    if f.ndim < nd:  # a resident x under per-request gamma/beta: the same rows for every request
        f = xp.broadcast_to(f, call.out_specs["out"].shape)
    f = layernorm_float(xp, f, _per_request(to_float(xp, call.inputs["gamma"], dt), nd),
                        _per_request(to_float(xp, call.inputs["beta"], dt), nd), call.attrs["eps"])
    if gelu:
        f = gelu_float(xp, f)
    return {"out": from_float(xp, f, dt, call.dest("out"))}


_LN_BLOCKS = (32, 64, 128, 256, 512)  # the block sizes the layernorm kernel is built for (threads, compile-time)


@functools.cache  # a module's name list, asked for on every launch: built once
def _ln_names(kt: str, v: int, block: int) -> tuple[str, ...]:
    """The kernels of one layernorm module: one (dtype, vector width, block size), every chunk count, GELU or not."""
    return tuple(f"ln_rows<{kt},{v},{n},{block},{g}>" for n in (_VEC_NCH if v > 1 else _SCALAR_NCH)
                 for g in ("true", "false"))


def _ln_cupy(call: OpCall, gelu: bool) -> dict[str, Any]:
    import cupy

    from ._cuda import get_function

    x, gamma, beta = call.inputs["x"], call.inputs["gamma"], call.inputs["beta"]
    if gamma.ndim > 1 or beta.ndim > 1:
        return _ln_cupy_per_request(call, gelu)
    dt = call.in_specs["x"].dtype
    d = x.shape[-1]
    rows = x.size // d if d else 0
    vec = 16 // itemsize(dt) if dt in _KT else 1
    contiguous = all(a.flags.c_contiguous for a in (x, gamma, beta))
    aligned = all(a.data.ptr % 16 == 0 for a in (x, gamma, beta))
    v = vec if (d % vec == 0 and aligned) else 1
    slots = -(-d // v)
    nchs = _VEC_NCH if v > 1 else _SCALAR_NCH
    # blocks of at most 256 threads where the row allows (more 16-byte loads in flight per thread, more
    # rows per SM: 76 against 82 us at 8192 x 8192 float16 on the H200, bench/gpu/ln_probe.py), else up to 512
    nch = next((n for lim in (_LN_BLOCK, _BLOCK) for n in nchs if -(-slots // n) <= lim), None)
    if dt not in _KT or rows == 0 or not contiguous or nch is None or rows >= 2**31:
        return _ln_numpy(call, gelu)
    threads = -(-slots // nch)
    block = next(b for b in _LN_BLOCKS if b >= threads)  # threads <= _BLOCK: one always fits
    out = call.dest("out")
    if out is None or not out.flags.c_contiguous or out.data.ptr % 16:
        out = cupy.empty(x.shape, dtype=x.dtype)
    kt = _KT[dt]
    fn = get_function("layernorm_gelu.cu", _ln_names(kt, v, block),
                      f"ln_rows<{kt},{v},{nch},{block},{'true' if gelu else 'false'}>")
    fn((rows,), (block,), (x, gamma, beta, out, np.int32(d), np.float32(call.attrs["eps"])))
    return {"out": out}


def _ln_cupy_per_request(call: OpCall, gelu: bool) -> dict[str, Any]:
    """A batch with per-request gamma/beta (B, D): one launch per request, into one (B, ..., D) output."""
    import cupy

    x, gamma, beta = call.inputs["x"], call.inputs["gamma"], call.inputs["beta"]
    shape = call.out_specs["out"].shape
    n = shape[0]
    x_batched = x.ndim == len(shape)
    out = cupy.empty(shape, dtype=x.dtype)
    item = TensorSpec(shape[1:], call.out_specs["out"].dtype)
    pspec = TensorSpec((shape[-1],), item.dtype)
    for b in range(n):
        ins = {"x": x[b] if x_batched else x, "gamma": gamma[b] if gamma.ndim > 1 else gamma,
               "beta": beta[b] if beta.ndim > 1 else beta}
        ob = out[b]
        sub = OpCall(call.xp, ins, {"x": item, "gamma": pspec, "beta": pspec}, {"out": item}, call.attrs, {"out": ob},
                     call.workspace)
        r = _ln_cupy(sub, gelu)["out"]
        if r is not ob:
            ob[...] = r
    return {"out": out}


def _ln_warm(kt: str, dt: str) -> None:
    """Compile the layernorm modules of one dtype that rows of 1024 to 16384 16-byte-aligned elements use
    (``warmup``); other shapes compile theirs on first use (then from CuPy's disk cache)."""
    from ._cuda import get_function

    for block in (128, 256, 512):
        names = _ln_names(kt, 16 // itemsize(dt), block)
        get_function("layernorm_gelu.cu", names, names[0])


_LN_EX = {"x": TensorSpec((4, 64), "float16"), "gamma": TensorSpec((64,), "float16"), "beta": TensorSpec((64,), "float16")}
_LN_DOC = ("x (..., D) float16/bfloat16/float32/float64, gamma (D,), beta (D,) of x's dtype; attr eps=1e-5 (> 0). "
           "Normalizes over the last axis: (x - mean) / sqrt(var + eps) * gamma + beta, statistics in float32 "
           "(float64 for float64), biased variance, two passes.")

LAYERNORM = register_op(OpSpec(
    name="layernorm", code=11, inputs=("x", "gamma", "beta"), outputs=("out",), attrs={"eps": AttrSpec("float", 1e-5)},
    infer=_infer_ln, numpy=lambda c: _ln_numpy(c, False), cupy=lambda c: _ln_cupy(c, False),
    tolerances=TOL_REDUCTION, doc="out = layernorm(x). " + _LN_DOC, example=_LN_EX, batch=True,
))

LAYERNORM_GELU = register_op(OpSpec(
    name="layernorm_gelu", code=13, inputs=("x", "gamma", "beta"), outputs=("out",), attrs={"eps": AttrSpec("float", 1e-5)},
    infer=_infer_ln, numpy=lambda c: _ln_numpy(c, True), cupy=lambda c: _ln_cupy(c, True),
    tolerances=TOL_REDUCTION,
    doc="out = gelu_tanh(layernorm(x)), fused (no rounding in between; on CuPy one kernel, one read and one "
        "write per element). " + _LN_DOC, example=_LN_EX, batch=True,
))


def _infer_softmax(inputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> dict[str, TensorSpec]:
    x = inputs["x"]
    require_float(x, "x")
    require_ndim(x, "x", min_ndim=1)
    if x.shape[-1] < 1:
        raise KernelInputError("'x' has an empty last axis", tensor="x", field="shape")
    return {"out": x}


def _softmax(call: OpCall) -> dict[str, Any]:
    xp, dt = call.xp, call.in_specs["x"].dtype
    f = to_float(xp, call.inputs["x"], dt)
    e = f - f.max(axis=-1, keepdims=True)
    xp.exp(e, out=e)
    e /= e.sum(axis=-1, keepdims=True)
    return {"out": from_float(xp, e, dt, call.dest("out"))}


@functools.cache  # a module's name list, asked for on every launch: built once
def _sm_names(kt: str, vec: int) -> tuple[str, ...]:
    return (*(f"softmax_rows<{kt},{v},{n}>" for v, nchs in ((vec, _VEC_NCH), (1, _SCALAR_NCH)) for n in nchs),
            f"softmax_online<{kt}>")


def _softmax_cupy(call: OpCall) -> dict[str, Any]:
    import cupy

    from ._cuda import get_function

    x = call.inputs["x"]
    dt = call.in_specs["x"].dtype
    d = x.shape[-1]
    rows = x.size // d if d else 0
    if dt not in _KT or rows == 0 or rows >= 2**31 or d >= 2**31 or not x.flags.c_contiguous:
        return _softmax(call)
    vec = 16 // itemsize(dt)
    v = vec if (d % vec == 0 and x.data.ptr % 16 == 0) else 1
    out = call.dest("out")
    if out is None or not out.flags.c_contiguous or out.data.ptr % 16:
        out = cupy.empty(x.shape, dtype=x.dtype)
    kt = _KT[dt]
    names = _sm_names(kt, vec)
    slots = -(-d // v)
    nch = next((n for n in (_VEC_NCH if v > 1 else _SCALAR_NCH) if -(-slots // n) <= _BLOCK), None)
    if nch is None:
        get_function("softmax.cu", names, f"softmax_online<{kt}>")((rows,), (1024,), (x, out, np.int32(d)))
        return {"out": out}
    threads = -(-slots // nch)
    block = max(32, (threads + 31) // 32 * 32)
    get_function("softmax.cu", names, f"softmax_rows<{kt},{v},{nch}>")((rows,), (block,), (x, out, np.int32(d)))
    return {"out": out}


SOFTMAX = register_op(OpSpec(
    name="softmax", code=14, inputs=("x",), outputs=("out",), attrs={}, infer=_infer_softmax,
    numpy=_softmax, cupy=_softmax_cupy, tolerances=TOL_REDUCTION,
    doc="out = exp(x - max) / sum(exp(x - max)) over the last axis (numerically stable), any float dtype; "
        "float32 accumulation (float64 for float64), rounded once. CuPy: one fused kernel per row "
        "(float16/bfloat16/float32; row in registers up to D = 16384, 32768 for 16-bit D % 8 == 0; longer rows "
        "an online max/sum pass and a write pass); float64 or non-contiguous x: array code.",
    example={"x": TensorSpec((4, 64), "float16")}, batch=True,
))
