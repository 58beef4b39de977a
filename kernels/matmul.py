"""Dense matrix products: gemm (x @ w) and gemm_bias (x @ w + bias).

NumPy twin: float32/float64 multiply in their dtype straight into the destination;
float16/bfloat16 are widened to float32, multiplied (float32 accumulation), rounded once.
CuPy: float16/float32/float64 through ``cupy.matmul`` (cuBLAS; for float16 CuPy calls
cublasGemmEx with float32 compute unless its compute-type setting was changed); bfloat16
has no CuPy dtype, so it is widened to float32 with bit shifts, multiplied, rounded back.

Batches (``batch=True``): every non-resident tensor may carry one more leading axis, x
(B, M, K), w (B, K, N) or a resident (K, N), bias (B, N) or a resident (N,); ``matmul``
broadcasts the leading axis (cuBLAS strided-batched on CuPy) and a batched bias is added
per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._common import TOL_MATMUL, require_dtype, require_ndim
from ._dtypes import from_float, to_float
from ._errors import KernelInputError
from ._registry import OpCall, OpSpec, TensorSpec
from .api import register_op

__all__ = ["GEMM", "GEMM_BIAS"]

_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _infer_gemm(inputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> dict[str, TensorSpec]:
    x, w = inputs["x"], inputs["w"]
    require_dtype(x, _DTYPES, "x")
    require_ndim(x, "x", 2)
    require_ndim(w, "w", 2)
    if w.dtype != x.dtype:
        raise KernelInputError(f"'w' has dtype {w.dtype}, 'x' has {x.dtype}; they must match", tensor="w", field="dtype")
    if w.shape[0] != x.shape[1]:
        raise KernelInputError(f"'w' has shape {w.shape}, needs ({x.shape[1]}, N) for x of shape {x.shape}", tensor="w", field="shape")
    out = {"out": TensorSpec((x.shape[0], w.shape[1]), x.dtype)}
    if "bias" in inputs:
        b = inputs["bias"]
        if b.dtype != x.dtype:
            raise KernelInputError(f"'bias' has dtype {b.dtype}, 'x' has {x.dtype}; they must match", tensor="bias", field="dtype")
        if b.shape != (w.shape[1],):
            raise KernelInputError(f"'bias' has shape {b.shape}, needs ({w.shape[1]},)", tensor="bias", field="shape")
    return out


def _gemm_flops(inputs: Mapping[str, TensorSpec], outputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> int:
    (m, k), n = inputs["x"].shape, inputs["w"].shape[1]
    return 2 * m * k * n + (m * n if "bias" in inputs else 0)


def _gemm_impl(call: OpCall, *, cublas_fp16: bool) -> dict[str, Any]:
    xp, dt, d = call.xp, call.in_specs["x"].dtype, call.dest("out")
    x, w = call.inputs["x"], call.inputs["w"]
    bias = call.inputs.get("bias")
    if bias is not None and bias.ndim == 2:  # a batch of per-request biases (B, N): one row per request's (M, N)
        bias = bias.reshape(bias.shape[0], 1, bias.shape[1])
    if dt in ("float32", "float64") or (dt == "float16" and cublas_fp16 and bias is None):
        r = xp.matmul(x, w, out=d)
        if bias is not None:
            r += bias
        return {"out": r}
    f = xp.matmul(to_float(xp, x, dt), to_float(xp, w, dt))
    if bias is not None:
        f += to_float(xp, bias, dt)
    return {"out": from_float(xp, f, dt, d)}


def _gemm_numpy(call: OpCall) -> dict[str, Any]:
    return _gemm_impl(call, cublas_fp16=False)


def _gemm_cupy(call: OpCall) -> dict[str, Any]:
    return _gemm_impl(call, cublas_fp16=True)


_DOC = ("x (M, K), w (K, N) of one dtype (float16/bfloat16/float32/float64) -> out (M, N) in that dtype; "
        "float32 accumulation for the 16-bit dtypes, rounded once")

GEMM = register_op(OpSpec(
    name="gemm", code=10, inputs=("x", "w"), outputs=("out",), attrs={}, infer=_infer_gemm,
    numpy=_gemm_numpy, cupy=_gemm_cupy, tolerances=TOL_MATMUL, doc="out = x @ w. " + _DOC + ".", cost=_gemm_flops,
    example={"x": TensorSpec((4, 32), "float16"), "w": TensorSpec((32, 16), "float16")}, batch=True,
))

GEMM_BIAS = register_op(OpSpec(
    name="gemm_bias", code=17, inputs=("x", "w", "bias"), outputs=("out",), attrs={}, infer=_infer_gemm,
    numpy=_gemm_numpy, cupy=_gemm_cupy, tolerances=TOL_MATMUL, cost=_gemm_flops,
    doc="out = x @ w + bias. " + _DOC + "; bias (N,) of the same dtype, added before rounding.",
    example={"x": TensorSpec((4, 32), "float16"), "w": TensorSpec((32, 16), "float16"),
             "bias": TensorSpec((16,), "float16")}, batch=True,
))
