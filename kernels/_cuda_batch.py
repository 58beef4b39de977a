"""Batches on the CuPy backend: the joint run of B requests of one plan, and CUDA graphs of it.

The joint run (:func:`issue_joint`), enqueued on one stream::

    H2D   request b's input n  -> slice b of one (B, *shape) device buffer per input     B x inputs copies
    steps every step once, with (B, *shape) specs (:func:`._batch.batch_plan`)
    D2H   slice b of each output -> request b's output view                          B x outputs copies

:class:`BatchGraphs` captures that run as one CUDA graph per key::

    key = (plan, B, every host address of every request's views, resident device addresses)

    seen once, twice    plain joint run
    third sight    plain joint run on a private stream and memory pool (this batch's result);
                   plans with a cuBLAS product (gemm, gemm_bias): the same run again through
                   :class:`._cuda_blas.CaptureXp`, whose bits must equal the plain run's;
                   then capture; then one launch of the graph, whose bits must equal too
    afterwards     graph.launch(stream); event.synchronize()     one launch, one synchronize

The worker's clients reuse their slots, so the same requests' views come back at the same host
addresses and a key repeats; requests are taken in the order of their addresses, so the same
requests arriving in another order are the same key. A capture spreads the requests' copies over
:data:`COPY_LANES` branches of the graph (independent nodes the copy engines may run at once). A graph copies from exactly its key's input addresses and into
exactly its output addresses, so it writes no host range but its requests' outputs; it keeps
every device array it uses alive (its private pool, the captured run's arrays, the residents it
reads). Views must be page-locked, and no output may overlap any view of the batch (in-place
batches run the plain path: the check launches the graph over the same inputs once more). A
capture that fails or a graph whose bits differ is remembered: that plan runs the plain path
from then on; so does a plan whose batches seldom repeat (after PAYBACK_MIN_CAPTURES captures,
fewer than PAYBACK_LAUNCHES launches per capture: requests spread over many slots, in ever
other sets, as ``Client.call`` from 8 processes makes them, would pay captures and win nothing). Graphs are dropped with the backend's (reset, unregister, close) and the oldest
when ``limit`` are held. Graphs run on one stream of this cache, one after another, so the
cuBLAS workspace they share is never used by two at once.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._batch import BatchPlan
from ._cuda_blas import BLAS_OPS, CapturableBlas, CaptureXp
from ._cuda_graph import _NONE, GRAPH_OPS, _Graphs, pinned
from ._dtypes import storage_dtype
from ._plan import Plan, kept_for_plan
from ._registry import TensorSpec

__all__ = ["BatchGraphs", "Shared", "issue_joint", "address"]

Views = Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]]
#: ``step(st, ins, in_specs, out_specs, workspace, xp)``: one step on the current stream, ``xp`` its array module.
Step = Callable[[Any, dict[str, Any], Mapping[str, TensorSpec], Mapping[str, TensorSpec], dict[str, Any], Any],
                dict[str, Any]]
#: ``issue(xp, stream, workspace, copying_out, capture)``: enqueue one batch's whole run on ``stream``; returns
#: every device array it used.
Issue = Callable[[Any, Any, dict[str, Any], list[bool], bool], dict[str, Any]]

#: Copies of a captured batch are spread over this many branches of the graph (requests round robin).
COPY_LANES = 4
#: A capture costs about four joint runs and an instantiation, a launch saves part of one: once a plan has
#: this many captures and fewer than PAYBACK_LAUNCHES launches per capture, it runs the plain path.
PAYBACK_MIN_CAPTURES = 16
PAYBACK_LAUNCHES = 16
_ADDR: dict[int, tuple[Any, int]] = {}


def address(v: np.ndarray) -> int:
    """``v.ctypes.data``, remembered per view object (a view's data pointer never changes; an array
    owning its data might be resized, so only views are remembered)."""
    e = _ADDR.get(id(v))
    if e is not None and e[0]() is v:
        return e[1]
    a = int(v.ctypes.data)
    if not v.flags.owndata:
        if len(_ADDR) > 4096:
            _ADDR.clear()
        _ADDR[id(v)] = (weakref.ref(v), a)
    return a


def issue_joint(cp: Any, step: Step, xp: Any, plan: Plan, bp: BatchPlan,
                checked: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]],
                resident: Mapping[str, Any], stream: Any, workspace: dict[str, Any], copying_out: list[bool],
                copy_streams: Sequence[Any] = ()) -> dict[str, Any]:
    """Enqueue the joint run of ``checked`` (contiguous views) on ``stream``; no synchronize.

    ``copy_streams``: request b's copies go on ``copy_streams[b % len]`` (forked from ``stream`` by an
    event, joined back before the steps and at the end), so that in a graph they are independent
    nodes the copy engines may run at once; else all on ``stream``. Returns every device array it
    used; sets ``copying_out[0]`` when copies into the views begin.
    """
    rt = cp.cuda.runtime
    h2d, d2h = rt.memcpyHostToDevice, rt.memcpyDeviceToHost
    lanes = list(copy_streams) or [stream]
    ptrs = [s.ptr for s in lanes]
    env: dict[str, Any] = {}
    with stream:
        _fork(stream, copy_streams)
        for name, spec in plan.inputs.items():
            if name in plan.resident:
                continue
            dev = cp.empty((bp.size, *spec.shape), dtype=storage_dtype(spec.dtype))
            per, base = spec.nbytes, dev.data.ptr
            if per:
                for b, (host_in, _) in enumerate(checked):
                    rt.memcpyAsync(base + b * per, address(host_in[name]), per, h2d, ptrs[b % len(ptrs)])
            env[name] = dev
        _join(stream, copy_streams)
        env.update(resident)
        for st, (in_specs, out_specs) in zip(plan.steps, bp.steps):
            res = step(st, {p: env[n] for p, n in st.inputs.items()}, in_specs, out_specs, workspace, xp)
            for p, n in st.outputs.items():
                env[n] = res[p]
        outs = {n: cp.ascontiguousarray(env[n]) for n in plan.outputs}
        env.update({"#d2h." + n: a for n, a in outs.items()})
        copying_out[0] = True
        _fork(stream, copy_streams)
        for name, spec in plan.outputs.items():
            per, base = spec.nbytes, outs[name].data.ptr
            step_b = per if name in bp.batched else 0
            if per:
                for b, (_, host_out) in enumerate(checked):
                    rt.memcpyAsync(address(host_out[name]), base + b * step_b, per, d2h, ptrs[b % len(ptrs)])
        _join(stream, copy_streams)
    return env


def _fork(stream: Any, others: Sequence[Any]) -> None:
    if others:
        ev = stream.record()
        for s in others:
            s.wait_event(ev)


def _join(stream: Any, others: Sequence[Any]) -> None:
    for s in others:
        stream.wait_event(s.record())


class _Graph:
    __slots__ = ("graph", "event", "lock", "hold", "fill", "pending")

    def __init__(self, graph: Any, event: Any, hold: tuple[Any, ...], fill: Callable[[Any], None] | None = None) -> None:
        self.graph = graph
        self.event = event
        # NOTE: re-entrant: a thread holding it for a launch it has not finished (GatherGraphs.start) may still
        # retire the graph (a reset after an error) or launch it again (which first waits for the device)
        self.lock = threading.RLock()
        self.hold = hold
        self.fill = fill  # writes a batch's rows into the graph's own table before a launch (gather graphs)
        self.pending = False  # launched by start(), not finished yet

    def sync(self) -> None:
        self.event.synchronize()


class Shared:
    """What every batch graph of a backend shares: the one stream they are launched on, one after another
    (``launch_lock``), the lock of captures, and the cuBLAS handle and workspace of their products."""

    def __init__(self, cupy: Any) -> None:
        self.cp = cupy
        self.launch_lock = threading.Lock()
        self.capture_lock = threading.Lock()
        self.stream: Any = None
        self.copy_streams: list[Any] = []
        self.blas: CapturableBlas | None = None
        self.xp: CaptureXp | None = None

    def capture_xp(self) -> CaptureXp:
        """The array module whose ``matmul`` a capture may hold (under the capture lock); raises when there is
        no cuBLAS of our own (library, symbols)."""
        if self.xp is None:
            self.blas = CapturableBlas(self.cp)  # outside any private pool: it lives as long as the backend
            self.xp = CaptureXp(self.cp, self.blas)
        return self.xp

    def close(self) -> None:
        with self.capture_lock:
            if self.blas is not None:
                self.blas.close()
            self.blas, self.xp, self.stream, self.copy_streams = None, None, None, []


class _BatchCaptures(_Graphs):
    """What the batch graphs share: the capture of one batch's run as a graph (the warm run, the cuBLAS check,
    the capture, one launch whose bits must equal the warm run's), and launches on the shared stream.

    ``step`` runs one step (see :data:`Step`); ``capturing`` is the backend's thread-local whose
    ``capturing`` attribute is set while a capture is under way (a refused capture is no device error);
    ``shared``: the stream, locks and cuBLAS handle of the backend's other batch graphs (None: its own).
    """

    def __init__(self, cupy: Any, step: Step, limit: int, after: int, capturing: threading.local,
                 shared: Shared | None = None) -> None:
        super().__init__(cupy, limit, after, capturing)
        self._step = step
        self._sh = shared if shared is not None else Shared(cupy)
        self._ops_ok: dict[int, tuple[Plan, Any]] = {}  # id(plan) -> (plan, whether its ops may be captured)


    def eligible(self, plan: Plan) -> bool:
        """Whether ``plan`` may ever be captured as a batch (its ops, no capture of it failed). What its ops allow is
        kept per plan (a plan's steps never change)."""
        if self.limit <= 0 or id(plan) in self._failed:
            return False
        return kept_for_plan(self._ops_ok, id(plan), plan, lambda: all(
            st.op.builtin and (st.op.name in GRAPH_OPS or st.op.name in BLAS_OPS) for st in plan.steps))


    def _launch(self, g: _Graph, rows: Any = None) -> bool:
        with g.lock:
            if g.graph is None:
                return False
            with self._sh.launch_lock:
                if g.pending:
                    g.event.synchronize()  # this thread's unfinished launch of g still reads the table
                if g.fill is not None:
                    g.fill(rows)  # NOTE: the previous launch of g has finished: its table is free
                g.graph.launch(self._sh.stream)
                g.event.record(self._sh.stream)
            g.event.synchronize()
        return True


    def _capture(self, key: tuple[Any, ...], plan: Plan, checked: Views, resident: Mapping[str, Any],
                 copying_out: list[bool], issue: Issue, fill: Callable[[dict[str, Any]], Any] | None = None,
                 rows: Any = None) -> bool | None:
        """Capture ``issue``'s run of this batch as the graph of ``key`` (under the capture lock; see the module
        doc); ``fill(used)``: the graph's row filler, made from the device arrays of the captured run, called
        with ``rows`` before each launch."""
        cp, sh = self._cp, self._sh
        outs = [v for _, ho in checked for v in ho.values()]
        uses_blas = any(st.op.name in BLAS_OPS for st in plan.steps)
        if sh.stream is None:
            sh.stream = cp.cuda.Stream(non_blocking=True)
        xp = cp
        if uses_blas:
            try:
                xp = sh.capture_xp()
            except Exception as e:  # noqa: BLE001 - no cuBLAS of our own (library, symbols): plain path
                self._fail(plan, f"no cuBLAS handle for captures: {type(e).__name__}: {e}")
                return None
        pool = cp.cuda.MemoryPool()
        stream = cp.cuda.Stream(non_blocking=True)
        ws: dict[str, Any] = {}
        with cp.cuda.using_allocator(pool.malloc):
            # warm: the plain joint run, this batch's result; kernels compiled, the private pool filled
            issue(cp, stream, ws, copying_out, False)
            stream.synchronize()
            want = [np.array(v, copy=True) for v in outs]
            if uses_blas:
                try:
                    with sh.launch_lock:  # NOTE: on the graphs' stream: the cuBLAS workspace is theirs too
                        issue(xp, sh.stream, ws, [False], False)
                        sh.stream.synchronize()
                except Exception as e:  # noqa: BLE001 - not capturable this way: plain path from now on
                    return self._refuse(plan, outs, want, f"{type(e).__name__}: {e}")
                if not _same(outs, want):
                    return self._refuse(plan, outs, want, "cuBLAS called directly gave other bits than cupy.matmul")
            self._tls.capturing = True
            try:
                stream.begin_capture()
                try:
                    used = issue(xp, stream, ws, [False], True)
                finally:
                    graph = stream.end_capture()
            except Exception as e:  # noqa: BLE001 - an op that synchronizes, a product CuPy must issue: plain path
                return self._refuse(plan, outs, want, f"{type(e).__name__}: {e}")
            finally:
                self._tls.capturing = False
        graph.upload(sh.stream)
        g = _Graph(graph, cp.cuda.Event(disable_timing=True), (plan, pool, used, ws, dict(resident)),
                   fill(used) if fill is not None else None)
        self._launch(g, rows)
        if not _same(outs, want):
            return self._refuse(plan, outs, want, "the graph gave other bits than the plain joint run")
        self._store(key, g)
        self.captures += 1
        return True


    def _refuse(self, plan: Plan, outs: list[np.ndarray], want: list[np.ndarray], why: str) -> bool:
        for v, w in zip(outs, want):
            np.copyto(v, w)  # the plain run's result stands
        self._fail(plan, why)
        return False


    def close(self) -> None:
        """:meth:`clear`, then free the cuBLAS handle and workspace the graphs used."""
        self.clear()
        self._sh.close()


class BatchGraphs(_BatchCaptures):
    """Graphs of joint runs by key (the plan, B and every request's host addresses), at most ``limit``;
    captured on the ``after``-th sight of a key (see the module doc)."""

    def __init__(self, cupy: Any, step: Step, limit: int, after: int, capturing: threading.local,
                 shared: Shared | None = None) -> None:
        super().__init__(cupy, step, limit, after, capturing, shared)
        self._uses: dict[int, tuple[Plan, list[int]]] = {}  # id(plan) -> (plan, [captures, launches])

    def run(self, plan: Plan, bp: BatchPlan, checked: Views, resident: Mapping[str, Any], copying_out: list[bool]
            ) -> bool | None:
        """Serve this batch: True by a graph (launched, or captured after the warm run); False by the
        plain joint run of a capture that was refused; None: not served, run the plain joint path.

        Raises what the plain joint run raises (its warm run is that run); a graph's launch failing
        raises the CUDA error with ``copying_out[0]`` set.
        """
        per_item = [(*(address(v) for v in hi.values()), *(address(v) for v in ho.values())) for hi, ho in checked]
        order = sorted(range(len(checked)), key=per_item.__getitem__)
        if order != list(range(len(checked))):
            # NOTE: each request's copies follow its own addresses, so one graph serves the same requests in
            # any order of arrival: the key and the run take them sorted by address
            checked = [checked[b] for b in order]
        key = (id(plan), len(checked), *(a for b in order for a in per_item[b]), *(r.data.ptr for r in resident.values()))
        g = self._lookup(key)
        if g is False or g is _NONE:
            return None
        entry = self._uses.get(id(plan))
        if entry is None or entry[0] is not plan:
            entry = self._uses[id(plan)] = (plan, [0, 0])
        uses = entry[1]
        if g is None:
            if uses[0] >= PAYBACK_MIN_CAPTURES and uses[1] < PAYBACK_LAUNCHES * uses[0]:
                self._fail(plan, f"its batches seldom come back on the same slots ({uses[0]} captures, {uses[1]} "
                                 "launches): the plain joint path")
                return None
            views = [v for item in checked for side in item for v in side.values() if v.nbytes]
            spans = [(address(v), address(v) + v.nbytes) for v in views]
            if not all(pinned(self._cp, a) for a, _ in spans) or _overlap(spans):
                self._store(key, _NONE)  # DMA in a graph needs pinned pages; the capture's check re-reads the inputs
                return None
            with self._sh.capture_lock:
                done = self._capture(key, plan, checked, resident, copying_out, self._joint(plan, bp, checked, resident))
            uses[0] += done is True
            return done
        copying_out[0] = True
        if not self._launch(g):
            copying_out[0] = False
            return None  # dropped meanwhile (a reset): the plain path
        self.launches += 1
        uses[1] += 1
        return True


    def _fail(self, plan: Plan, why: str) -> None:
        super()._fail(plan, why)
        if len(self._uses) > 4 * max(1, self.limit):
            self._uses.clear()


    def _joint(self, plan: Plan, bp: BatchPlan, checked: Views, resident: Mapping[str, Any]) -> Issue:
        def issue(xp: Any, stream: Any, ws: dict[str, Any], copying_out: list[bool], capture: bool) -> dict[str, Any]:
            lanes = self._lanes(len(checked)) if capture else ()
            return issue_joint(self._cp, self._step, xp, plan, bp, checked, resident, stream, ws, copying_out, lanes)
        return issue


    def _lanes(self, size: int) -> list[Any]:
        """Streams for the copies of a capture (under the capture lock): at most COPY_LANES, one per request."""
        lanes = self._sh.copy_streams
        while len(lanes) < min(size, COPY_LANES):
            lanes.append(self._cp.cuda.Stream(non_blocking=True))
        return lanes[:min(size, COPY_LANES)] if size > 1 else []


    def clear(self) -> None:
        """Drop every graph (after each one's last launch finished) and the counts."""
        super().clear()
        self._uses.clear()


def _overlap(spans: list[tuple[int, int]]) -> bool:
    s = sorted(spans)
    return any(b[0] < a[1] for a, b in zip(s, s[1:]))


def _same(outs: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return all(np.array_equal(v.reshape(-1).view(np.uint8), w.reshape(-1).view(np.uint8)) for v, w in zip(outs, want))
