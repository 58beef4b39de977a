"""Shape/dtype rule helpers and tolerance tables shared by the op modules."""

from __future__ import annotations

from collections.abc import Iterable

from ._dtypes import FLOAT_DTYPES
from ._errors import KernelInputError
from ._registry import TensorSpec

__all__ = [
    "TOL_ELEMENTWISE",
    "TOL_REDUCTION",
    "TOL_MATMUL",
    "require_dtype",
    "require_float",
    "require_same",
    "require_ndim",
]

# (rtol, atol) of one implementation against a float64 reference computed from the same inputs.
# float16/bfloat16 results are rounded once at the end: half an ulp is 4.9e-4 / 3.9e-3 relative;
# the tables leave room for a CuPy twin that rounds differently by one ulp.
_INTS = {n: (0.0, 0.0) for n in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")}
TOL_ELEMENTWISE: dict[str, tuple[float, float]] = {
    "float64": (1e-12, 1e-12), "float32": (2e-6, 2e-6), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2), **_INTS,
}
TOL_REDUCTION: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-10), "float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (1.6e-2, 1.6e-2),
}
TOL_MATMUL: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-10), "float32": (1e-4, 1e-4), "float16": (4e-3, 4e-3), "bfloat16": (2e-2, 2e-2),
}


def require_dtype(spec: TensorSpec, allowed: Iterable[str], tensor: str) -> None:
    """Raise KernelInputError(field="dtype") unless ``spec.dtype`` is one of ``allowed``."""
    allowed = tuple(allowed)
    if spec.dtype not in allowed:
        raise KernelInputError(f"{tensor!r} has dtype {spec.dtype}; this op takes {', '.join(allowed)}", tensor=tensor, field="dtype")


def require_float(spec: TensorSpec, tensor: str) -> None:
    """Raise KernelInputError(field="dtype") unless ``spec`` is a float dtype."""
    require_dtype(spec, sorted(FLOAT_DTYPES), tensor)


def require_same(ref: TensorSpec, other: TensorSpec, tensor: str, ref_name: str) -> None:
    """``other`` must have ``ref``'s shape (field "shape") and dtype (field "dtype")."""
    if other.shape != ref.shape:
        raise KernelInputError(f"{tensor!r} has shape {other.shape}, {ref_name!r} has {ref.shape}; they must match (no broadcasting)",
                               tensor=tensor, field="shape")
    if other.dtype != ref.dtype:
        raise KernelInputError(f"{tensor!r} has dtype {other.dtype}, {ref_name!r} has {ref.dtype}; they must match",
                               tensor=tensor, field="dtype")


def require_ndim(spec: TensorSpec, tensor: str, ndim: int | None = None, min_ndim: int = 0) -> None:
    """Raise KernelInputError(field="shape") unless ``spec`` has ``ndim`` (or at least ``min_ndim``) dims."""
    n = len(spec.shape)
    if (ndim is not None and n != ndim) or n < min_ndim:
        want = f"{ndim}" if ndim is not None else f"at least {min_ndim}"
        raise KernelInputError(f"{tensor!r} has {n} dims, this op needs {want}", tensor=tensor, field="shape")
