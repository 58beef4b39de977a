"""CUDA graphs for small requests that repeat: H2D + kernels + D2H captured once, launched after.

The worker answers a primed request from the same slot views every time, so a small plan
that repeats does so at the same host addresses. The second time a key is seen::

    key = (plan, host input addresses, host output addresses, resident device addresses)

    seen once      plain run (the backend's own path)
    seen twice     warm run on a private stream and memory pool (this request's result,
                   kernels compiled), then capture of the same work on that stream
    afterwards     graph.launch(stream); stream.synchronize()   one launch, one sync

A graph copies from exactly the key's input addresses and into exactly its output addresses
(the views of the request it serves), so it never writes a host range that is not that
request's outputs. Every device array it touches stays alive with it: the private pool
(temporaries freed during capture return there, and nothing else allocates from it), the
arrays of the captured run, the resident arrays it reads. Graphs are dropped when the
backend resets (a CUDA error), when host memory is unregistered, on close, and the oldest
when the cache is full. A capture that fails (an op that synchronizes, an unpinned view)
is remembered, and that plan (or key) runs the plain path from then on.

:class:`ChunkGraphs` does the same for whole chunked runs of large elementwise requests (the
chunk pipeline of :mod:`._cuda_chunks` captured over its streams); batches are captured in
:mod:`._cuda_batch`.

Only plans of the built-in ops in :data:`GRAPH_OPS` are captured: their CuPy code launches
kernels and nothing else. cuBLAS (``gemm``) keeps its workspace with a per-thread handle,
which a graph launched from another thread would outlive, so it is left out.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._plan import Plan

__all__ = ["GraphCache", "ChunkGraphs", "ChunkStarted", "GRAPH_OPS", "pinned", "request_key"]

#: Ops whose CuPy implementations may be captured (kernels only: no sync, no library handle).
GRAPH_OPS = frozenset({"echo", "vector_add", "scale", "gelu", "layernorm", "layernorm_gelu", "softmax"})
_HOST = 1  # cudaMemoryTypeHost: pinned or registered host memory

Issue = Callable[[Plan, Mapping[str, np.ndarray], Mapping[str, np.ndarray], Mapping[str, Any], Any, dict[str, Any]],
                 dict[str, Any]]


class _Graph:
    """One captured request: the executable graph, its stream, and everything it must keep alive."""

    __slots__ = ("graph", "stream", "lock", "hold", "last_s", "pending")

    def __init__(self, graph: Any, stream: Any, hold: tuple[Any, ...]) -> None:
        self.graph = graph
        self.stream = stream
        # NOTE: re-entrant: the thread holding it for a launch it has not finished (ChunkGraphs.start) may still
        # retire the graph (a reset after an error); a launch on the same stream runs after the first
        self.lock = threading.RLock()
        self.hold = hold
        self.last_s = 0.0  # the device's time of its last launch by start() (0: none yet)
        self.pending = False  # launched by start(), not finished yet

    def sync(self) -> None:
        self.stream.synchronize()


_NONE = object()  # a key whose capture was refused (unpinned views): plain path


class _Graphs:
    """What the graph caches share: graphs by key, at most ``limit``, in use order; the sights of keys not
    captured yet (a key is captured on its ``after``-th sight); the plans whose capture failed; counts."""

    def __init__(self, cupy: Any, limit: int, after: int, capturing: threading.local) -> None:
        self._cp = cupy
        self.limit = limit
        self.after = max(2, after)
        self._tls = capturing
        self._lock = threading.Lock()
        self._graphs: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._seen: dict[tuple[Any, ...], int] = {}
        self._failed: dict[int, Plan] = {}
        self.captures = 0
        self.launches = 0
        self.last_error = ""  # why the last capture failed

    def eligible(self, plan: Plan) -> bool:
        """Whether ``plan`` may ever be captured (kernel-only ops, no keep, no mutation, no failed capture)."""
        return (self.limit > 0 and not plan.keep and id(plan) not in self._failed
                and all(st.op.name in GRAPH_OPS and st.op.builtin and not st.op.mutates for st in plan.steps))

    def _lookup(self, key: tuple[Any, ...]) -> Any:
        """The graph of ``key``, or ``_NONE`` (never a graph for this key), or ``None`` (this is its ``after``-th
        sight: capture it now), or ``False`` (seen fewer times: the plain path)."""
        with self._lock:
            g = self._graphs.get(key)
            if g is None:
                n = self._seen.get(key, 0) + 1
                if len(self._seen) > 16 * max(1, self.limit):
                    self._seen.clear()
                self._seen[key] = n
                if n < self.after:
                    return False
            elif g is not _NONE:
                self._graphs.move_to_end(key)
        return g

    def _claim(self, key: tuple[Any, ...]) -> Any:
        """The graph of ``key`` with its lock held, for a launch finished later (``start``); None: no graph yet,
        or it is retired or busy (another thread's run, or a launch not finished)."""
        with self._lock:
            g = self._graphs.get(key)
            if g is None or g is _NONE:
                return None
            self._graphs.move_to_end(key)
        if not g.lock.acquire(blocking=False):
            return None
        if g.graph is None or g.pending:
            g.lock.release()
            return None
        return g

    def _store(self, key: tuple[Any, ...], g: Any) -> None:
        with self._lock:
            self._graphs[key] = g
            self._seen.pop(key, None)
            while len(self._graphs) > self.limit:
                _, old = self._graphs.popitem(last=False)
                self._retire(old)

    def _fail(self, plan: Plan, why: str) -> None:
        """Remember that ``plan`` is not captured (``why``): the plain path from now on."""
        self.last_error = why
        with self._lock:
            if len(self._failed) > 4 * max(1, self.limit):
                self._failed.clear()
            self._failed[id(plan)] = plan

    def clear(self) -> None:
        """Drop every graph (after each one's last launch finished) and the counts."""
        with self._lock:
            graphs = list(self._graphs.values())
            self._graphs.clear()
            self._seen.clear()
            self._failed.clear()
        for g in graphs:
            self._retire(g)

    @staticmethod
    def _retire(g: Any) -> None:
        if g is _NONE:
            return
        with g.lock:  # a launch in flight finishes (and syncs) first
            try:
                g.sync()
            except Exception:  # noqa: BLE001 - after a sticky error there is nothing left to wait for
                pass
            g.graph = None
            g.hold = ()

    def __len__(self) -> int:
        return sum(1 for g in self._graphs.values() if g is not _NONE)


class GraphCache(_Graphs):
    """Graphs by key, at most ``limit``; ``after``: captured on the ``after``-th sight of a key.

    ``issue(plan, host_in, host_out, resident, stream, workspace)`` enqueues one whole run
    (H2D, steps, D2H) on ``stream`` and returns the device arrays it used.
    """

    def __init__(self, cupy: Any, issue: Issue, limit: int, after: int, capturing: threading.local) -> None:
        super().__init__(cupy, limit, after, capturing)
        self._issue = issue

    def run(self, plan: Plan, host_in: Mapping[str, np.ndarray], host_out: Mapping[str, np.ndarray],
            resident: Mapping[str, Any]) -> bool:
        """Serve this request by a graph (or by the warm run of a capture); False: run the plain path."""
        views = [*host_in.values(), *host_out.values()]
        key = request_key(plan, views, resident)
        if key is None:
            return False
        g = self._lookup(key)
        if g is False or g is _NONE:
            return False
        if g is None:
            return self._capture(key, plan, host_in, host_out, resident, views)
        with g.lock:
            g.graph.launch(g.stream)
            g.stream.synchronize()
        self.launches += 1
        return True

    def launch_captured(self, key: tuple[Any, ...]) -> bool:
        """Serve a request by the graph of ``key`` (the key :meth:`run` makes) if one is captured and live: launch,
        synchronize; False (nothing done, no sight counted): let :meth:`run` serve it."""
        with self._lock:
            g = self._graphs.get(key)
            if g is None or g is _NONE:
                return False
            self._graphs.move_to_end(key)
        with g.lock:
            if g.graph is None:
                return False  # retired meanwhile (a reset)
            g.graph.launch(g.stream)
            g.stream.synchronize()
        self.launches += 1
        return True

    def _capture(self, key: tuple[Any, ...], plan: Plan, host_in: Mapping[str, np.ndarray],
                 host_out: Mapping[str, np.ndarray], resident: Mapping[str, Any], views: list[np.ndarray]) -> bool:
        cp = self._cp
        if not all(v.nbytes == 0 or pinned(cp, v.ctypes.data) for v in views):
            self._store(key, _NONE)  # a graph copies by DMA only from pinned pages
            return False
        pool = cp.cuda.MemoryPool()
        stream = cp.cuda.Stream(non_blocking=True)
        workspace: dict[str, Any] = {}
        with cp.cuda.using_allocator(pool.malloc):
            # warm: this request's own result, kernels compiled, the private pool filled
            self._issue(plan, host_in, host_out, resident, stream, workspace)
            stream.synchronize()
            self._tls.capturing = True
            try:
                stream.begin_capture()
                try:
                    used = self._issue(plan, host_in, host_out, resident, stream, workspace)
                finally:
                    graph = stream.end_capture()
            except Exception as e:  # noqa: BLE001 - not capturable (an op synchronizes, ...): plain path from now on
                self._fail(plan, f"{type(e).__name__}: {e}")
                return True
            finally:
                self._tls.capturing = False
        upload = getattr(graph, "upload", None)
        if upload is not None:
            upload(stream)  # the graph's resources now, not at its first launch
        self._store(key, _Graph(graph, stream, (plan, pool, used, workspace, dict(resident))))
        self.captures += 1
        return True



#: ``chunked(streams, workspace, capture, hold)``: the chunked run of one request on ``streams``; with
#: ``capture`` it enqueues only (no synchronize, no timing) and appends the arrays it uses to ``hold``.
Chunked = Callable[[list[Any], dict[str, Any], bool, list[Any]], dict[str, float]]


class ChunkGraphs(_Graphs):
    """Graphs of whole chunked runs (large elementwise requests) by key, at most ``limit``.

    Key: (plan, host input and output addresses, resident device addresses, chunk settings). Seen
    once: the plain chunked run; seen twice: the chunked run on private streams and a private pool
    (this request's result), then the same run captured (multi-stream: the other streams wait on
    an event of the first, which waits on theirs at the end); after: ``graph.launch``, one
    synchronize, no Python per chunk (so no thread waiting for the GIL slows the copies). A graph
    holds every chunk's device buffers (about the bytes the request moves, in and out) for as long
    as it is kept; out of device memory at capture, that key runs the plain path.
    """

    def run(self, plan: Plan, host_in: Mapping[str, np.ndarray], host_out: Mapping[str, np.ndarray],
            resident: Mapping[str, Any], settings: tuple[Any, ...], n_streams: int, chunked: Chunked
            ) -> dict[str, float] | None:
        """Stage seconds of this request served by a graph (or by the capture's warm run); None: run the plain path."""
        views = [*host_in.values(), *host_out.values()]
        key = _chunk_key(plan, views, resident, settings)
        g = self._lookup(key)
        if g is False or g is _NONE:
            return None
        if g is None:
            return self._capture(key, plan, views, n_streams, chunked)
        with g.lock:
            if g.graph is None:
                return None  # dropped meanwhile (a reset): the plain path
            g.graph.launch(g.stream)
            g.stream.synchronize()
            chunks = float(g.hold[0])
        self.launches += 1
        return {"graph": 1.0, "chunks": chunks}

    def start(self, plan: Plan, host_in: Mapping[str, np.ndarray], host_out: Mapping[str, np.ndarray],
              resident: Mapping[str, Any], settings: tuple[Any, ...]) -> ChunkStarted | None:
        """Launch this request's graph without waiting for it (None: no graph yet, or that graph is busy: run it
        the other way). The graph stays the calling thread's until :meth:`ChunkStarted.finish`."""
        g = self._claim(_chunk_key(plan, [*host_in.values(), *host_out.values()], resident, settings))
        if g is None:
            return None
        try:
            t0 = time.perf_counter()
            first = g.stream.record()
            g.graph.launch(g.stream)
            last = g.stream.record()
        except BaseException:
            g.lock.release()
            raise
        g.pending = True
        self.launches += 1
        return ChunkStarted(self._cp, g, first, last, t0)

    def _capture(self, key: tuple[Any, ...], plan: Plan, views: list[np.ndarray], n_streams: int,
                 chunked: Chunked) -> dict[str, float] | None:
        cp = self._cp
        if not all(v.nbytes == 0 or pinned(cp, v.ctypes.data) for v in views):
            self._store(key, _NONE)
            return None
        pool = cp.cuda.MemoryPool()
        streams = [cp.cuda.Stream(non_blocking=True) for _ in range(n_streams)]
        workspace: dict[str, Any] = {}
        with cp.cuda.using_allocator(pool.malloc):
            try:
                times = chunked(streams, workspace, False, [])  # warm: this request's result, the pool filled
            except cp.cuda.memory.OutOfMemoryError:
                for s in streams:
                    s.synchronize()
                pool.free_all_blocks()
                self._store(key, _NONE)
                return None
            hold: list[Any] = []
            self._tls.capturing = True
            try:
                streams[0].begin_capture()
                try:
                    chunked(streams, workspace, True, hold)
                finally:
                    graph = streams[0].end_capture()
            except Exception as e:  # noqa: BLE001 - not capturable: the plain path from now on
                self._fail(plan, f"{type(e).__name__}: {e}")
                return times
            finally:
                self._tls.capturing = False
        upload = getattr(graph, "upload", None)
        if upload is not None:
            upload(streams[0])
        self._store(key, _Graph(graph, streams[0], (times.get("chunks", 0.0), plan, pool, hold, streams, workspace)))
        self.captures += 1
        return times



class ChunkStarted:
    """A chunk graph launched by :meth:`ChunkGraphs.start`: ``done()`` asks the device (no wait), ``eta`` is when
    it should be done (its last launch's duration; 0: not known), ``finish()`` waits and gives the graph back
    (once, on the launching thread; raises the CUDA error of the run) and returns its stage seconds."""

    __slots__ = ("_cp", "_g", "_first", "_last", "_t0", "eta")

    def __init__(self, cupy: Any, g: _Graph, first: Any, last: Any, t0: float) -> None:
        self._cp, self._g, self._first, self._last, self._t0 = cupy, g, first, last, t0
        self.eta = t0 + g.last_s if g.last_s else 0.0

    def done(self) -> bool:
        try:
            return bool(self._last.done)
        except Exception:  # noqa: BLE001 - a device error: finish() raises it
            return True

    def finish(self) -> dict[str, float]:
        g = self._g
        try:
            self._last.synchronize()
            g.last_s = float(self._cp.cuda.get_elapsed_time(self._first, self._last)) / 1e3  # the device's time
            return {"total": time.perf_counter() - self._t0, "graph": 1.0, "chunks": float(g.hold[0]) if g.hold else 0.0}
        finally:
            g.pending = False
            g.lock.release()


def request_key(plan: Plan, views: list[np.ndarray], resident: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The key of one request's graph in :class:`GraphCache`: the plan, its views' host addresses (inputs, then
    outputs) and its resident tensors' device addresses; None for views that are not all contiguous (no graph)."""
    if not all(v.flags.c_contiguous for v in views):
        return None
    return (id(plan), *(v.ctypes.data for v in views), *(r.data.ptr for r in resident.values()))


def _chunk_key(plan: Plan, views: list[np.ndarray], resident: Mapping[str, Any], settings: tuple[Any, ...]) -> tuple[Any, ...]:
    return (id(plan), *(v.ctypes.data for v in views), *(r.data.ptr for r in resident.values()), *settings)


def pinned(cp: Any, address: int) -> bool:
    """Whether host ``address`` is page-locked (pinned or registered) memory."""
    try:
        return int(cp.cuda.runtime.pointerGetAttributes(address).type) == _HOST
    except Exception:  # noqa: BLE001 - older drivers refuse pageable addresses: not pinned
        return False
