"""Batches and launches of the CuPy backend: :meth:`CupyBackend.run_batch`, :meth:`CupyBackend.launch_batch`
and :meth:`CupyBackend.launch`, the functions here bound as the backend's methods (so they resolve as any
method does), with the handles their launches return.

Batches (:func:`run_batch`): a batchable plan over B requests copies each request's inputs into its slice
of one (B, ...) device buffer, runs every step once, copies each request's slice of the outputs back, and
synchronizes once; a small batch seen before at the same host addresses is one CUDA graph
(:mod:`._cuda_batch`, cuBLAS products through :mod:`._cuda_blas`); other batches of >= GATHER_MIN_BATCH
small requests over views the device may read at their host address copy by one gather and one scatter
launch (:mod:`._cuda_gather`).

Launches (:func:`launch_batch`, :func:`launch`): a batch a graph of gathered batches serves, and a chunked
request seen before at the same host addresses (one CUDA graph of its whole chunk pipeline: ``ChunkGraphs``
in :mod:`._cuda_graph`), are launched and answered when done.

``GRAPH_MAX_BYTES``, :func:`plan_bytes` and :func:`chunk_settings` serve single runs too; they live here so
that :mod:`._backend_cupy`, which imports this module, is the only one of the two that imports the other.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _cuda_chunks
from . import _cuda_gather as _gather
from ._backend_base import Backend, BatchItem, BatchLaunch, RunLaunch
from ._batch import BatchPlan, batch_plan, batchable
from ._cuda_batch import issue_joint
from ._cuda_graph import ChunkStarted
from ._errors import OpError
from ._plan import Plan, bounded_put, kept_for_plan

if TYPE_CHECKING:
    from ._backend_cupy import CupyBackend

__all__ = ["GRAPH_MAX_BYTES", "LAUNCH_BATCHES", "BATCH_SINGLES", "run_batch", "launch", "launch_batch", "plan_bytes",
           "chunk_settings"]

#: Plans whose tensors total at most this many bytes keep device buffers and may become graphs.
GRAPH_MAX_BYTES = 4 << 20
#: Batches a gathered graph serves, and large requests a chunk graph serves, are launched and answered when done
#: (:meth:`CupyBackend.launch_batch`, :meth:`CupyBackend.launch`); ``SHMRPC_CUDA_LAUNCH_BATCHES=0``: run and
#: waited for by the caller, as any other.
LAUNCH_BATCHES = (os.environ.get("SHMRPC_CUDA_LAUNCH_BATCHES", "") or "1") != "0"
#: ``SHMRPC_CUDA_BATCH_SINGLES=1`` (opt-in): a lone small request of a batchable plan is run and launched as a batch
#: of one (its gathered graph, answered once the device is done, the worker's loop not blocked meanwhile), where a
#: graph of gathered batches may serve the plan (:func:`_single_batch`). Off by default: on the GPU host it made a
#: 64 B ``scale`` 30-60 µs slower and 8 gemm clients at most 20% faster (docs/benchmarks.md).
BATCH_SINGLES = os.environ.get("SHMRPC_CUDA_BATCH_SINGLES", "") == "1"

Items = Sequence[BatchItem]
Addrs = tuple[list[list[int]], list[list[int]]]


def run_batch(be: CupyBackend, plan: Plan, items: Items) -> list[dict[str, float] | Exception]:
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
    if (len(items) < 2 and not _single_batch(be, plan, items)) or be.inject_fault or not batchable(plan):
        return Backend.run_batch(be, plan, items)
    t0 = time.perf_counter()
    gg = be._gather_graphs
    graphs = plan_bytes(plan) <= GRAPH_MAX_BYTES
    prepared = _prepare(be, plan, items,
                        be.gather_batches and (len(items) >= be.gather_min_batch or graphs and gg.eligible(plan)))
    if prepared is None:
        return Backend.run_batch(be, plan, items)
    got, resident, bp, addrs = prepared
    if not all(g[2] for g in got):  # a view not C-contiguous
        return Backend.run_batch(be, plan, items)
    checked = [(g[0], g[1]) for g in got]
    gather = addrs is not None and len(items) >= be.gather_min_batch
    copying_out = [False]
    graphed: bool | None = None
    with be._dev:
        sset = be._acquire()
        s = sset.streams[0]
        try:
            if addrs is not None and graphs and gg.eligible(plan):
                graphed = gg.run(plan, bp, addrs, checked, resident, copying_out)
                gather = gather or graphed is not None
            elif graphs and be._batch_graphs.eligible(plan):
                graphed = be._batch_graphs.run(plan, bp, checked, resident, copying_out)
                gather = gather and graphed is None
            if graphed is None and gather and addrs is not None:
                if sset.table is None:
                    sset.table = _gather.RowTable(be.xp)
                bufs = _gather.stacked_bufs(sset.batch_bufs, plan, len(items), plan_bytes(plan))
                _gather.issue_gathered(be.xp, be._step, plan, bp, addrs, resident, s, sset.workspace, copying_out,
                                       sset.table, bufs)
                s.synchronize()
            elif graphed is None:
                gather = False
                issue_joint(be.xp, be._step, None, plan, bp, checked, resident, s, sset.workspace, copying_out)
                s.synchronize()
        except Exception as e:  # noqa: BLE001 - the batch failed as a whole
            try:
                s.synchronize()  # NOTE: a launch may still read this stream set's table
            except Exception:  # noqa: BLE001 - a device error: reported below, the stream set is dropped
                pass
            be._release(sset)
            if not copying_out[0]:
                return Backend.run_batch(be, plan, items)
            err = e if isinstance(e, OpError) else be._wrap(e, "", -1)
            return [err for _ in items]
        be._release(sset)
    dt = time.perf_counter() - t0
    done = {"total": dt, "batch": float(len(items))}
    if graphed is True:
        done["graph"] = 1.0
    if gather:
        done["gather"] = 1.0
    return [dict(done) for _ in items]


def launch(be: CupyBackend, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]
           ) -> RunLaunch | None:
    """Launch a large request that a graph of its chunked run serves (:class:`._cuda_graph.ChunkGraphs`) and
    return at once; any other request: None (see :meth:`Backend.launch`)."""
    if not LAUNCH_BATCHES or be.inject_fault or not be._chunk_graphs.eligible(plan):
        return None
    try:
        host_in, host_out = be._host_io(plan, inputs, outputs)
        resident = be._lookup_resident(plan)
    except OpError:
        return None  # run() raises it
    moved = sum(h.nbytes for h in host_in.values()) + sum(h.nbytes for h in host_out.values())
    if not be._chunkable(plan, host_in, host_out, moved):
        return None
    try:
        with be._dev:
            started = be._chunk_graphs.start(plan, host_in, host_out, resident, chunk_settings())
    except Exception:  # noqa: BLE001 - the launch failed: run() runs the request again and reports what fails
        return None
    return None if started is None else _RunLaunched(be, started)


def launch_batch(be: CupyBackend, plan: Plan, items: Items) -> BatchLaunch | None:
    """Launch a batch that a graph of gathered batches serves (:mod:`._cuda_gather`) and return at once; any
    other batch: None (see :meth:`Backend.launch_batch`)."""
    gg = be._gather_graphs
    if not LAUNCH_BATCHES or (len(items) < 2 and not _single_batch(be, plan, items)) or be.inject_fault \
            or not be.gather_batches or not gg.eligible(plan) or not _small_batchable(be, plan):
        return None
    prepared = _prepare(be, plan, items, True)
    if prepared is None:
        return None  # run_batch answers each request with its own error
    _, resident, bp, addrs = prepared
    if addrs is None:
        return None
    t0 = time.perf_counter()
    try:
        with be._dev:
            started = gg.start(plan, bp, addrs, resident)
    except Exception:  # noqa: BLE001 - the launch failed: run_batch runs the batch again and reports what fails
        return None
    return None if started is None else _Launched(be, started, len(items), t0)


def _single_batch(be: CupyBackend, plan: Plan, items: Items) -> bool:
    """Whether a lone request (``items`` of one) runs as a batch of one: ``BATCH_SINGLES``, and a graph of gathered
    batches may serve its plan (the worker launches it then, as a batch; every other lone request runs as before)."""
    return (len(items) == 1 and BATCH_SINGLES and LAUNCH_BATCHES and be.gather_batches
            and be._gather_graphs.eligible(plan) and plan_bytes(plan) <= GRAPH_MAX_BYTES)


def _prepare(be: CupyBackend, plan: Plan, items: Items, gather: bool
             ) -> tuple[list[_gather.Checked], dict[str, Any], BatchPlan, Addrs | None] | None:
    """Each request's checks, the resident tensors, the batch plan and, where ``gather`` and the plan and every
    view allow a gathered run, the host addresses (:func:`_columns`); None where a request's checks fail."""
    try:
        got = [be._checked.item(plan, it, be._host_io) for it in items]
        resident = be._lookup_resident(plan)
    except OpError:
        return None
    bp, gatherable = _batch_plan(be, plan, len(items))
    addrs = _columns(be, got) if gather and gatherable and all(g[3] is not None for g in got) else None
    return got, resident, bp, addrs


def _batch_plan(be: CupyBackend, plan: Plan, size: int) -> tuple[BatchPlan, bool]:
    """The batch plan of (``plan``, ``size``) and whether a gathered run may serve it (``_gather.gatherable``), kept
    per plan by the backend."""
    def make() -> tuple[BatchPlan, bool]:
        bp = batch_plan(plan, size)
        return bp, _gather.gatherable(plan, bp)
    return kept_for_plan(be._plan_facts, (id(plan), size), plan, make)


def _small_batchable(be: CupyBackend, plan: Plan) -> bool:
    """``batchable(plan)`` and ``plan_bytes(plan) <= GRAPH_MAX_BYTES``, kept per plan by the backend: what a launched
    batch asks of its plan before anything else, on every batch."""
    return kept_for_plan(be._plan_facts, (id(plan), 0), plan,
                         lambda: plan_bytes(plan) <= GRAPH_MAX_BYTES and batchable(plan))


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


def _columns(be: CupyBackend, got: Sequence[_gather.Checked]) -> Addrs:
    """Per input and per output, the host addresses of every request (``got``: each request's checks, all usable).

    Kept by the backend per sequence of the requests' address tuples: the remembered checks hand the same tuple
    objects back for a request seen before (:class:`._cuda_gather.CheckedItems`), so a batch of the same requests
    in the same order gets the same columns object (a graph's row filler then writes nothing). An entry holds its
    tuples, so their ids stay theirs; the columns are only read."""
    ats = [g[3] for g in got]
    key = tuple(map(id, ats))
    kept = be._kept_columns
    e = kept.get(key)
    if e is not None and e[0] == ats:  # NOTE: list equality tests each element's identity first: these are equal
        return e[1]
    cols = ([list(c) for c in zip(*(a[0] for a in ats))],  # type: ignore[index]
            [list(c) for c in zip(*(a[1] for a in ats))])  # type: ignore[index]
    bounded_put(kept, key, (ats, cols), 256)
    return cols


def plan_bytes(plan: Plan) -> int:
    """Bytes of every tensor of ``plan`` (inputs, intermediates, outputs)."""
    return sum(t.nbytes for t in plan.tensors.values())


def chunk_settings() -> tuple[Any, ...]:
    """The chunk pipeline's settings now (benchmarks change them in process): part of a chunk graph's key."""
    c = _cuda_chunks
    return (c.CHUNK_PIPELINE, c.CHUNK_BYTES, c.CHUNK_MIN_BYTES, c.CHUNK_STREAMS)
