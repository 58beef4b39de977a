"""The CuPy backend: request inputs copied host->device from pinned shared memory, the whole
pipeline on the device, requested outputs copied device->host straight into their views.

Copies, and why: one H2D per request input (the GPU cannot compute on host pages at full
speed: 47 GB/s mapped vs 4 TB/s HBM) and one D2H per requested output; intermediates and
resident tensors never leave the device. Copies are ``cudaMemcpyAsync`` from/into the
caller's views, DMA from pinned pages once ``register_host`` has pinned the region.

Three paths for one request (:meth:`CupyBackend.run`)::

    small (plan tensors <= GRAPH_MAX_BYTES), seen before at the same host addresses
        -> a CUDA graph (:mod:`._cuda_graph`): one launch, one synchronize
    other requests
        -> one stream of a stream set: H2D into device buffers kept per (stream set, plan)
           for small plans, the steps, D2H, one synchronize
    elementwise-only, moving more than CHUNK_THRESHOLD_BYTES
        -> chunks over streams (:mod:`._cuda_chunks`, tunable through SHMRPC_CHUNK_*)

Stage timings (CUDA events, read after the synchronize) are taken only for requests moving
more than ``TIMED_MIN_BYTES`` and for one small request in ``STAGE_SAMPLE_EVERY``; the
others return ``{"total"}`` (and ``"graph": 1.0`` when a graph served them).

Batches (:meth:`CupyBackend.run_batch`): a batchable plan over B requests copies each
request's inputs into its slice of one (B, ...) device buffer, runs every step once,
copies each request's slice of the outputs back, and synchronizes once; a small batch seen
before at the same host addresses is one CUDA graph (:mod:`._cuda_batch`, cuBLAS products
through :mod:`._cuda_blas`); other batches of >= GATHER_MIN_BATCH small requests over views the
device may read at their host address copy by one gather and one scatter launch
(:mod:`._cuda_gather`). A chunked request seen before at the same host addresses is one CUDA
graph of its whole chunk pipeline (``ChunkGraphs`` in :mod:`._cuda_graph`).

Streams come from a pool: one stream set (streams and a workspace) per concurrent run, so
``run`` is thread-safe. ``inject_fault = "cuda_error"`` makes the next run fail as a CUDA
error would, after which streams, workspaces and graphs are rebuilt. A real sticky CUDA
error (illegal address) leaves the CUDA context unusable: the worker must restart; it
raises ``KernelFatalError`` (a ``KernelRuntimeError``) then.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import _cuda_chunks
from . import _cuda_gather as _gather
from ._backend_base import Backend, BatchLaunch, RunLaunch, check_result
from ._batch import BatchPlan, batch_plan, batchable
from ._cuda_batch import BatchGraphs, issue_joint
from ._cuda_chunks import CHUNK_BYTES, CHUNK_STREAMS, CHUNK_THRESHOLD_BYTES
from ._cuda_graph import ChunkGraphs, ChunkStarted, GraphCache
from ._errors import BackendUnavailable, KernelFatalError, KernelResourceError, KernelRuntimeError, OpError
from ._plan import Plan
from ._registry import OpCall, TensorSpec

__all__ = ["CupyBackend", "CHUNK_THRESHOLD_BYTES", "CHUNK_BYTES", "CHUNK_STREAMS", "TIMED_MIN_BYTES",
           "STAGE_SAMPLE_EVERY", "GRAPH_MAX_BYTES", "GRAPH_CACHE", "LARGE_GRAPH_CACHE",
           "BATCH_GRAPH_CACHE", "LAUNCH_BATCHES"]

#: Requests moving more bytes than this get CUDA-event stage timings ("h2d", "kernel", "d2h").
TIMED_MIN_BYTES = 1 << 20
#: One small request in this many is timed by events too (so the stage histograms stay fed).
STAGE_SAMPLE_EVERY = 64
#: Plans whose tensors total at most this many bytes keep device buffers and may become graphs.
GRAPH_MAX_BYTES = 4 << 20
#: Graphs kept per backend, of single small requests and of batches each (``SHMRPC_CUDA_GRAPHS=0`` turns graphs off).
GRAPH_CACHE = int(os.environ.get("SHMRPC_CUDA_GRAPHS", "") or 64)
#: Graphs of whole chunked runs kept (each holds about the bytes its request moves on the device;
#: ``SHMRPC_CUDA_LARGE_GRAPHS=0`` turns them off).
LARGE_GRAPH_CACHE = int(os.environ.get("SHMRPC_CUDA_LARGE_GRAPHS", "") or (2 if GRAPH_CACHE else 0))
#: Graphs of batches kept (one per set of requests' slots: 8 clients of one slot each make up to 255 sets;
#: each graph a few MiB of device memory for gemm 16x256x256; ``SHMRPC_CUDA_BATCH_GRAPHS=0`` turns them off).
BATCH_GRAPH_CACHE = int(os.environ.get("SHMRPC_CUDA_BATCH_GRAPHS", "") or (256 if GRAPH_CACHE else 0))
#: Batches a gathered graph serves, and large requests a chunk graph serves, are launched and answered when done
#: (:meth:`CupyBackend.launch_batch`, :meth:`CupyBackend.launch`); ``SHMRPC_CUDA_LAUNCH_BATCHES=0``: run and
#: waited for by the caller, as any other.
LAUNCH_BATCHES = (os.environ.get("SHMRPC_CUDA_LAUNCH_BATCHES", "") or "1") != "0"
_BUFS_PER_SET = 32
log = logging.getLogger("shmrpc.kernels")
_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable
_STICKY = {700, 701, 702, 709, 710, 711, 712, 713, 714, 715, 716, 717, 718, 719}  # illegal address, launch failure, ...


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
        self._graphs = GraphCache(cupy, self._issue, GRAPH_CACHE, 2, self._tls)
        self._batch_graphs = BatchGraphs(cupy, self._step, BATCH_GRAPH_CACHE, 3, self._tls)
        self._gather_graphs = _gather.GatherGraphs(cupy, self._step, _gather.GATHER_GRAPHS if GRAPH_CACHE else 0, 2,
                                                   self._tls, self._batch_graphs._sh)
        self._chunk_graphs = ChunkGraphs(cupy, LARGE_GRAPH_CACHE, 2, self._tls)
        self._small_runs = 0
        self._batch_plans: dict[tuple[int, int], tuple[Plan, BatchPlan]] = {}
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
        small = moved <= TIMED_MIN_BYTES and _plan_bytes(plan) <= GRAPH_MAX_BYTES
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
                    graphed = self._chunk_graphs.run(plan, host_in, host_out, resident, _chunk_settings(),
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

    def _chunked(self, plan: Plan, host_in: Mapping[str, np.ndarray], host_out: Mapping[str, np.ndarray],
                 resident: Mapping[str, Any]) -> Any:
        """``chunked(streams, workspace, capture, hold)``: this request's chunked run (see :mod:`._cuda_chunks`)."""
        def chunked(streams: list[Any], workspace: dict[str, Any], capture: bool, hold: list[Any]) -> dict[str, float]:
            return _cuda_chunks.run_chunked(self.xp, streams, plan, host_in, host_out, resident,
                                            lambda st, i, si, so: self._step(st, i, si, so, workspace),
                                            capture=capture, hold=hold)
        return chunked

    def _step(self, st: Any, ins: dict[str, Any], in_specs: Mapping[str, TensorSpec], out_specs: Mapping[str, TensorSpec],
              workspace: dict[str, Any], xp: Any = None) -> dict[str, Any]:
        impl = st.op.cupy
        assert impl is not None  # plan() refuses ops without one
        call = OpCall(self.xp if xp is None else xp, ins, in_specs, out_specs, st.attrs, {}, workspace)
        try:
            res = impl(call)
            check_result(st, res, out_specs)
            return res
        except Exception as e:
            raise self._wrap(e, st.op.name, st.index) from e

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

    # -- batches -------------------------------------------------------------------
    def run_batch(self, plan: Plan, items: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]]
                  ) -> list[dict[str, float] | Exception]:
        """Run ``plan`` over several requests; see :meth:`Backend.run_batch`.

        A :func:`~shmrpc.kernels._batch.batchable` plan over two requests or more runs once:
        each request's inputs are copied into its slice of one (B, ...) device buffer, every
        step runs once with (B, ...) specs, each request's output slice is copied into its
        view, one synchronize. A small plan (<= GRAPH_MAX_BYTES per request) over views a kernel may
        use at their host address is served, from the second batch of its size on, by the graph of its
        gathered run (:class:`._cuda_gather.GatherGraphs`: one launch, one synchronize); until then, and
        for batches of GATHER_MIN_BATCH or more whose plan is not captured, by one gather and one scatter
        launch around the steps. Elsewhere a small plan whose batch comes back at the same host addresses
        is served by a graph of the memcpy run from its third sight (:mod:`._cuda_batch`). Each item then
        gets ``{"total": seconds of the joint run, "batch": B}`` (and ``"graph": 1.0`` and/or
        ``"gather": 1.0``). A bad view, an
        op error or a device error in the joint run makes every request run alone (its own
        result or error), unless copies out had begun: then every request gets the joint run's error.
        """
        if len(items) < 2 or self.inject_fault or not batchable(plan):
            return super().run_batch(plan, items)
        t0 = time.perf_counter()
        try:
            got = [self._checked.get(plan, ins, outs, self._host_io) for ins, outs in items]
            resident = self._lookup_resident(plan)
        except OpError:
            return super().run_batch(plan, items)
        if not all(g[2] for g in got):  # a view not C-contiguous
            return super().run_batch(plan, items)
        checked = [(g[0], g[1]) for g in got]
        bp = self._batch_plan(plan, len(items))
        addrs = None
        gg = self._gather_graphs
        graphs = _plan_bytes(plan) <= GRAPH_MAX_BYTES
        if self.gather_batches and (len(items) >= self.gather_min_batch or graphs and gg.eligible(plan)) \
                and _gather.gatherable(plan, bp) and all(g[3] is not None for g in got):
            addrs = _columns(got)
        gather = addrs is not None and len(items) >= self.gather_min_batch
        copying_out = [False]
        graphed: bool | None = None
        with self._dev:
            sset = self._acquire()
            s = sset.streams[0]
            try:
                if addrs is not None and graphs and gg.eligible(plan):
                    graphed = gg.run(plan, bp, addrs, checked, resident, copying_out)
                    gather = gather or graphed is not None
                elif graphs and self._batch_graphs.eligible(plan):
                    graphed = self._batch_graphs.run(plan, bp, checked, resident, copying_out)
                    gather = gather and graphed is None
                if graphed is None and gather and addrs is not None:
                    if sset.table is None:
                        sset.table = _gather.RowTable(self.xp)
                    bufs = _gather.stacked_bufs(sset.batch_bufs, plan, len(items), _plan_bytes(plan))
                    _gather.issue_gathered(self.xp, self._step, plan, bp, addrs, resident, s, sset.workspace, copying_out,
                                           sset.table, bufs)
                    s.synchronize()
                elif graphed is None:
                    gather = False
                    issue_joint(self.xp, self._step, None, plan, bp, checked, resident, s, sset.workspace, copying_out)
                    s.synchronize()
            except Exception as e:  # noqa: BLE001 - the batch failed as a whole
                try:
                    s.synchronize()  # NOTE: a launch may still read this stream set's table
                except Exception:  # noqa: BLE001 - a device error: reported below, the stream set is dropped
                    pass
                self._release(sset)
                if not copying_out[0]:
                    return super().run_batch(plan, items)
                err = e if isinstance(e, OpError) else self._wrap(e, "", -1)
                return [err for _ in items]
            self._release(sset)
        dt = time.perf_counter() - t0
        done = {"total": dt, "batch": float(len(items))}
        if graphed is True:
            done["graph"] = 1.0
        if gather:
            done["gather"] = 1.0
        return [dict(done) for _ in items]

    def launch(self, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> RunLaunch | None:
        """Launch a large request that a graph of its chunked run serves (:class:`._cuda_graph.ChunkGraphs`) and
        return at once; any other request: None (see :meth:`Backend.launch`)."""
        if not LAUNCH_BATCHES or self.inject_fault or not self._chunk_graphs.eligible(plan):
            return None
        try:
            host_in, host_out = self._host_io(plan, inputs, outputs)
            resident = self._lookup_resident(plan)
        except OpError:
            return None  # run() raises it
        moved = sum(h.nbytes for h in host_in.values()) + sum(h.nbytes for h in host_out.values())
        if not self._chunkable(plan, host_in, host_out, moved):
            return None
        try:
            with self._dev:
                started = self._chunk_graphs.start(plan, host_in, host_out, resident, _chunk_settings())
        except Exception:  # noqa: BLE001 - the launch failed: run() runs the request again and reports what fails
            return None
        return None if started is None else _RunLaunched(self, started)

    def launch_batch(self, plan: Plan, items: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]]
                     ) -> BatchLaunch | None:
        """Launch a batch that a graph of gathered batches serves (:mod:`._cuda_gather`) and return at once; any
        other batch: None (see :meth:`Backend.launch_batch`)."""
        gg = self._gather_graphs
        if not LAUNCH_BATCHES or len(items) < 2 or self.inject_fault or not self.gather_batches or not gg.eligible(plan) \
                or _plan_bytes(plan) > GRAPH_MAX_BYTES or not batchable(plan):
            return None
        try:
            got = [self._checked.get(plan, ins, outs, self._host_io) for ins, outs in items]
            resident = self._lookup_resident(plan)
        except OpError:
            return None  # run_batch answers each request with its own error
        bp = self._batch_plan(plan, len(items))
        if not all(g[3] is not None for g in got) or not _gather.gatherable(plan, bp):
            return None
        t0 = time.perf_counter()
        try:
            with self._dev:
                started = gg.start(plan, bp, _columns(got), resident)
        except Exception:  # noqa: BLE001 - the launch failed: run_batch runs the batch again and reports what fails
            return None
        return None if started is None else _Launched(self, started, len(items), t0)

    def _batch_plan(self, plan: Plan, size: int) -> BatchPlan:
        entry = self._batch_plans.get((id(plan), size))
        if entry is not None and entry[0] is plan:
            return entry[1]
        if len(self._batch_plans) > 256:
            self._batch_plans.clear()
        bp = batch_plan(plan, size)
        self._batch_plans[(id(plan), size)] = (plan, bp)
        return bp

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
        log.info("CUDA graphs at close: requests %d captured / %d launched, batches by slots %d / %d (%d held, last "
                 "refusal %r), gathered batches %d / %d (%d held, last refusal %r), chunked runs %d / %d", g.captures,
                 g.launches, b.captures, b.launches, len(b), b.last_error, h.captures, h.launches, len(h), h.last_error,
                 c.captures, c.launches)
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


class _Launched:
    """A batch launched by :meth:`CupyBackend.launch_batch`."""

    __slots__ = ("_be", "_started", "_size", "_t0")

    def __init__(self, be: CupyBackend, started: _gather.Started, size: int, t0: float) -> None:
        self._be, self._started, self._size, self._t0 = be, started, size, t0

    def done(self) -> bool:
        return self._started.done()

    def finish(self) -> list[dict[str, float] | Exception]:
        try:
            self._started.finish()
        except Exception as e:  # noqa: BLE001 - a device error ends every request of the batch
            err: Exception = self._be._wrap(e, "", -1)
            return [err] * self._size
        done = {"total": time.perf_counter() - self._t0, "batch": float(self._size), "graph": 1.0, "gather": 1.0}
        return [dict(done) for _ in range(self._size)]


class _RunLaunched:
    """A request launched by :meth:`CupyBackend.launch`: its CUDA error raised as :meth:`CupyBackend.run` raises it."""

    __slots__ = ("_be", "_started", "eta")

    def __init__(self, be: CupyBackend, started: ChunkStarted) -> None:
        self._be, self._started, self.eta = be, started, started.eta

    def done(self) -> bool:
        return self._started.done()

    def finish(self) -> dict[str, float]:
        try:
            return self._started.finish()
        except Exception as e:
            raise self._be._wrap(e, "", -1) from e


def _columns(got: Sequence[_gather.Checked]) -> tuple[list[list[int]], list[list[int]]]:
    """Per input and per output, the host addresses of every request (``got``: each request's checks, all usable)."""
    return ([list(c) for c in zip(*(g[3][0] for g in got))],  # type: ignore[index]
            [list(c) for c in zip(*(g[3][1] for g in got))])  # type: ignore[index]


def _plan_bytes(plan: Plan) -> int:
    """Bytes of every tensor of ``plan`` (inputs, intermediates, outputs)."""
    return sum(t.nbytes for t in plan.tensors.values())


def _chunk_settings() -> tuple[Any, ...]:
    """The chunk pipeline's settings now (benchmarks change them in process): part of a chunk graph's key."""
    c = _cuda_chunks
    return (c.CHUNK_PIPELINE, c.CHUNK_BYTES, c.CHUNK_MIN_BYTES, c.CHUNK_STREAMS)
