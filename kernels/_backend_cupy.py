"""The CuPy backend: request inputs copied host->device from pinned shared memory, the whole
pipeline on the device, requested outputs copied device->host straight into their views.

Copies, and why: one H2D per request input (the GPU cannot compute on host pages at full
speed: 47 GB/s mapped vs 4 TB/s HBM) and one D2H per requested output; intermediates and
resident tensors never leave the device. Copies are ``cudaMemcpyAsync`` on the run's own
stream from/into the caller's views, which are DMA from pinned pages once
``register_host`` has pinned the region. Elementwise-only pipelines moving more than
``CHUNK_THRESHOLD_BYTES`` are split into chunks over three streams so the H2D of chunk
i+1, the kernels of chunk i and the D2H of chunk i-1 overlap.

Streams come from a pool: one stream set (three non-blocking streams and a workspace) per
concurrent run, so ``run`` is thread-safe. ``inject_fault = "cuda_error"`` makes the next
run fail as a CUDA error would, after which streams and workspaces are rebuilt. A real
sticky CUDA error (illegal address) leaves the CUDA context unusable: the worker must
restart; it raises ``KernelFatalError`` (a ``KernelRuntimeError``) then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._backend_base import Backend, check_result
from ._errors import BackendUnavailable, KernelFatalError, KernelResourceError, KernelRuntimeError, OpError
from ._plan import Plan
from ._registry import OpCall, TensorSpec

__all__ = ["CupyBackend", "CHUNK_THRESHOLD_BYTES", "CHUNK_BYTES"]

CHUNK_THRESHOLD_BYTES = 32 << 20
CHUNK_BYTES = 16 << 20
_N_STREAMS = 3
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_STICKY = {700, 701, 702, 709, 710, 711, 712, 713, 714, 715, 716, 717, 718, 719}  # illegal address, launch failure, ...


class _StreamSet:
    """Streams and scratch owned by one run at a time."""

    def __init__(self, cupy: Any, generation: int) -> None:
        self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(_N_STREAMS)]
        self.events = [cupy.cuda.Event() for _ in range(4)]  # reused: a stream set serves one run at a time
        self.workspace: dict[str, Any] = {}
        self.generation = generation


class CupyBackend(Backend):
    """GPU backend (CuPy). ``select_backend("cupy", device=0)`` makes one."""

    name = "cupy"

    def __init__(self, resident_limit_bytes: int | None = None, device: int = 0) -> None:
        try:
            import cupy
        except Exception as e:
            raise BackendUnavailable(f"CuPy does not import ({type(e).__name__}: {e}); install cupy-cuda12x or use 'numpy'") from e
        try:
            n = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:
            raise BackendUnavailable(f"CuPy sees no CUDA device ({e}); use 'numpy'") from e
        if not 0 <= device < n:
            raise BackendUnavailable(f"CUDA device {device} does not exist ({n} present)")
        super().__init__(resident_limit_bytes)
        self.xp = cupy
        self.device = device
        self._dev = cupy.cuda.Device(device)
        self._stream_sets: list[_StreamSet] = []
        self._stream_sets_lock = threading.Lock()
        self._generation = 0
        self._registered: dict[int, int] = {}

    # -- errors --------------------------------------------------------------------
    def _wrap(self, e: BaseException, op: str, step: int) -> OpError:
        cp = self.xp
        if isinstance(e, OpError):
            return e.with_context(op=op or None, step=step if step >= 0 else None)
        if isinstance(e, (cp.cuda.memory.OutOfMemoryError, MemoryError)):
            return KernelResourceError(f"out of device memory: {e}; drop resident tensors or send smaller requests",
                                       op=op, step=step, field="memory")
        rt, drv = cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError
        if isinstance(e, (rt, drv)):
            status = int(getattr(e, "status", -1))
            if status == 2:  # cudaErrorMemoryAllocation
                return KernelResourceError(f"out of device memory: {e}", op=op, step=step, field="memory")
            self._reset()
            cls = KernelFatalError if status in _STICKY else KernelRuntimeError
            return cls(f"CUDA error {status}: {e}", op=op, step=step)
        return KernelRuntimeError(f"op {op!r} failed: {type(e).__name__}: {e}", op=op, step=step)

    def _reset(self) -> None:
        """Forget streams and workspaces (after a CUDA error); the next run builds fresh ones."""
        with self._stream_sets_lock:
            self._generation += 1
            self._stream_sets.clear()
        try:
            with self._dev:
                self.xp.cuda.runtime.deviceSynchronize()
        except Exception:  # a sticky error stays; the caller has been told
            pass

    def _acquire(self) -> _StreamSet:
        with self._stream_sets_lock:
            if self._stream_sets:
                return self._stream_sets.pop()
            gen = self._generation
        return _StreamSet(self.xp, gen)

    def _release(self, sset: _StreamSet) -> None:
        with self._stream_sets_lock:
            if sset.generation == self._generation:
                self._stream_sets.append(sset)

    # -- copies --------------------------------------------------------------------
    def _h2d(self, host: np.ndarray, stream: Any) -> Any:
        cp = self.xp
        dev = cp.empty(host.shape, dtype=host.dtype)
        if host.nbytes:
            src = host if host.flags.c_contiguous else np.ascontiguousarray(host)  # a host copy only for strided views
            cp.cuda.runtime.memcpyAsync(dev.data.ptr, src.ctypes.data, src.nbytes, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            if src is not host:
                stream.synchronize()  # src is a temporary
        return dev

    def _d2h(self, dev: Any, host: np.ndarray, stream: Any) -> None:
        cp = self.xp
        if not host.nbytes:
            return
        dev = cp.ascontiguousarray(dev)
        if host.flags.c_contiguous:
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, dev.data.ptr, host.nbytes, cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        else:
            tmp = np.empty(host.shape, host.dtype)
            cp.cuda.runtime.memcpyAsync(tmp.ctypes.data, dev.data.ptr, tmp.nbytes, cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
            stream.synchronize()
            np.copyto(host, tmp)

    def _to_resident(self, arr: np.ndarray, spec: TensorSpec) -> Any:
        with self._dev:
            s = self.xp.cuda.Stream(non_blocking=True)
            try:
                with s:
                    dev = self._h2d(arr, s)
                s.synchronize()
            except Exception as e:
                raise self._wrap(e, "", -1) from e
            return dev

    # -- running -------------------------------------------------------------------
    def run(self, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
            keep_as: Mapping[str, str] | None = None) -> dict[str, float]:
        """Run ``plan``: H2D of request inputs, the steps on device, D2H into ``outputs``.

        Returns seconds {"h2d", "kernel", "d2h", "total"} (CUDA events; in chunked runs the
        stage figures are sums over chunks and overlap, "total" is wall time).
        Raises KernelInputError, KernelRuntimeError (op/step set), KernelResourceError.
        """
        t0 = time.perf_counter()
        fault = self._consume_injected_fault(plan)
        if fault is not None:
            self._reset()
            raise fault
        host_in, host_out = self._host_io(plan, inputs, outputs)
        resident = self._lookup_resident(plan)
        with self._dev:
            sset = self._acquire()
            try:
                if self._chunkable(plan, host_in, host_out):
                    times = self._run_chunked(sset, plan, host_in, host_out, resident)
                else:
                    times = self._run_whole(sset, plan, host_in, host_out, resident, keep_as)
            except BaseException:
                self._release(sset)
                raise
            self._release(sset)
        times["total"] = time.perf_counter() - t0
        return times

    def _step(self, st: Any, ins: dict[str, Any], in_specs: Mapping[str, TensorSpec], out_specs: Mapping[str, TensorSpec],
              sset: _StreamSet) -> dict[str, Any]:
        impl = st.op.cupy
        assert impl is not None  # plan() refuses ops without one
        call = OpCall(self.xp, ins, in_specs, out_specs, st.attrs, {}, sset.workspace)
        try:
            res = impl(call)
            check_result(st, res, out_specs)
            return res
        except Exception as e:
            raise self._wrap(e, st.op.name, st.index) from e

    def _run_whole(self, sset: _StreamSet, plan: Plan, host_in: dict[str, np.ndarray], host_out: dict[str, np.ndarray],
                   resident: dict[str, Any], keep_as: Mapping[str, str] | None) -> dict[str, float]:
        cp = self.xp
        s = sset.streams[0]
        ev = sset.events
        try:
            with s:
                ev[0].record(s)
                env: dict[str, Any] = {n: self._h2d(h, s) for n, h in host_in.items()}
                env.update(resident)
                ev[1].record(s)
                for st in plan.steps:
                    res = self._step(st, {p: env[n] for p, n in st.inputs.items()}, st.in_specs, st.out_specs, sset)
                    for p, n in st.outputs.items():
                        env[n] = res[p]
                ev[2].record(s)
                for n, h in host_out.items():
                    self._d2h(env[n], h, s)
                ev[3].record(s)
                s.synchronize()
            self._keep(plan, env, keep_as)
        except OpError:
            raise
        except Exception as e:
            raise self._wrap(e, "", -1) from e
        ms = [cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) / 1e3 for i in range(3)]
        return {"h2d": ms[0], "kernel": ms[1], "d2h": ms[2]}

    def _chunkable(self, plan: Plan, host_in: dict[str, np.ndarray], host_out: dict[str, np.ndarray]) -> bool:
        moved = sum(h.nbytes for h in host_in.values()) + sum(h.nbytes for h in host_out.values())
        if moved <= CHUNK_THRESHOLD_BYTES or not plan.elementwise or plan.keep:
            return False
        shapes = {s.shape for s in plan.tensors.values()}
        views = list(host_in.values()) + list(host_out.values())
        return len(shapes) == 1 and moved > CHUNK_THRESHOLD_BYTES and all(v.flags.c_contiguous for v in views)

    def _run_chunked(self, sset: _StreamSet, plan: Plan, host_in: dict[str, np.ndarray], host_out: dict[str, np.ndarray],
                     resident: dict[str, Any]) -> dict[str, float]:
        cp = self.xp
        n = next(iter(plan.tensors.values())).size
        widest = max(np.dtype(a.dtype).itemsize for a in [*host_in.values(), *host_out.values(), *resident.values()])
        chunk = max(1, CHUNK_BYTES // widest)
        flat_in = {k: v.reshape(-1) for k, v in host_in.items()}
        flat_out = {k: v.reshape(-1) for k, v in host_out.items()}
        flat_res = {k: v.reshape(-1) for k, v in resident.items()}
        marks: list[list[Any]] = []
        try:
            for ci, start in enumerate(range(0, n, chunk)):
                stop = min(n, start + chunk)
                s = sset.streams[ci % _N_STREAMS]
                ev = [cp.cuda.Event() for _ in range(4)]
                with s:
                    ev[0].record(s)
                    env: dict[str, Any] = {k: self._h2d(v[start:stop], s) for k, v in flat_in.items()}
                    env.update({k: v[start:stop] for k, v in flat_res.items()})
                    ev[1].record(s)
                    for st in plan.steps:
                        in_specs = {p: TensorSpec((stop - start,), sp.dtype) for p, sp in st.in_specs.items()}
                        out_specs = {p: TensorSpec((stop - start,), sp.dtype) for p, sp in st.out_specs.items()}
                        res = self._step(st, {p: env[k] for p, k in st.inputs.items()}, in_specs, out_specs, sset)
                        for p, k in st.outputs.items():
                            env[k] = res[p]
                    ev[2].record(s)
                    for k, h in flat_out.items():
                        self._d2h(env[k], h[start:stop], s)
                    ev[3].record(s)
                marks.append(ev)  # device buffers go back to the pool of stream s: stream order keeps reuse safe
            for s in sset.streams:
                s.synchronize()
        except OpError:
            for s in sset.streams:
                s.synchronize()
            raise
        except Exception as e:
            raise self._wrap(e, "", -1) from e
        tot = [0.0, 0.0, 0.0]
        for ev in marks:
            for i in range(3):
                tot[i] += cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) / 1e3
        return {"h2d": tot[0], "kernel": tot[1], "d2h": tot[2], "chunks": float(len(marks))}

    # -- host memory, warmup, memory, close ----------------------------------------
    def register_host(self, address: int, nbytes: int) -> None:
        """Pin [address, address+nbytes) (cudaHostRegister, portable) so copies are DMA; ~14 ms per 256 MiB."""
        with self._dev:
            try:
                self.xp.cuda.runtime.hostRegister(address, nbytes, _HOST_REGISTER_PORTABLE)
            except Exception as e:
                raise KernelRuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {e}; check RLIMIT_MEMLOCK",
                                         field="register_host") from e
        self._registered[address] = nbytes

    def unregister_host(self, address: int | None = None) -> None:
        """cudaHostUnregister ``address`` (None: every range registered here)."""
        addrs = list(self._registered) if address is None else [address]
        with self._dev:
            for a in addrs:
                if self._registered.pop(a, None) is not None:
                    try:
                        self.xp.cuda.runtime.hostUnregister(a)
                    except Exception as e:
                        raise KernelRuntimeError(f"cudaHostUnregister failed: {e}", field="register_host") from e

    def warmup(self) -> None:
        """Compile every CUDA module for every dtype (kept in CuPy's on-disk cache) and run each op once."""
        from .norm import _ln_warm
        from .quant import _w4a16_names

        with self._dev:
            for kt, dt in (("F16", "float16"), ("BF16", "bfloat16"), ("F32", "float32")):
                _ln_warm(kt, dt)
            from ._cuda import get_function

            for kt in ("F16", "BF16"):
                names = _w4a16_names(kt)
                get_function("gemm_w4a16.cu", names, names[0])
        super().warmup()

    def memory(self) -> dict[str, int]:
        """Device bytes: pool in use / held, free / total on the device, and resident bytes."""
        cp = self.xp
        with self._dev:
            pool = cp.get_default_memory_pool()
            free, total = cp.cuda.runtime.memGetInfo()
            return {"device_used_bytes": int(pool.used_bytes()), "device_pool_bytes": int(pool.total_bytes()),
                    "device_free_bytes": int(free), "device_total_bytes": int(total), "resident_bytes": self._resident_bytes}

    def close(self) -> None:
        """Drop residents, unregister host memory, free streams and the pool's cached blocks."""
        if self.closed:
            return
        super().close()
        self.unregister_host()
        with self._stream_sets_lock:
            self._stream_sets.clear()
        with self._dev:
            self.xp.get_default_memory_pool().free_all_blocks()
