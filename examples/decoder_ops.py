"""Users' ops for the example decoder layer, loaded by the worker with ``shmrpc serve --ops decoder_ops``.

Three ops; ``rmsnorm_f16`` and ``kv_attend`` are one function written against ``call.xp`` (so it serves
NumPy and CuPy alike), ``residual_add`` has a NumPy implementation and a CuPy ``ElementwiseKernel``:

- ``rmsnorm_f16``: RMSNorm of a float32 row, scaled by ``g``, rounded to float16 (the int4 MLP's input);
- ``kv_attend``: one new token's attention: rotary embedding of q and k at position ``pos``, k and v
  written into the session's KV cache at row ``pos`` (the caches are the caller's resident tensors, updated
  in place: ``mutates``), then softmax(q K[:pos+1]^T / sqrt(head_dim)) V per head, in float32;
- ``residual_add``: ``x + y`` into float32 whatever float dtype ``y`` is (the FP32 residual stream).

``pos`` is a one-element int32 tensor, not an attribute, so every step of a session sends the same
descriptor (the worker's and the client's caches hit); on CuPy reading it costs one small device-to-host
copy per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shmrpc.kernels.api import (
    TOL_REDUCTION,
    AttrSpec,
    KernelInputError,
    OpCall,
    OpSpec,
    TensorSpec,
    register_op,
    require_dtype,
    require_ndim,
    to_float,
)

__all__ = ["RMSNORM_F16", "KV_ATTEND", "RESIDUAL_ADD", "rope"]


def _rule_rmsnorm(i: Mapping[str, TensorSpec], a: Mapping[str, Any]) -> dict[str, TensorSpec]:
    x, g = i["x"], i["g"]
    require_dtype(x, ("float32",), "x")
    require_ndim(x, "x", 2)
    if g.shape != (x.shape[1],) or g.dtype != "float32":
        raise KernelInputError(f"'g' is {g.shape} {g.dtype}; it must be ({x.shape[1]},) float32", tensor="g", field="shape")
    if not a["eps"] > 0:
        raise KernelInputError("eps must be > 0", field="eps")
    return {"out": TensorSpec(x.shape, "float16")}


def _rmsnorm(call: OpCall) -> dict[str, Any]:
    xp, x = call.xp, call.inputs["x"]
    ms = (x * x).mean(axis=-1, keepdims=True)
    y = x * (1.0 / xp.sqrt(ms + call.attrs["eps"])) * call.inputs["g"]
    d = call.dest("out")
    if d is None:
        return {"out": y.astype(xp.float16)}
    xp.copyto(d, y, casting="same_kind")
    return {"out": d}


RMSNORM_F16 = register_op(OpSpec(
    "rmsnorm_f16", inputs=("x", "g"), outputs=("out",), attrs={"eps": AttrSpec("float", 1e-6)},
    infer=_rule_rmsnorm, numpy=_rmsnorm, cupy=_rmsnorm, tolerances={"float32": (2e-3, 2e-3)},
    doc="x (M, D) float32, g (D,) float32 -> x / sqrt(mean(x^2) + eps) * g as float16",
    example={"x": TensorSpec((2, 64), "float32"), "g": TensorSpec((64,), "float32")},
))


def rope(xp: Any, t: Any, pos: int, n_heads: int, theta: float = 10000.0) -> Any:
    """Rotary embedding of a (D,) float32 row at position ``pos``: per head, the halves rotate by pos * theta^(-2i/hd)."""
    hd = t.shape[-1] // n_heads
    half = hd // 2
    h = t.reshape(n_heads, hd)
    freq = theta ** (-xp.arange(half, dtype=xp.float32) * 2.0 / hd)
    ang = pos * freq
    c, s = xp.cos(ang), xp.sin(ang)
    a, b = h[:, :half], h[:, half:]
    return xp.concatenate([a * c - b * s, a * s + b * c], axis=1).reshape(-1)


def _rule_attend(i: Mapping[str, TensorSpec], a: Mapping[str, Any]) -> dict[str, TensorSpec]:
    qkv, kc, vc, pos = i["qkv"], i["kcache"], i["vcache"], i["pos"]
    require_dtype(qkv, ("float32",), "qkv")
    if len(qkv.shape) != 2 or qkv.shape[0] != 1 or qkv.shape[1] % 3:
        raise KernelInputError(f"'qkv' has shape {qkv.shape}; it must be (1, 3*D)", tensor="qkv", field="shape")
    d = qkv.shape[1] // 3
    h = a["n_heads"]
    if h < 1 or d % h or (d // h) % 2:
        raise KernelInputError(f"n_heads={h} must divide D={d} into even head sizes", field="n_heads")
    for p, c in (("kcache", kc), ("vcache", vc)):
        if len(c.shape) != 2 or c.shape[1] != d or c.shape[0] < 1 or c.dtype != "float32":
            raise KernelInputError(f"{p!r} is {c.shape} {c.dtype}; it must be (T, {d}) float32", tensor=p, field="shape")
    if vc.shape != kc.shape:
        raise KernelInputError("'vcache' and 'kcache' must have one shape", tensor="vcache", field="shape")
    if pos.shape != (1,) or pos.dtype != "int32":
        raise KernelInputError(f"'pos' is {pos.shape} {pos.dtype}; it must be (1,) int32", tensor="pos", field="shape")
    return {"out": TensorSpec((1, d), "float32")}


def _attend(call: OpCall) -> dict[str, Any]:
    xp = call.xp
    qkv, kc, vc = call.inputs["qkv"], call.inputs["kcache"], call.inputs["vcache"]
    h = call.attrs["n_heads"]
    t_max, d = kc.shape
    pos = int(call.inputs["pos"][0])  # CuPy: one small device-to-host copy
    if not 0 <= pos < t_max:
        raise KernelInputError(f"pos {pos} is outside this KV cache's {t_max} rows: start a new session or a larger cache",
                               tensor="pos", field="pos")
    row = qkv.reshape(-1)
    q = rope(xp, row[:d], pos, h)
    kc[pos] = rope(xp, row[d:2 * d], pos, h)  # the session's cache grows by one row, in place
    vc[pos] = row[2 * d:]
    hd = d // h
    keys = kc[: pos + 1].reshape(pos + 1, h, hd)
    vals = vc[: pos + 1].reshape(pos + 1, h, hd)
    scores = xp.einsum("hd,thd->ht", q.reshape(h, hd), keys) * (1.0 / math.sqrt(hd))
    scores -= scores.max(axis=1, keepdims=True)
    w = xp.exp(scores)
    w /= w.sum(axis=1, keepdims=True)
    out = xp.einsum("ht,thd->hd", w, vals).reshape(1, d).astype(xp.float32)
    dst = call.dest("out")
    if dst is not None:
        xp.copyto(dst, out)
        return {"out": dst}
    return {"out": out}


KV_ATTEND = register_op(OpSpec(
    "kv_attend", inputs=("qkv", "kcache", "vcache", "pos"), outputs=("out",), attrs={"n_heads": AttrSpec("int")},
    infer=_rule_attend, numpy=_attend, cupy=_attend, mutates=("kcache", "vcache"), tolerances=TOL_REDUCTION,
    doc="one token's attention with rotary embedding against the caller's KV cache (resident, updated at row pos)",
))


def _rule_residual(i: Mapping[str, TensorSpec], a: Mapping[str, Any]) -> dict[str, TensorSpec]:
    x, y = i["x"], i["y"]
    require_dtype(x, ("float32",), "x")
    require_dtype(y, ("float16", "float32"), "y")
    if x.shape != y.shape:
        raise KernelInputError(f"'y' has shape {y.shape}, 'x' has {x.shape}", tensor="y", field="shape")
    return {"out": x}


def _residual(call: OpCall) -> dict[str, Any]:
    xp = call.xp
    y = to_float(xp, call.inputs["y"], call.in_specs["y"].dtype)
    return {"out": xp.add(call.inputs["x"], y, out=call.dest("out"))}


_KERNELS: dict[str, Any] = {}


def _residual_cupy(call: OpCall) -> dict[str, Any]:
    """One fused CuPy ElementwiseKernel (y widened in registers, no float32 copy of y), built once."""
    import cupy

    k = _KERNELS.get("residual_add")
    if k is None:
        k = _KERNELS["residual_add"] = cupy.ElementwiseKernel(
            "float32 x, Y y", "float32 out", "out = x + (float)y", "decoder_residual_add")
    x, y = call.inputs["x"], call.inputs["y"]
    d = call.dest("out")
    return {"out": k(x, y, d) if d is not None else k(x, y)}


RESIDUAL_ADD = register_op(OpSpec(
    "residual_add", inputs=("x", "y"), outputs=("out",), infer=_rule_residual, numpy=_residual, cupy=_residual_cupy,
    tolerances={"float32": (2e-6, 2e-6)}, doc="x (float32) + y (float16/float32) -> float32",
    example={"x": TensorSpec((2, 64), "float32"), "y": TensorSpec((2, 64), "float16")},
))
