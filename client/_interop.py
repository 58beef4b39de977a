"""Tensors of other libraries as request inputs: what ``Client.call`` accepts besides NumPy arrays.

=====================================  ======================================================================
input                                  how it reaches the slot
=====================================  ======================================================================
NumPy array                            one copy into the slot
anything array-like (list, buffer,     ``np.asarray`` first, then one copy into the slot
``__array__``)
PyTorch tensor on the CPU              viewed as NumPy without a copy (``detach()`` first: a tensor that
                                       requires grad is detached, its graph is not followed), then one copy
PyTorch ``bfloat16`` tensor            its raw 16-bit words, sent as ``bfloat16``
an object with ``__dlpack__`` on the   ``np.from_dlpack`` (no copy), then one copy into the slot
CPU
a GPU array (CuPy, PyTorch CUDA,       one device-to-slot copy (DMA straight into the shared mapping,
``__dlpack__`` / CUDA array            no host staging buffer of ours), by CuPy or PyTorch in the client
interface on a CUDA device)
=====================================  ======================================================================

A GPU array is never handed to the worker's GPU directly: the worker is another process, and
sharing device memory across processes (CUDA IPC) is not part of the protocol. It is copied to
the slot by the client and from the slot to the device by the worker (both DMA on a GPU host).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmrpc.schema import dtypes
from shmrpc.schema.errors import InvalidRequestError

__all__ = ["DeviceInput", "as_input", "is_array_like"]

# DLPack device types (dlpack.h): CPU, CUDA, CUDA pinned host, ROCm, ROCm host, CUDA managed.
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_ROCM, _DL_ROCM_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 10, 11, 13
_HOST_DEVICES = (_DL_CPU, _DL_CUDA_HOST, _DL_ROCM_HOST)


def is_array_like(value: Any) -> bool:
    """True for values that are tensors rather than op attributes (NumPy scalars are attributes)."""
    if isinstance(value, np.generic):
        return False
    return isinstance(value, (np.ndarray, memoryview, bytearray)) or _is_torch(value) or any(
        hasattr(value, a) for a in ("__dlpack__", "__array__", "__array_interface__", "__cuda_array_interface__"))


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


class DeviceInput:
    """An input in GPU memory: copied device-to-slot by :meth:`copy_into` (one D2H copy)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: np.dtype, wire: str, copy: Any) -> None:
        self.name, self.shape, self.dtype, self.wire = name, shape, dtype, wire
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._copy = copy

    def copy_into(self, view: np.ndarray) -> None:
        """Copy the device array into ``view`` (a slot view of the same shape and item size)."""
        self._copy(view)


def as_input(name: str, value: Any) -> tuple[np.ndarray | DeviceInput, str]:
    """``value`` as (a host array, of any strides, or a :class:`DeviceInput`, its wire dtype name). A host array is
    not copied here: the one copy into the slot (``np.copyto``) reads it in C order, and it keeps its shape (a 0-d
    array stays 0-d, as ``call()``'s steady path sends it).

    Raises:
        InvalidRequestError: the dtype cannot travel, or a GPU array with no CuPy or PyTorch here to copy it.
    """
    if isinstance(value, DeviceInput):  # converted before (Client.put): not again
        return value, value.wire
    if _is_torch(value):
        return _from_torch(name, value)
    if isinstance(value, np.ndarray):
        return _host(name, value)
    if hasattr(value, "__cuda_array_interface__") and not hasattr(value, "__dlpack__"):
        return _from_cuda_interface(name, value)
    if hasattr(value, "__dlpack__"):
        device = value.__dlpack_device__()[0] if hasattr(value, "__dlpack_device__") else _DL_CPU
        if device in _HOST_DEVICES:
            return _host(name, np.from_dlpack(_HostDLPack(value)))
        return _from_gpu_dlpack(name, value)
    try:
        return _host(name, np.asarray(value))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"input {name!r} is not an array ({type(value).__name__}: {e})", tensor=name,
                                  field="dtype") from None


class _HostDLPack:
    """Lets ``np.from_dlpack`` take an object that has ``__dlpack__`` but no ``__dlpack_device__``."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj

    def __dlpack__(self, **kw: Any) -> Any:
        try:
            return self._obj.__dlpack__(**kw)
        except TypeError:  # an older producer without the keyword arguments
            return self._obj.__dlpack__()

    def __dlpack_device__(self) -> tuple[int, int]:
        dev = getattr(self._obj, "__dlpack_device__", None)
        return tuple(dev()) if dev is not None else (_DL_CPU, 0)  # type: ignore[return-value]


def _host(name: str, a: np.ndarray, wire: str | None = None) -> tuple[np.ndarray, str]:
    a = np.asarray(a)  # a subclass (a masked array, np.matrix) as a plain view of its data: no copy
    if wire is None:
        try:
            wire = dtypes.name_of_numpy(a.dtype)
        except KeyError:
            raise InvalidRequestError(f"array {name!r} has dtype {a.dtype}, which cannot travel",
                                      tensor=name, field="dtype") from None
    return a, wire


def _from_torch(name: str, t: Any) -> tuple[np.ndarray | DeviceInput, str]:
    import torch

    t = t.detach()  # requires_grad: the values travel, the autograd graph does not
    bf16 = t.dtype == torch.bfloat16
    if t.device.type == "cpu":
        t = t.resolve_conj().resolve_neg().contiguous()
        if bf16:
            return _host(name, t.view(torch.int16).numpy().view(np.uint16), "bfloat16")
        try:
            a = t.numpy()
        except TypeError as e:  # float8, complex32 ...: no NumPy type
            raise InvalidRequestError(f"tensor {name!r} has dtype {t.dtype}, which cannot travel ({e})",
                                      tensor=name, field="dtype") from None
        return _host(name, a)
    if t.device.type != "cuda":
        raise InvalidRequestError(f"tensor {name!r} is on {t.device}; move it to the CPU or a CUDA device first",
                                  tensor=name, field="device")
    t = t.contiguous()
    src = t.view(torch.int16) if bf16 else t
    if bf16:
        wire, dt = "bfloat16", dtypes.numpy_dtype("bfloat16")
    else:
        try:
            dt = np.dtype(str(t.dtype).removeprefix("torch."))
            wire = dtypes.name_of_numpy(dt)
        except (TypeError, KeyError):
            raise InvalidRequestError(f"tensor {name!r} has dtype {t.dtype}, which cannot travel",
                                      tensor=name, field="dtype") from None

    def copy(view: np.ndarray) -> None:
        dst = torch.from_numpy(view.view(np.int16) if bf16 else view)
        dst.copy_(src)  # device -> the slot's pages, one copy; copy_ synchronizes for a pageable target

    return DeviceInput(name, tuple(t.shape), dt, wire, copy), wire


def _from_cupy(name: str, arr: Any) -> tuple[DeviceInput, str]:
    import cupy

    arr = cupy.ascontiguousarray(arr)
    dt = np.dtype(arr.dtype)
    try:
        wire = dtypes.name_of_numpy(dt)
    except KeyError:
        raise InvalidRequestError(f"array {name!r} has dtype {dt}, which cannot travel", tensor=name,
                                  field="dtype") from None

    def copy(view: np.ndarray) -> None:
        arr.get(out=view)  # device -> the slot's pages, one copy

    return DeviceInput(name, tuple(arr.shape), dt, wire, copy), wire


def _from_gpu_dlpack(name: str, value: Any) -> tuple[np.ndarray | DeviceInput, str]:
    try:
        import cupy

        return _from_cupy(name, cupy.from_dlpack(value))
    except ImportError:
        pass
    try:
        import torch

        return _from_torch(name, torch.from_dlpack(value))
    except ImportError:
        pass
    raise InvalidRequestError(f"input {name!r} is in GPU memory; copying it into the slot needs CuPy or PyTorch "
                              f"in this process (or pass a host array)", tensor=name, field="device")


def _from_cuda_interface(name: str, value: Any) -> tuple[np.ndarray | DeviceInput, str]:
    try:
        import cupy
    except ImportError:
        raise InvalidRequestError(f"input {name!r} is in GPU memory (__cuda_array_interface__); copying it into "
                                  f"the slot needs CuPy in this process", tensor=name, field="device") from None
    return _from_cupy(name, cupy.asarray(value))
