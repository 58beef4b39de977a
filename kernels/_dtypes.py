"""Dtype names, their NumPy storage types, and bfloat16 <-> float32 conversion for any ``xp``.

bfloat16 has no NumPy (or CuPy) type: its tensors are held as ``uint16`` arrays of the
raw bits. ``bf16_to_f32`` widens with a 16-bit shift (exact); ``f32_to_bf16`` rounds to
nearest even, NaN stays NaN (0x7FC0). Arrays of ``ml_dtypes.bfloat16`` are viewed as
``uint16`` on entry (same bytes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "DTYPE_NAMES",
    "FLOAT_DTYPES",
    "storage_dtype",
    "itemsize",
    "as_storage",
    "bf16_to_f32",
    "f32_to_bf16",
    "to_float",
    "from_float",
    "compute_dtype",
]

# In wire-code order. A copy of the schema's list (schema/dtypes.py, the .fbs enum DType): kernels never
# import the schema, so tests/test_contract.py is what keeps the three equal.
DTYPE_NAMES: tuple[str, ...] = (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32",
    "int64", "uint64", "float16", "bfloat16", "float32", "float64",
)
FLOAT_DTYPES: frozenset[str] = frozenset({"float16", "bfloat16", "float32", "float64"})

_STORAGE: dict[str, np.dtype] = {n: np.dtype(n) for n in DTYPE_NAMES if n != "bfloat16"}
_STORAGE["bfloat16"] = np.dtype(np.uint16)


def storage_dtype(name: str) -> np.dtype:
    """The NumPy dtype holding tensors of dtype ``name`` (``uint16`` for bfloat16)."""
    return _STORAGE[name]


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name``."""
    return _STORAGE[name].itemsize


def as_storage(arr: Any, name: str) -> Any:
    """View ``arr`` (NumPy or CuPy) as the storage dtype of ``name`` (no copy; bfloat16 -> uint16)."""
    want = _STORAGE[name]
    if arr.dtype == want:
        return arr
    if name == "bfloat16" and arr.dtype.itemsize == 2:
        return arr.view(np.uint16)
    raise TypeError(f"array of dtype {arr.dtype} cannot hold {name}")


def compute_dtype(name: str) -> np.dtype:
    """The float dtype arithmetic runs in: float64 for float64, float32 for the other floats."""
    return np.dtype(np.float64) if name == "float64" else np.dtype(np.float32)


def bf16_to_f32(xp: Any, bits: Any) -> Any:
    """Widen bfloat16 bits (uint16 array) to float32; exact."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def f32_to_bf16(xp: Any, f: Any) -> Any:
    """Round a float32 array to bfloat16 bits (uint16), nearest even; NaN -> 0x7FC0."""
    f = xp.ascontiguousarray(f, dtype=xp.float32)
    u = f.view(xp.uint32)
    rounded = (u + (xp.uint32(0x7FFF) + ((u >> 16) & xp.uint32(1)))) >> 16
    # no host sync (CuPy): a where() pass instead of testing for NaN first
    return xp.where(xp.isnan(f), xp.uint16(0x7FC0), rounded.astype(xp.uint16))


def to_float(xp: Any, arr: Any, name: str) -> Any:
    """``arr`` (storage of dtype ``name``) as a float array for computing.

    float32/float64 come back as they are (no copy: do not write into the result);
    float16, bfloat16 and integers are widened to float32 (float64 for 64-bit ints).
    """
    if name == "bfloat16":
        return bf16_to_f32(xp, arr)
    if name in ("float32", "float64"):
        return arr
    if name in ("int64", "uint64"):
        return arr.astype(xp.float64)
    return arr.astype(xp.float32)


def from_float(xp: Any, f: Any, name: str, out: Any | None = None) -> Any:
    """Round float array ``f`` to dtype ``name``'s storage; into ``out`` when given (returns it)."""
    if name == "bfloat16":
        bits = f32_to_bf16(xp, f)
        if out is None:
            return bits
        xp.copyto(out, bits)
        return out
    dt = _STORAGE[name]
    if out is None:
        return f if f.dtype == dt else f.astype(dt)
    if out is not f:
        xp.copyto(out, f, casting="unsafe")
    return out
