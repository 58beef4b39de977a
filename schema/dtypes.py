"""Tensor element types: wire code (the FlatBuffers ``DType`` enum) <-> name <-> NumPy dtype.

``bfloat16`` has no NumPy type: its bytes travel as 16-bit words, and NumPy views
of it are ``uint16`` (``ml_dtypes.bfloat16`` where that package is installed).
"""

from __future__ import annotations

import numpy as np

__all__ = ["DTYPE_CODES", "DTYPE_NAMES", "code_of", "name_of", "numpy_dtype", "itemsize", "name_of_numpy"]

# name -> wire code; the codes are those of schema/shmrpc.fbs `enum DType` (kernels/_dtypes.py keeps a copy
# of the names; tests/test_contract.py checks the three agree).
DTYPE_CODES: dict[str, int] = {
    "bool": 1, "int8": 2, "uint8": 3, "int16": 4, "uint16": 5, "int32": 6, "uint32": 7,
    "int64": 8, "uint64": 9, "float16": 10, "bfloat16": 11, "float32": 12, "float64": 13,
}
DTYPE_NAMES: dict[int, str] = {v: k for k, v in DTYPE_CODES.items()}

try:  # optional: a real bfloat16 NumPy type
    import ml_dtypes as _ml

    _BF16: np.dtype = np.dtype(_ml.bfloat16)
except ImportError:  # pragma: no cover - depends on the environment
    _BF16 = np.dtype(np.uint16)

_NUMPY: dict[str, np.dtype] = {name: np.dtype(name) for name in DTYPE_CODES if name != "bfloat16"}
_NUMPY["bfloat16"] = _BF16


def code_of(name: str) -> int:
    """Wire code of a dtype name; raises KeyError for unknown names."""
    return DTYPE_CODES[name]


def name_of(code: int) -> str:
    """Dtype name of a wire code; raises KeyError for unknown codes."""
    return DTYPE_NAMES[code]


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype that views a tensor of dtype ``name``."""
    return _NUMPY[name]


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name``."""
    return _NUMPY[name].itemsize


_WIRE_NAMES: dict[np.dtype, str] = {}  # dtypes seen -> wire name (dtype.name is slow to compute)


def name_of_numpy(dtype: np.dtype | type | str) -> str:
    """The wire name of a NumPy dtype; raises KeyError when it cannot travel (object, complex ...)."""
    dt = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
    name = _WIRE_NAMES.get(dt)
    if name is not None:
        return name
    if dt == _BF16 and _BF16 != np.dtype(np.uint16):
        name = "bfloat16"
    else:
        name = dt.name
        if name not in DTYPE_CODES or dt.byteorder == ">":
            raise KeyError(name)
    _WIRE_NAMES[dt] = name
    return name
