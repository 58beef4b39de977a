"""The CuPy backend: request inputs copied host->device from pinned shared memory, the whole
pipeline on the device, requested outputs copied device->host straight into their views.

Copies, and why: one H2D per request input (the GPU cannot compute on host pages at full
speed: 47 GB/s mapped vs 4 TB/s HBM) and one D2H per requested output; intermediates and
resident tensors never leave the device. Copies are ``cudaMemcpyAsync`` from/into the
caller's views, DMA from pinned pages once ``register_host`` has pinned the region. A small
request's graph has none where the device may use the host address of registered pages: its
kernels read and write the slot's pages themselves (:meth:`CupyBackend._issue_direct`), since
for a few KiB the copy engine's fixed cost is most of the request.

Three paths for one request (:meth:`CupyBackend.run`)::

    small (plan tensors <= GRAPH_MAX_BYTES), seen before at the same host addresses
        -> a CUDA graph (:mod:`._cuda_graph`): one launch, one synchronize (the worker's bound
           run of a slot's views, :meth:`CupyBackend.bind`, launches it without run()'s checks)
    other requests
        -> one stream of a stream set: H2D into device buffers kept per (stream set, plan)
           for small plans, the steps, D2H, one synchronize
    elementwise-only, moving more than CHUNK_THRESHOLD_BYTES
        -> chunks over streams (:mod:`._cuda_chunks`, tunable through SHMRPC_CHUNK_*)

Stage timings (CUDA events, read after the synchronize) are taken only for requests moving
more than ``TIMED_MIN_BYTES`` and for one small request in ``STAGE_SAMPLE_EVERY``; the
others return ``{"total"}`` (and ``"graph": 1.0`` when a graph served them).

A chunked request seen before at the same host addresses is one CUDA graph of its whole chunk
pipeline (``ChunkGraphs`` in :mod:`._cuda_graph`). Batches (:meth:`CupyBackend.run_batch`) and
launches (:meth:`CupyBackend.launch_batch`, :meth:`CupyBackend.launch`) are in :mod:`._cupy_runs`.

Streams come from a pool: one stream set (streams and a workspace) per concurrent run, so
``run`` is thread-safe. ``inject_fault = "cuda_error"`` makes the next run fail as a CUDA
error would, after which streams, workspaces and graphs are rebuilt. A real sticky CUDA
error (illegal address) leaves the CUDA context unusable: the worker must restart; it
raises ``KernelFatalError`` (a ``KernelRuntimeError``) then.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import _cuda_chunks
from . import _cuda_gather as _gather
from . import _cupy_runs as _runs
from ._backend_base import Backend, BoundRun, can_write, check_result
from ._cuda_batch import BatchGraphs
from ._cuda_chunks import CHUNK_BYTES, CHUNK_STREAMS, CHUNK_THRESHOLD_BYTES
from ._cuda_graph import ChunkGraphs, GraphCache, request_key
from ._cupy_runs import BATCH_SINGLES, GRAPH_MAX_BYTES, LAUNCH_BATCHES, chunk_settings, plan_bytes
from ._errors import (
    BackendUnavailable,
    KernelFatalError,
    KernelInputError,
    KernelResourceError,
    KernelRuntimeError,
    OpError,
    is_op_failure,
)
from ._plan import Plan
from ._registry import OpCall, TensorSpec

__all__ = ["CupyBackend", "CHUNK_THRESHOLD_BYTES", "CHUNK_BYTES", "CHUNK_STREAMS", "TIMED_MIN_BYTES",
           "STAGE_SAMPLE_EVERY", "GRAPH_MAX_BYTES", "GRAPH_CACHE", "LARGE_GRAPH_CACHE",
           "BATCH_GRAPH_CACHE", "DIRECT_MAX_BYTES", "LAUNCH_BATCHES"]

#: Requests moving more bytes than this get CUDA-event stage timings ("h2d", "kernel", "d2h").
TIMED_MIN_BYTES = 1 << 20
#: One small request in this many is timed by events too (so the stage histograms stay fed).
STAGE_SAMPLE_EVERY = 64
#: Graphs kept per backend, of single small requests and of batches each (``SHMRPC_CUDA_GRAPHS=0`` turns graphs off).
GRAPH_CACHE = int(os.environ.get("SHMRPC_CUDA_GRAPHS", "") or 64)
#: Graphs of whole chunked runs kept (each holds about the bytes its request moves on the device;
#: ``SHMRPC_CUDA_LARGE_GRAPHS=0`` turns them off).
LARGE_GRAPH_CACHE = int(os.environ.get("SHMRPC_CUDA_LARGE_GRAPHS", "") or (2 if GRAPH_CACHE else 0))
#: Graphs of batches kept (one per set of requests' slots: 8 clients of one slot each make up to 255 sets;
#: each graph a few MiB of device memory for gemm 16x256x256; ``SHMRPC_CUDA_BATCH_GRAPHS=0`` turns them off).
BATCH_GRAPH_CACHE = int(os.environ.get("SHMRPC_CUDA_BATCH_GRAPHS", "") or (256 if GRAPH_CACHE else 0))
#: A graph of one small request of elementwise steps moving at most this many bytes (inputs and outputs), and of
#: other steps a quarter of it, runs its kernels on the slot's own pages, without copies, where the device may use
#: their host addresses (``SHMRPC_CUDA_DIRECT_MAX_BYTES=0`` turns it off). A step that reads its input more than once
#: reads it over the bus each time: `layernorm` lost from 64 KiB on (docs/kernels.md, "Small requests without copies").
DIRECT_MAX_BYTES = int(os.environ.get("SHMRPC_CUDA_DIRECT_MAX_BYTES", "") or 65536)
_BUFS_PER_SET = 32
log = logging.getLogger("shmrpc.kernels")
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_STICKY = {700, 701, 702, 709, 710, 711, 712, 713, 714, 715, 716, 717, 718, 719}  # illegal address, launch failure, ...


def _small(plan: Plan, moved: int) -> bool:
    """Whether a request of ``plan`` moving ``moved`` bytes is small: untimed but one in STAGE_SAMPLE_EVERY, and one
    a graph may serve."""
    return moved <= TIMED_MIN_BYTES and plan_bytes(plan) <= GRAPH_MAX_BYTES


@functools.cache
def _copy_kernel(cp: Any) -> Any:
    """``k(src, dst)``: an elementwise kernel writing ``src`` into ``dst``."""
    return cp.ElementwiseKernel("T src", "T dst", "dst = src", "shmrpc_copy_out")


class _StreamSet:
    """Streams, events, device buffers and scratch owned by one run at a time."""

    def __init__(self, cupy: Any, generation: int) -> None:
        self.streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(max(3, CHUNK_STREAMS))]
        self.events = [cupy.cuda.Event() for _ in range(4)]  # reused: a stream set serves one run at a time
        self.workspace: dict[str, Any] = {}
        self.bufs: dict[int, tuple[Plan, dict[str, Any]]] = {}  # id(plan) -> (plan, input name -> device buffer)
        self.table: _gather.RowTable | None = None  # rows of the gather/scatter launches of a batch
        self.batch_bufs: dict[tuple[int, int], tuple[Plan, dict[str, Any]]] = {}  # (id(plan), B) -> stacked inputs
        self.generation = generation


class CupyBackend(Backend):
    """GPU backend (CuPy). ``select_backend("cupy", device=0)`` makes one."""

    name = "cupy"
    joins_batches = True
    batches_singles = LAUNCH_BATCHES and BATCH_SINGLES

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
        self._tls = threading.local()
        self._graphs = GraphCache(cupy, self._issue_graph, GRAPH_CACHE, 2, self._tls)
        self._batch_graphs = BatchGraphs(cupy, self._step, BATCH_GRAPH_CACHE, 3, self._tls)
        self._gather_graphs = _gather.GatherGraphs(cupy, self._step, _gather.GATHER_GRAPHS if GRAPH_CACHE else 0, 2,
                                                   self._tls, self._batch_graphs._sh)
        self._chunk_graphs = ChunkGraphs(cupy, LARGE_GRAPH_CACHE, 2, self._tls)
        self._small_runs = 0
        self.direct_captures = 0  # graphs of single requests captured without copies (_issue_graph)
        # what _cupy_runs derives from a plan alone: (id, size) -> (plan, (batch plan, gatherable)); (id, 0) -> (plan,
        # whether a launched batch may serve it)
        self._plan_facts: dict[Any, tuple[Plan, Any]] = {}
        self._kept_columns: dict[tuple[int, ...], tuple[list[Any], Any]] = {}  # a batch's address columns (_cupy_runs)
        with self._dev:
            self._host_access = _gather.HostAccess(cupy, device)
        self._checked = _gather.CheckedItems(self._host_access)  # a batch's per-request checks, by view identity
        #: Batches of small plans over page-locked views copy by one gather and one scatter launch (:mod:`._cuda_gather`).
        self.gather_batches = _gather.GATHER_ON and self._host_access.supported
        self.gather_min_batch = _gather.GATHER_MIN_BATCH

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
            if not getattr(self._tls, "capturing", False):  # a refused capture is no device error
                self._reset()
            cls = KernelFatalError if status in _STICKY else KernelRuntimeError
            return cls(f"CUDA error {status}: {e}", op=op, step=step)
        return KernelRuntimeError(f"op {op!r} failed: {type(e).__name__}: {e}", op=op, step=step)

    def _reset(self) -> None:
        """Forget streams, workspaces and graphs (after a CUDA error); the next run builds fresh ones."""
        with self._stream_sets_lock:
            self._generation += 1
            self._stream_sets.clear()
        self._graphs.clear()
        self._gather_graphs.clear()
        self._batch_graphs.clear()
        self._chunk_graphs.clear()
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
    def _h2d(self, host: np.ndarray, stream: Any, dev: Any = None) -> Any:
        cp = self.xp
        if dev is None:
            dev = cp.empty(host.shape, dtype=host.dtype)
        if host.nbytes:
            src = host if host.flags.c_contiguous else np.ascontiguousarray(host)  # a host copy only for strided views
            cp.cuda.runtime.memcpyAsync(dev.data.ptr, src.ctypes.data, src.nbytes, cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            if src is not host:
                stream.synchronize()  # src is a temporary
        return dev

    def _d2h(self, dev: Any, host: np.ndarray, stream: Any) -> Any:
        """Copy ``dev`` into ``host``; returns the device array the copy reads (keep it until the sync)."""
        cp = self.xp
        if not host.nbytes:
            return dev
        dev = cp.ascontiguousarray(dev)
        if host.flags.c_contiguous:
            cp.cuda.runtime.memcpyAsync(host.ctypes.data, dev.data.ptr, host.nbytes, cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
        else:
            tmp = np.empty(host.shape, host.dtype)
            cp.cuda.runtime.memcpyAsync(tmp.ctypes.data, dev.data.ptr, tmp.nbytes, cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)
            stream.synchronize()
            np.copyto(host, tmp)
        return dev

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

        Returns seconds: always "total" (wall time of the call); "h2d", "kernel", "d2h" (CUDA
        events) for requests moving more than TIMED_MIN_BYTES and one small request in
        STAGE_SAMPLE_EVERY; "graph": 1.0 when a CUDA graph served the request; "chunks" for
        chunked runs (their stage figures overlap: see :mod:`._cuda_chunks`).
        Raises KernelInputError, KernelRuntimeError (op/step set), KernelResourceError.
        """
        t0 = time.perf_counter()
        fault = self._consume_injected_fault(plan)
        if fault is not None:
            self._reset()
            raise fault
        host_in, host_out = self._host_io(plan, inputs, outputs)
        resident = self._lookup_resident(plan)
        moved = sum(h.nbytes for h in host_in.values()) + sum(h.nbytes for h in host_out.values())
        small = _small(plan, moved)
        timed = not small
        if small:
            self._small_runs += 1
            timed = self._small_runs % STAGE_SAMPLE_EVERY == 0
        with self._dev:
            if small and not timed and self._graphs.eligible(plan):
                try:
                    if self._graphs.run(plan, host_in, host_out, resident):
                        return {"total": time.perf_counter() - t0, "graph": 1.0}
                except OpError:
                    raise
                except Exception as e:
                    raise self._wrap(e, "", -1) from e
            chunkable = self._chunkable(plan, host_in, host_out, moved)
            if chunkable and self._chunk_graphs.eligible(plan):
                try:
                    graphed = self._chunk_graphs.run(plan, host_in, host_out, resident, chunk_settings(),
                                                     max(3, _cuda_chunks.CHUNK_STREAMS),
                                                     self._chunked(plan, host_in, host_out, resident))
                except OpError:
                    raise
                except Exception as e:
                    raise self._wrap(e, "", -1) from e
                if graphed is not None:
                    graphed["total"] = time.perf_counter() - t0
                    return graphed
            sset = self._acquire()
            try:
                if chunkable:
                    try:
                        times = self._chunked(plan, host_in, host_out, resident)(sset.streams, sset.workspace, False, [])
                    except OpError:
                        raise
                    except Exception as e:
                        raise self._wrap(e, "", -1) from e
                else:
                    times = self._run_whole(sset, plan, host_in, host_out, resident, keep_as, timed, small)
            except BaseException:
                self._release(sset)
                raise
            self._release(sset)
        times["total"] = time.perf_counter() - t0
        return times

    def bind(self, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
             keep_as: Mapping[str, str] | None = None) -> BoundRun:
        """``plan`` over these views as a callable (see :meth:`Backend.bind`); each call equals one :meth:`run`.

        For a small plan that a graph may serve (no resident tensors, nothing kept, contiguous views), done once
        here: the checks of the views and the graph's key. Per call: the injected fault, the stage sample (one
        small run in :data:`STAGE_SAMPLE_EVERY`), the graph's eligibility, then the captured graph launched and
        waited for; any call that is not that goes through :meth:`run` (which captures on the second sight).
        """
        try:
            host_in, host_out = self._host_io(plan, inputs, outputs)
        except KernelInputError:
            return super().bind(plan, inputs, outputs, keep_as)
        views = [*host_in.values(), *host_out.values()]
        key = request_key(plan, views, {})
        if plan.resident or plan.keep or not _small(plan, sum(v.nbytes for v in views)) or key is None:
            return super().bind(plan, inputs, outputs, keep_as)
        graphs, dev, perf = self._graphs, self._dev, time.perf_counter

        def bound() -> dict[str, float]:
            t0 = perf()
            if not self.inject_fault and (self._small_runs + 1) % STAGE_SAMPLE_EVERY and graphs.eligible(plan):
                try:
                    with dev:
                        served = graphs.launch_captured(key)
                except Exception as e:  # noqa: BLE001 - as run() wraps a failed launch
                    raise self._wrap(e, "", -1) from e
                if served:
                    self._small_runs += 1
                    return {"total": perf() - t0, "graph": 1.0}
            return self.run(plan, inputs, outputs, keep_as)
        return bound

    def _chunked(self, plan: Plan, host_in: Mapping[str, np.ndarray], host_out: Mapping[str, np.ndarray],
                 resident: Mapping[str, Any]) -> Any:
        """``chunked(streams, workspace, capture, hold)``: this request's chunked run (see :mod:`._cuda_chunks`)."""
        def chunked(streams: list[Any], workspace: dict[str, Any], capture: bool, hold: list[Any]) -> dict[str, float]:
            return _cuda_chunks.run_chunked(self.xp, streams, plan, host_in, host_out, resident,
                                            lambda st, i, si, so: self._step(st, i, si, so, workspace),
                                            capture=capture, hold=hold)
        return chunked

    def _step(self, st: Any, ins: dict[str, Any], in_specs: Mapping[str, TensorSpec], out_specs: Mapping[str, TensorSpec],
              workspace: dict[str, Any], xp: Any = None, dests: dict[str, Any] | None = None) -> dict[str, Any]:
        impl = st.op.cupy
        assert impl is not None  # plan() refuses ops without one
        call = OpCall(self.xp if xp is None else xp, ins, in_specs, out_specs, st.attrs, {} if dests is None else dests,
                      workspace)
        try:
            res = impl(call)
            check_result(st, res, out_specs)
            return res
        except BaseException as e:  # every failure of an op is its step's error (is_op_failure)
            if not is_op_failure(e):
                raise
            raise self._wrap(e, st.op.name, st.index) from e

    def _issue_graph(self, plan: Plan, host_in: Mapping[str, np.ndarray], host_out: Mapping[str, np.ndarray],
                     resident: Mapping[str, Any], s: Any, workspace: dict[str, Any]) -> dict[str, Any]:
        """The run a graph of one small request captures: without copies (:meth:`_issue_direct`) when the request
        moves at most :data:`DIRECT_MAX_BYTES` (a quarter of it unless every step is elementwise) and a kernel may
        use every view at its host address (:class:`._cuda_gather.HostAccess`), else with them (:meth:`_issue`)."""
        views = (*host_in.values(), *host_out.values())
        bound = DIRECT_MAX_BYTES if plan.elementwise else DIRECT_MAX_BYTES // 4
        if (sum(v.nbytes for v in views) <= bound and self._host_access.supported
                and all(v.nbytes and self._host_access.usable(v) for v in views)):
            if getattr(self._tls, "capturing", False):
                self.direct_captures += 1
            return self._issue_direct(plan, host_in, host_out, resident, s, workspace)
        return self._issue(plan, host_in, host_out, resident, s, workspace)

    def _issue_direct(self, plan: Plan, host_in: Mapping[str, np.ndarray], host_out: Mapping[str, np.ndarray],
                      resident: Mapping[str, Any], s: Any, workspace: dict[str, Any]) -> dict[str, Any]:
        """:meth:`_issue` without copies, for views a kernel may use at their host addresses (the caller checked):
        the steps read the inputs on their own pages, a step writes an output straight into its view where the
        NumPy backend would (:func:`._backend_base.can_write`), and a copy kernel writes any other output into its
        view. A small request's bytes cross the bus once either way; what goes is the copy engine's work per copy
        (docs/kernels.md, "Small requests without copies")."""
        on_host = {n: self._on_host(h) for n, h in host_in.items()}
        outs = {n: self._on_host(h) for n, h in host_out.items()}
        host: dict[str, np.ndarray] = dict(host_in)  # tensors living in host views: what can_write looks at
        env: dict[str, Any] = {**on_host, **resident}
        with s:
            for st in plan.steps:
                later = [host[n] for n, last in plan.last_use.items() if last > st.index and n in host]
                ins_host = {p: host[n] for p, n in st.inputs.items() if n in host}
                dests = {p: outs[n] for p, n in st.outputs.items()
                         if n in outs and can_write(host_out[n], st, ins_host, later)}
                res = self._step(st, {p: env[n] for p, n in st.inputs.items()}, st.in_specs, st.out_specs, workspace,
                                 dests=dests)
                for p, n in st.outputs.items():
                    env[n] = res[p]
                    if n in outs and res[p] is dests.get(p):
                        host[n] = host_out[n]
            for n, dst in outs.items():
                if env[n] is not dst:
                    _copy_kernel(self.xp)(env[n], dst)  # a kernel, not a copy by the copy engine
                env["#out." + n] = dst
        return env

    def _issue(self, plan: Plan, host_in: Mapping[str, np.ndarray], host_out: Mapping[str, np.ndarray],
               resident: Mapping[str, Any], s: Any, workspace: dict[str, Any],
               bufs: dict[str, Any] | None = None, ev: list[Any] | None = None) -> dict[str, Any]:
        """Enqueue one whole run on stream ``s`` (no synchronize); returns every device array it uses.

        ``bufs``: device buffers to copy the inputs into (kept by the caller); ``ev``: four
        events to record around the stages.
        """
        with s:
            if ev is not None:
                ev[0].record(s)
            env: dict[str, Any] = {n: self._h2d(h, s, bufs.get(n) if bufs else None) for n, h in host_in.items()}
            env.update(resident)
            if ev is not None:
                ev[1].record(s)
            for st in plan.steps:
                res = self._step(st, {p: env[n] for p, n in st.inputs.items()}, st.in_specs, st.out_specs, workspace)
                for p, n in st.outputs.items():
                    env[n] = res[p]
            if ev is not None:
                ev[2].record(s)
            for n, h in host_out.items():
                env["#d2h." + n] = self._d2h(env[n], h, s)
            if ev is not None:
                ev[3].record(s)
        return env

    def _on_host(self, view: np.ndarray) -> Any:
        """A device array over host view ``view``'s own pages (its device address is its host address). It does not
        hold the view: like a graph's copies, a graph of it must go before its pages do (``unregister_host``, which
        the worker calls before a region is unmapped, drops every graph)."""
        cp = self.xp
        mem = cp.cuda.UnownedMemory(view.ctypes.data, view.nbytes, None, self.device)
        return cp.ndarray(view.shape, view.dtype, cp.cuda.MemoryPointer(mem, 0))

    def _run_whole(self, sset: _StreamSet, plan: Plan, host_in: dict[str, np.ndarray], host_out: dict[str, np.ndarray],
                   resident: dict[str, Any], keep_as: Mapping[str, str] | None, timed: bool, small: bool) -> dict[str, float]:
        cp = self.xp
        s = sset.streams[0]
        bufs = self._bufs(sset, plan, host_in) if small and not plan.keep else None
        ev = sset.events if timed else None
        try:
            env = self._issue(plan, host_in, host_out, resident, s, sset.workspace, bufs, ev)
            s.synchronize()
            self._keep(plan, env, keep_as)
        except OpError:
            s.synchronize()
            raise
        except Exception as e:
            raise self._wrap(e, "", -1) from e
        if ev is None:
            return {}
        ms = [cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) / 1e3 for i in range(3)]
        return {"h2d": ms[0], "kernel": ms[1], "d2h": ms[2]}

    def _bufs(self, sset: _StreamSet, plan: Plan, host_in: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Device buffers for ``plan``'s inputs, made on its first run in this stream set and reused after."""
        entry = sset.bufs.get(id(plan))
        if entry is not None and entry[0] is plan:
            return entry[1]
        if len(sset.bufs) >= _BUFS_PER_SET:
            sset.bufs.pop(next(iter(sset.bufs)))
        bufs = {n: self.xp.empty(h.shape, dtype=h.dtype) for n, h in host_in.items()}
        sset.bufs[id(plan)] = (plan, bufs)
        return bufs

    def _chunkable(self, plan: Plan, host_in: dict[str, np.ndarray], host_out: dict[str, np.ndarray], moved: int) -> bool:
        if moved <= CHUNK_THRESHOLD_BYTES or not plan.elementwise or plan.keep:
            return False
        shapes = {s.shape for s in plan.tensors.values()}
        views = list(host_in.values()) + list(host_out.values())
        return len(shapes) == 1 and all(v.flags.c_contiguous for v in views)

    # -- batches and launches: functions of :mod:`._cupy_runs`, bound as methods ----
    run_batch = _runs.run_batch
    launch = _runs.launch
    launch_batch = _runs.launch_batch

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
        self._host_access.add(address, nbytes)

    def unregister_host(self, address: int | None = None) -> None:
        """cudaHostUnregister ``address`` (None: every range registered here)."""
        addrs = list(self._registered) if address is None else [address]
        self._host_access.remove(address)
        self._graphs.clear()  # their copies were made for pinned pages
        self._gather_graphs.clear()
        self._batch_graphs.clear()
        self._chunk_graphs.clear()
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
            if self.gather_batches:
                _gather.copy_kernel(self.xp)
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
        g, b, c, h = self._graphs, self._batch_graphs, self._chunk_graphs, self._gather_graphs
        log.info("CUDA graphs at close: requests %d captured (%d without copies) / %d launched, batches by slots "
                 "%d / %d (%d held, last refusal %r), gathered batches %d / %d (%d held, last refusal %r), chunked runs "
                 "%d / %d", g.captures, self.direct_captures, g.launches, b.captures, b.launches, len(b), b.last_error,
                 h.captures, h.launches, len(h), h.last_error, c.captures, c.launches)
        super().close()
        self._graphs.clear()
        self._chunk_graphs.clear()
        with self._dev:
            self._gather_graphs.clear()
            self._batch_graphs.close()
        self.unregister_host()
        with self._stream_sets_lock:
            self._stream_sets.clear()
        with self._dev:
            self.xp.get_default_memory_pool().free_all_blocks()

