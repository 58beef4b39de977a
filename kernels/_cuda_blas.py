"""cuBLAS products that a CUDA stream capture may hold: CuPy's own wrappers refuse to run while
a stream captures (``cublas.setStream`` raises NotImplementedError), so a batched ``gemm`` in a
graph calls cuBLAS itself, through ctypes, on a handle and a workspace of its own.

:class:`CaptureXp` stands in for the ``cupy`` module in an op's :class:`OpCall` while a batch is
captured: every attribute is CuPy's, except ``matmul``, which for the case a batch of ``gemm``
requests takes (both operands (B, M, K) @ (B, K, N), float16/float32/float64, nothing broadcast)
issues exactly the calls ``cupy.matmul`` issues for it (the operands cast to float32 for
float16, ``cublasGemmStridedBatchedEx`` with CUBLAS_COMPUTE_32F/64F and the default algorithm,
the float32 product cast into a float16 result), and for every other case calls
``cupy.matmul`` (which then refuses inside a capture, so that plan runs the plain path).

Why a handle and a workspace of our own: a graph keeps the device addresses it was captured
with, so the workspace its products use must live as long as the graph and must not be used
by anything running at the same time. The handle's workspace is set with
``cublasSetWorkspace`` (after each ``cublasSetStream``, which resets it); every graph holding
a product is launched on one stream (:mod:`._cuda_batch`), so two never share it at once.
That the bits equal CuPy's is not assumed: the batch graphs compare them before they serve.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

__all__ = ["CaptureXp", "CapturableBlas", "BLAS_OPS"]

#: Ops whose CuPy code calls cuBLAS (through ``xp.matmul``): captured only through :class:`CaptureXp`.
BLAS_OPS = frozenset({"gemm", "gemm_bias"})
_CUDA_R_32F, _CUDA_R_64F = 0, 1
_COMPUTE_32F, _COMPUTE_64F = 68, 70
_GEMM_DEFAULT = -1
_WORKSPACE_BYTES = 32 << 20  # cuBLAS's own default on Hopper (4 MiB before it): the same choices of kernel
_lib_lock = threading.Lock()
_lib: list[Any] = []


def _load() -> Any:
    """The libcublas this process already uses (CuPy's), found in /proc/self/maps; else by its soname."""
    with _lib_lock:
        if _lib:
            return _lib[0]
        path = "libcublas.so.12"
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    name = line.rsplit(None, 1)[-1] if line.count(" ") >= 5 else ""
                    base = name.rsplit("/", 1)[-1]
                    if base.startswith("libcublas.so"):
                        path = name
                        break
        except OSError:
            pass
        lib = ctypes.CDLL(path)
        vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasDestroy_v2.argtypes = [vp]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
        lib.cublasGemmStridedBatchedEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp, i, i, ll,
                                                   i, i, i]
        for fn in (lib.cublasCreate_v2, lib.cublasDestroy_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
                   lib.cublasGemmStridedBatchedEx):
            fn.restype = i
        _lib.append(lib)
        return lib


class CublasError(RuntimeError):
    """A cuBLAS call of :class:`CapturableBlas` returned a status other than success."""


class CapturableBlas:
    """A cuBLAS handle and workspace of our own (current device), for products inside a capture."""

    def __init__(self, cp: Any) -> None:
        cp.cuda.device.get_cublas_handle()  # CuPy loads libcublas: use the same one
        self._cp = cp
        self._lib = _load()
        h = ctypes.c_void_p()
        self._check(self._lib.cublasCreate_v2(ctypes.byref(h)), "cublasCreate")
        self.handle: ctypes.c_void_p | None = h
        self.workspace_bytes = _WORKSPACE_BYTES
        self.workspace = cp.cuda.runtime.malloc(self.workspace_bytes)
        self.lock = threading.Lock()  # one thread at a time on the handle (cuBLAS's rule)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise CublasError(f"{what} failed with cuBLAS status {status}")

    def close(self) -> None:
        """Destroy the handle and free the workspace (after every graph using them was dropped)."""
        if self.handle is not None:
            self._lib.cublasDestroy_v2(self.handle)
            self.handle = None
            try:
                self._cp.cuda.runtime.free(self.workspace)
            except Exception:  # noqa: BLE001 - after a sticky CUDA error there is nothing to free
                pass

    def strided_batched(self, stream_ptr: int, n: int, m: int, k: int, a: Any, lda: int, stride_a: int, b: Any,
                        ldb: int, stride_b: int, c: Any, ldc: int, stride_c: int, batch: int, dtype: np.dtype) -> None:
        """``cublasGemmStridedBatchedEx`` (no transposes, alpha 1, beta 0) on ``stream_ptr``, in ``dtype`` (f or d)."""
        lib, h = self._lib, self.handle
        one: ctypes.c_double | ctypes.c_float
        zero: ctypes.c_double | ctypes.c_float
        if dtype == np.float64:
            one, zero, dt, ct = ctypes.c_double(1.0), ctypes.c_double(0.0), _CUDA_R_64F, _COMPUTE_64F
        else:
            one, zero, dt, ct = ctypes.c_float(1.0), ctypes.c_float(0.0), _CUDA_R_32F, _COMPUTE_32F
        with self.lock:
            self._check(lib.cublasSetStream_v2(h, stream_ptr), "cublasSetStream")
            # NOTE: after setStream, which puts the library's own workspace back
            self._check(lib.cublasSetWorkspace_v2(h, self.workspace, self.workspace_bytes), "cublasSetWorkspace")
            self._check(lib.cublasGemmStridedBatchedEx(
                h, 0, 0, n, m, k, ctypes.addressof(one), a.data.ptr, dt, lda, stride_a, b.data.ptr, dt, ldb, stride_b,
                ctypes.addressof(zero), c.data.ptr, dt, ldc, stride_c, batch, ct, _GEMM_DEFAULT), "cublasGemmStridedBatchedEx")


class CaptureXp:
    """``cupy`` for an op's code during a capture: CuPy's attributes, ``matmul`` through :class:`CapturableBlas`."""

    def __init__(self, cp: Any, blas: CapturableBlas) -> None:
        self._cp = cp
        self._blas = blas

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cp, name)

    def matmul(self, a: Any, b: Any, out: Any = None) -> Any:
        """``cupy.matmul(a, b, out)``, issued as CuPy issues it for (B, M, K) @ (B, K, N) float16/32/64."""
        cp = self._cp
        ret = np.promote_types(a.dtype, b.dtype)
        dtype = np.dtype(np.float32) if ret == np.float16 else ret
        if (a.ndim != 3 or b.ndim != 3 or a.dtype != b.dtype or dtype not in (np.float32, np.float64)
                or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1] or a.size == 0 or b.size == 0):
            return cp.matmul(a, b, out=out)
        bsz, m, k = a.shape
        n = b.shape[2]
        shape = (bsz, m, n)
        if out is not None and (out.shape != shape or not out.flags.c_contiguous):
            return cp.matmul(a, b, out=out)
        a = cp.ascontiguousarray(a, dtype)
        b = cp.ascontiguousarray(b, dtype)
        if out is not None and out.dtype == dtype and not cp.may_share_memory(out, a) and not cp.may_share_memory(out, b):
            c = out
        else:
            c = cp.empty(shape, dtype)
            if out is None:
                out = c if dtype == ret else cp.empty(shape, ret)
        # C-ordered (A B) is column-major (B^T A^T): cuBLAS multiplies b by a, as CuPy's matmul does
        self._blas.strided_batched(cp.cuda.get_current_stream().ptr, n, m, k, b, n, k * n, a, k, m * k, c, n, m * n,
                                   bsz, dtype)
        if out is not c:
            cp._core.elementwise_copy(c, out)
        return out
