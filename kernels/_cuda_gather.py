"""Batches in a constant number of CUDA calls: a gather launch, the steps, a scatter launch.

The plain joint run (:func:`._cuda_batch.issue_joint`) issues one ``cudaMemcpyAsync`` per
request per tensor; its cost grows with B in Python and driver calls. Here the GPU itself copies
straight from and to the requests' page-locked host views (unified addressing: a registered
host page has the same address on the device), driven by a table of rows::

    table (page-locked host memory of the backend, one per stream set, filled with NumPy)
    row = (src u64, dst u64, nbytes u64, 0)
      rows [0, G)       request b's input n  -> slice b of the (B, *shape) device buffer of n
      rows [G, G + S)   slice b of output n  -> request b's output view   (filled after the steps)

    fill gather rows, copy_rows<<<(chunks, G)>>>(table, 0)      one launch
    every step once, on the stacked arrays (the same calls as the plain joint run)
    fill scatter rows, copy_rows<<<(chunks, S)>>>(table, G)     one launch
    one synchronize

``kernels/cuda/copy_rows.cu``: 16-byte loads and stores where both ends are 16-byte aligned,
4-byte words where 4-aligned, else bytes. The steps are the plain joint run's, on the same data,
so results are the same bits.

What it relies on, checked before use (else the memcpy path runs):

- the device: ``cudaDevAttrUnifiedAddressing`` and ``cudaDevAttrCanUseHostPointerForRegisteredMem``
  (checked once per backend);
- every view: inside a range registered by the backend (:meth:`HostAccess.add`, checked with
  ``cudaPointerGetAttributes`` that the device address equals the host address), or else both its
  first and last byte page-locked at the same device address (remembered per view object, which
  keeps its memory alive);
- the table: its device address equals its host address (else the device address is passed).

A bad address read by a kernel would be a sticky CUDA error that ends the context, so nothing
reaches the table that these checks did not pass. Requests moving more than ``GATHER_MAX_BYTES``
each keep the memcpy path, which moves big blocks at full DMA speed; so do batches of fewer than
``GATHER_MIN_BATCH`` requests (``SHMRPC_CUDA_GATHER_MIN_BATCH``), where the per-copy calls cost less
than the launches and the table.

Graphs of gathered batches (:class:`GatherGraphs`): the copy kernels read the table when they run,
not when they are launched, and the stacked buffers are fixed per (plan, B); so the whole run
(gather launch, every step, scatter launch) is captured once per key and serves any B requests of
that plan, whatever their slots::

    key = (plan, B, resident device addresses)       at most GATHER_GRAPHS, in use order
    first sight     the gathered run above
    second sight    capture (the batch graphs' way, :mod:`._cuda_batch`: warm run on a private pool,
                    cuBLAS products through CaptureXp with their bits compared, one launch whose bits
                    must equal the warm run's), with a table of the graph's own
    afterwards      this batch's rows into that table (NumPy), graph.launch, one synchronize

The rows are filled only from :meth:`HostAccess.addresses`, checked for every batch, so a graph
reads and writes no host address those checks did not pass. A batch of overlapping views (in place)
is served by an existing graph (every input is gathered before any output is scattered), but a key
is captured only from a batch whose views do not overlap (the capture's check reads the inputs again).
The slot-keyed graphs of :mod:`._cuda_batch` remain for devices where kernels may not use host
addresses.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._backend_base import BatchItem, ItemViews
from ._batch import BatchPlan
from ._cuda_batch import _NONE, Shared, Step, _BatchCaptures, address
from ._dtypes import storage_dtype
from ._plan import Plan, bounded_put, kept_for_plan

__all__ = ["GATHER_MAX_BYTES", "GATHER_MIN_BATCH", "GATHER_GRAPHS", "CheckedItems", "GatherGraphs", "HostAccess", "RowTable",
           "Started",
           "issue_gathered",
           "gatherable", "copy_kernel", "stacked_bufs"]

#: Requests moving at most this many bytes (inputs and outputs) take the gather path; ``SHMRPC_CUDA_GATHER=0`` turns it off.
GATHER_MAX_BYTES = 4 << 20
GATHER_ON = (os.environ.get("SHMRPC_CUDA_GATHER", "") or "1") != "0"
#: Batches of fewer requests keep the memcpy path: on the H200 the two launches cost more than the copies they
#: replace below 8 requests (gemm 16x256x256 float16, bench/results/gpu-gather-probe-2026-11-30-*.json).
GATHER_MIN_BATCH = int(os.environ.get("SHMRPC_CUDA_GATHER_MIN_BATCH", "") or 8)
#: Graphs of gathered batches kept, one per (plan, B, residents) (``SHMRPC_CUDA_GATHER_GRAPHS=0`` turns them off).
GATHER_GRAPHS = int(os.environ.get("SHMRPC_CUDA_GATHER_GRAPHS", "") or 64)
#: A (plan, B) whose B requests' tensors exceed this many bytes is not captured (each graph holds its buffers).
GATHER_GRAPH_MAX_BYTES = 64 << 20
_ATTR_UNIFIED = 41  # cudaDevAttrUnifiedAddressing
_ATTR_HOST_PTR_REGISTERED = 91  # cudaDevAttrCanUseHostPointerForRegisteredMem
_HOST = 1  # cudaMemoryTypeHost
_THREADS = 256
_CHUNK = _THREADS * 16 * 4  # COPY_CHUNK in copy_rows.cu
_MAX_ROWS = 65535  # gridDim.y


def _device_address(cp: Any, a: int) -> int | None:
    """The device address of page-locked host address ``a`` (None: not page-locked / not mapped)."""
    try:
        at = cp.cuda.runtime.pointerGetAttributes(a)
    except Exception:  # noqa: BLE001 - pageable memory on older drivers: not usable
        return None
    if int(at.type) != _HOST or not at.devicePointer:
        return None
    return int(at.devicePointer)


class HostAccess:
    """Which host views a kernel may read and write at their own address (see the module doc)."""

    def __init__(self, cp: Any, device: int) -> None:
        self._cp = cp
        self._lock = threading.Lock()
        self._ranges: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # (starts, ends), replaced whole
        self._views: dict[int, tuple[Any, bool]] = {}
        self.version = 0  # bumped by add and remove: what was usable before may not be now
        try:
            rt = cp.cuda.runtime
            self.supported = bool(rt.deviceGetAttribute(_ATTR_UNIFIED, device)) and bool(
                rt.deviceGetAttribute(_ATTR_HOST_PTR_REGISTERED, device))
            self.why = "" if self.supported else "the device cannot use host pointers of registered memory"
        except Exception as e:  # noqa: BLE001 - an old runtime without the attribute: the memcpy path
            self.supported, self.why = False, f"device attributes unreadable: {type(e).__name__}: {e}"

    def add(self, start: int, nbytes: int) -> bool:
        """Note a range the backend registered; True if kernels may use its host addresses."""
        ok = self.supported and nbytes > 0 and _device_address(self._cp, start) == start \
            and _device_address(self._cp, start + nbytes - 1) == start + nbytes - 1
        if ok:
            with self._lock:
                spans = sorted({*zip(*self._ranges), (start, start + nbytes)})
                self._ranges = (tuple(a for a, _ in spans), tuple(b for _, b in spans))
                self.version += 1
        return ok

    def remove(self, start: int | None = None) -> None:
        """Forget the registered range at ``start`` (None: all), and every view remembered."""
        with self._lock:
            spans = [] if start is None else [(a, b) for a, b in zip(*self._ranges) if a != start]
            self._ranges = (tuple(a for a, _ in spans), tuple(b for _, b in spans))
            self._views.clear()
            self.version += 1

    def addresses(self, checked: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]],
                  inputs: Sequence[str], outputs: Sequence[str]) -> tuple[list[list[int]], list[list[int]]] | None:
        """Host addresses of the views (per input name, per output name: one per request), or None if a
        kernel may not use one of them (see :meth:`usable`)."""
        (starts, ends), find = self._ranges, bisect.bisect  # NOTE: one read: add/remove replace the pair whole
        cols: tuple[list[list[int]], list[list[int]]] = ([], [])
        for side, names in ((0, inputs), (1, outputs)):
            for name in names:
                col = []
                for item in checked:
                    v = item[side][name]
                    a = address(v)
                    i = find(starts, a) - 1
                    if not (i >= 0 and a + v.nbytes <= ends[i]) and not self._usable_unregistered(v, a):
                        return None
                    col.append(a)
                cols[side].append(col)
        return cols

    def usable(self, v: np.ndarray) -> bool:
        """Whether a kernel may read and write every byte of contiguous view ``v`` at its host address."""
        a, n = address(v), v.nbytes
        starts, ends = self._ranges
        i = bisect.bisect(starts, a) - 1
        return (i >= 0 and a + n <= ends[i]) or self._usable_unregistered(v, a)

    def _usable_unregistered(self, v: np.ndarray, a: int) -> bool:
        n = v.nbytes
        e = self._views.get(id(v))
        if e is not None and e[0]() is v:
            return bool(e[1])
        ok = self.supported and _device_address(self._cp, a) == a and _device_address(self._cp, a + max(n, 1) - 1) == a + max(n, 1) - 1
        if not v.flags.owndata:  # a view keeps its memory alive while it lives: remember it by the object
            with self._lock:
                if len(self._views) > 4096:
                    self._views.clear()
                self._views[id(v)] = (weakref.ref(v), ok)
        return ok


#: A request's checked views: (inputs, outputs, all C-contiguous, (input addresses, output addresses) when a
#: kernel may use every one of them at its host address, else None).
Checked = tuple[dict[str, np.ndarray], dict[str, np.ndarray], bool, "tuple[tuple[int, ...], tuple[int, ...]] | None"]
HostIO = Callable[[Plan, Mapping[str, np.ndarray], Mapping[str, np.ndarray]], tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]


class CheckedItems:
    """Each request's checks (:data:`Checked`), remembered by the identity of its plan and view objects: the
    worker hands a slot's views over as the same objects every time, so a batch of requests seen before is
    checked by identity alone. An entry holds weak references only (a region's views must not outlive its
    client) and serves a request whose every view is the very object it was made from; it is made only where
    the checks handed the views back as they came (views already of their storage dtype). A hit hands the
    request's own mappings back when they are dicts of exactly the plan's views in its order (the worker's),
    else new ones; either is only read. A batch item that is an :class:`ItemViews` is remembered by its own
    identity once its checks handed its views back (:meth:`item`). Entries are forgotten when the host ranges
    change (:attr:`HostAccess.version`) and all at once past ``limit``."""

    def __init__(self, access: HostAccess, limit: int = 4096) -> None:
        self._access = access
        self._limit = limit
        self._version = access.version
        self._entries: dict[tuple[int, ...], tuple[Any, ...]] = {}
        self._names: dict[int, tuple[Plan, Any]] = {}  # per plan: its views' names (kept_for_plan)
        # per ItemViews (its id): weak references to it and its plan, and the host addresses of its views (item)
        self._items: dict[int, tuple[weakref.ref[ItemViews], weakref.ref[Plan], Any]] = {}

    def item(self, plan: Plan, item: BatchItem, host_io: HostIO) -> Checked:
        """:meth:`get` of one batch item. An :class:`ItemViews` whose checks handed its own views back (its mappings
        exactly the plan's views, every view as it came) is remembered by its identity, weakly, with its plan: its
        next batches are checked by those two identities alone (the worker's requests of a slot, sent again)."""
        if type(item) is not ItemViews:
            ins, outs = item
            return self.get(plan, ins, outs, host_io)
        if self._access.version != self._version:
            self._forget()
        e = self._items.get(id(item))
        if e is not None and e[0]() is item and e[1]() is plan:
            return item.ins, item.outs, True, e[2]
        got = self.get(plan, item.ins, item.outs, host_io)
        if got[0] is item.ins and got[1] is item.outs and got[2]:
            bounded_put(self._items, id(item), (weakref.ref(item), weakref.ref(plan), got[3]), self._limit)
        return got

    def get(self, plan: Plan, ins: Mapping[str, np.ndarray], outs: Mapping[str, np.ndarray], host_io: HostIO) -> Checked:
        """The checks of this request (``host_io``: the backend's, raising its typed error for a bad view)."""
        access = self._access
        if access.version != self._version:
            self._forget()
        names, onames = kept_for_plan(self._names, id(plan), plan, lambda: (
            tuple(n for n in plan.inputs if n not in plan.resident), tuple(plan.outputs)))
        exact = tuple(ins) == names and tuple(outs) == onames  # the worker's views: the plan's names, in its order
        if exact:
            views = [*ins.values(), *outs.values()]
        else:
            views = [ins.get(n) for n in names] + [outs.get(n) for n in onames]  # type: ignore[operator, assignment]
        key = (id(plan), *map(id, views))
        e = self._entries.get(key)
        if e is not None and e[0]() is plan:
            for r, v in zip(e[1], views):
                if r() is not v:
                    break
            else:
                if exact and type(ins) is dict and type(outs) is dict:  # handed back as they came (no copy)
                    return ins, outs, True, e[2]
                k = len(names)
                return dict(zip(names, views[:k])), dict(zip(onames, views[k:])), True, e[2]  # type: ignore[arg-type]
        host_in, host_out = host_io(plan, ins, outs)
        checked = [*host_in.values(), *host_out.values()]
        contiguous = all(v.flags.c_contiguous for v in checked)
        addrs = None
        if contiguous and access.supported and all(access.usable(v) for v in checked):
            addrs = (tuple(address(v) for v in host_in.values()), tuple(address(v) for v in host_out.values()))
        if contiguous and all(a is b for a, b in zip(checked, views)):
            bounded_put(self._entries, key, (weakref.ref(plan), tuple(weakref.ref(v) for v in checked), addrs), self._limit)
        return host_in, host_out, contiguous, addrs

    def _forget(self) -> None:
        """The host ranges changed: every entry goes."""
        self._entries.clear()
        self._items.clear()
        self._version = self._access.version

    def clear(self) -> None:
        self._entries.clear()
        self._items.clear()


class RowTable:
    """Page-locked rows of (src, dst, nbytes, 0) u64 the copy kernel reads; grows on demand."""

    def __init__(self, cp: Any, rows: int = 64) -> None:
        self._cp = cp
        self.rows = 0
        self.tab = np.empty((0, 4), np.uint64)
        self.flat = self.tab.reshape(-1)
        self.dev_ptr = 0
        self.arg = np.uint64(0)
        self._mem: Any = None
        self.reserve(rows)

    def reserve(self, rows: int) -> None:
        if rows <= self.rows:
            return
        rows = max(rows, 2 * self.rows)
        mem = self._cp.cuda.alloc_pinned_memory(rows * 32)
        ptr = int(mem.ptr)
        dev = _device_address(self._cp, ptr)
        if dev is None:
            raise RuntimeError("the copy table's page-locked memory has no device address")
        self._mem, self.rows, self.dev_ptr, self.arg = mem, rows, dev, np.uint64(dev)
        self.tab = np.frombuffer(mem, np.uint64, rows * 4).reshape(rows, 4)
        self.flat = self.tab.reshape(-1)
        self.tab[:] = 0


_fn_lock = threading.Lock()
_fns: dict[int, Any] = {}


def copy_kernel(cp: Any) -> Any:
    """``copy_rows`` compiled for the current device (once; CuPy keeps the binary in its disk cache)."""
    dev = cp.cuda.runtime.getDevice()
    fn = _fns.get(dev)
    if fn is None:
        from ._cuda import source

        with _fn_lock:
            fn = _fns.get(dev)
            if fn is None:
                raw = cp.RawModule(code=source("copy_rows.cu"), options=("-std=c++17",)).get_function("copy_rows")
                fn = _fns[dev] = getattr(raw, "kernel", raw)  # the compiled Function: one call layer less per launch
    return fn


_BUFS_KEPT, _BUFS_MAX_BYTES = 8, 64 << 20


def stacked_bufs(store: dict[tuple[int, int], tuple[Plan, dict[str, Any]]], plan: Plan, size: int, plan_bytes: int
                 ) -> dict[str, Any] | None:
    """The stacked input buffers of (plan, B) kept in ``store`` (one per stream set; at most 8 kept), or None
    when B requests' tensors exceed 64 MiB (allocated per batch then)."""
    if size * plan_bytes > _BUFS_MAX_BYTES:
        return None
    entry = store.get((id(plan), size))
    if entry is None or entry[0] is not plan:
        if len(store) >= _BUFS_KEPT:
            store.pop(next(iter(store)))
        entry = store[(id(plan), size)] = (plan, {})
    return entry[1]


def gatherable(plan: Plan, bp: BatchPlan) -> bool:
    """Whether the plan's tensors per request are small enough, and the rows fit one launch."""
    moved = sum(s.nbytes for n, s in plan.inputs.items() if n not in plan.resident) + sum(s.nbytes for s in plan.outputs.values())
    return moved <= GATHER_MAX_BYTES and bp.size * max(len(plan.inputs), len(plan.outputs), 1) <= _MAX_ROWS


def _launch(cp: Any, table: RowTable, row0: int, rows: int, max_bytes: int, stream: Any) -> None:
    if rows and max_bytes:
        copy_kernel(cp)(((max_bytes + _CHUNK - 1) // _CHUNK, rows), (_THREADS,), (table.arg, np.int32(row0)),
                        stream=stream)


def _rows_in(addrs: Sequence[Sequence[int]], dsts: Sequence[tuple[int, int]]) -> list[int]:
    """Gather rows: request b's input n (host address ``addrs[n][b]``) -> slice b of device buffer ``dsts[n]``
    = (address, bytes per request)."""
    rows: list[int] = []
    for col, (d, per) in zip(addrs, dsts):
        if per:
            for a in col:
                rows += (a, d, per, 0)
                d += per
    return rows


def _rows_out(addrs: Sequence[Sequence[int]], srcs: Sequence[tuple[int, int, int]]) -> list[int]:
    """Scatter rows: slice b of device output ``srcs[n]`` = (address, bytes per request, stride: 0 for an
    output the batch does not stack) -> request b's view (host address ``addrs[n][b]``)."""
    rows: list[int] = []
    for col, (d, per, step) in zip(addrs, srcs):
        if per:
            for a in col:
                rows += (d, a, per, 0)
                d += step
    return rows


def row_filler(table: RowTable, dsts: Sequence[tuple[int, int]], srcs: Sequence[tuple[int, int, int]]
               ) -> Callable[[tuple[list[list[int]], list[list[int]]]], None]:
    """The filler of a gathered graph's own ``table``: writes a batch's gather rows (:func:`_rows_in` over ``dsts``)
    and scatter rows (:func:`_rows_out` over ``srcs``) before a launch. Every batch of one graph has the same rows but
    for the host addresses, so the first call writes them whole and the later ones only the gather rows' sources and
    the scatter rows' destinations; none when handed the very columns object of the last call (the backend keeps a
    batch's columns, never changed, per sequence of its requests: ``_cupy_runs._columns``)."""
    cin = [i for i, (_, per) in enumerate(dsts) if per]  # the columns that have rows, in _rows_in's order
    cout = [i for i, (_, per, _) in enumerate(srcs) if per]
    cols: list[np.ndarray] = []
    last: list[Any] = [None]  # the columns object the table holds the rows of (held: its id stays its own)

    def rows(a: tuple[list[list[int]], list[list[int]]]) -> None:
        if a is last[0]:
            return
        if not cols:
            r_in, r_out = _rows_in(a[0], dsts), _rows_out(a[1], srcs)
            table.flat[:len(r_in)] = r_in
            table.flat[len(r_in):len(r_in) + len(r_out)] = r_out
            n_in, n_out = len(r_in) // 4, len(r_out) // 4
            cols.extend((table.tab[:n_in, 0], table.tab[n_in:n_in + n_out, 1]))
        else:
            cols[0][:] = [x for i in cin for x in a[0][i]]
            cols[1][:] = [x for i in cout for x in a[1][i]]
        last[0] = a
    return rows


def issue_gathered(cp: Any, step: Step, plan: Plan, bp: BatchPlan, addrs: tuple[list[list[int]], list[list[int]]],
                   resident: Mapping[str, Any], stream: Any, workspace: dict[str, Any], copying_out: list[bool],
                   table: RowTable, bufs: dict[str, Any] | None = None, xp: Any = None) -> dict[str, Any]:
    """Enqueue the joint run of one batch on ``stream`` with one gather and one scatter launch; no
    synchronize. ``addrs``: from :meth:`HostAccess.addresses` over the request inputs (plan order, residents
    left out) and the outputs. Returns every device array it used; sets ``copying_out[0]`` just before the
    scatter is launched. The caller synchronizes before the table is filled again (one table per stream
    set). ``bufs``: the stacked input buffers by name, kept by the caller for this (plan, B) and filled here
    on first use. ``xp``: the array module of the steps (None: the backend's)."""
    size = bp.size
    env: dict[str, Any] = {}
    dsts = []
    for name in [n for n in plan.inputs if n not in plan.resident]:
        spec = plan.inputs[name]
        dev = bufs.get(name) if bufs is not None else None
        if dev is None:
            dev = cp.empty((size, *spec.shape), dtype=storage_dtype(spec.dtype))
            if bufs is not None:
                bufs[name] = dev
        env[name] = dev
        dsts.append((dev.data.ptr, spec.nbytes))
    rows = _rows_in(addrs[0], dsts)
    n_in = len(rows) // 4
    table.reserve(n_in + size * len(plan.outputs))
    if n_in:
        table.flat[:4 * n_in] = rows
    with stream:
        _launch(cp, table, 0, n_in, max((per for _, per in dsts), default=0), stream)
        env.update(resident)
        for st, (in_specs, out_specs) in zip(plan.steps, bp.steps):
            res = step(st, {p: env[n] for p, n in st.inputs.items()}, in_specs, out_specs, workspace, xp)
            for p, n in st.outputs.items():
                env[n] = res[p]
        outs = {n: cp.ascontiguousarray(env[n]) for n in plan.outputs}
        env.update({"#d2h." + n: a for n, a in outs.items()})
        srcs = out_sources(plan, bp, outs)
        rows = _rows_out(addrs[1], srcs)
        n_s = len(rows) // 4
        if n_s:
            table.flat[4 * n_in:4 * (n_in + n_s)] = rows
        copying_out[0] = True
        _launch(cp, table, n_in, n_s, max((per for _, per, _ in srcs), default=0), stream)
    return env


def out_sources(plan: Plan, bp: BatchPlan, outs: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    """(device address, bytes per request, stride) of each output of a joint run (see :func:`_rows_out`)."""
    return [(outs[n].data.ptr, spec.nbytes, spec.nbytes if n in bp.batched else 0) for n, spec in plan.outputs.items()]


class GatherGraphs(_BatchCaptures):
    """Graphs of gathered batches by (plan, B, residents): see the module doc."""

    def __init__(self, cupy: Any, step: Step, limit: int, after: int, capturing: threading.local, shared: Shared) -> None:
        super().__init__(cupy, step, limit, after, capturing, shared)

    def run(self, plan: Plan, bp: BatchPlan, addrs: tuple[list[list[int]], list[list[int]]],
            checked: Sequence[tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]]], resident: Mapping[str, Any],
            copying_out: list[bool]) -> bool | None:
        """Serve this batch (``addrs``: its views' addresses from :meth:`HostAccess.addresses`): True by a graph
        (launched, or captured after the warm run); False by the warm run of a refused capture; None: not served.
        Raises what the gathered run raises; a launch failing raises the CUDA error with ``copying_out[0]`` set."""
        if bp.size * sum(t.nbytes for t in plan.tensors.values()) > GATHER_GRAPH_MAX_BYTES:
            return None
        key = _gather_key(plan, bp, resident)
        g = self._lookup(key)
        if g is False or g is _NONE:
            return None
        if g is None:
            views = [v for item in checked for side in item for v in side.values() if v.nbytes]
            spans = sorted((address(v), address(v) + v.nbytes) for v in views)
            if any(b[0] < a[1] for a, b in zip(spans, spans[1:])):
                with self._lock:
                    self._seen[key] = self.after - 1  # in place: captured from a later batch
                return None
            table = RowTable(self._cp, bp.size * (len(plan.inputs) + len(plan.outputs)))
            bufs: dict[str, Any] = {}

            def issue(xp: Any, stream: Any, ws: dict[str, Any], out: list[bool], capture: bool) -> dict[str, Any]:
                return issue_gathered(self._cp, self._step, plan, bp, addrs, resident, stream, ws, out, table, bufs, xp)

            def fill(used: dict[str, Any]) -> Any:
                dsts = [(bufs[n].data.ptr, plan.inputs[n].nbytes) for n in plan.inputs if n not in plan.resident]
                srcs = out_sources(plan, bp, {n: used["#d2h." + n] for n in plan.outputs})
                return row_filler(table, dsts, srcs)

            with self._sh.capture_lock:
                return self._capture(key, plan, checked, resident, copying_out, issue, fill, addrs)
        copying_out[0] = True
        if not self._launch(g, addrs):
            copying_out[0] = False
            return None  # dropped meanwhile (a reset): the plain path
        self.launches += 1
        return True

    def start(self, plan: Plan, bp: BatchPlan, addrs: tuple[list[list[int]], list[list[int]]], resident: Mapping[str, Any]
              ) -> Started | None:
        """Launch the graph of this batch's key without waiting for it (None: no graph yet, or that graph is in use
        by another launch: run it the other way). The graph stays this thread's until :meth:`Started.finish`."""
        g = self._claim(_gather_key(plan, bp, resident))
        if g is None:
            return None
        try:
            with self._sh.launch_lock:
                g.fill(addrs)
                g.graph.launch(self._sh.stream)
                g.event.record(self._sh.stream)
        except BaseException:
            g.lock.release()
            raise
        g.pending = True
        self.launches += 1
        return Started(g)


def _gather_key(plan: Plan, bp: BatchPlan, resident: Mapping[str, Any]) -> tuple[Any, ...]:
    return (id(plan), bp.size, *(r.data.ptr for r in resident.values()))


class Started:
    """A launch of a gathered batch's graph (:meth:`GatherGraphs.start`): ``done()`` asks the device, ``finish()``
    waits for it and gives the graph back (once, on the launching thread; raises the CUDA error of the run)."""

    __slots__ = ("_g",)

    def __init__(self, g: Any) -> None:
        self._g = g

    def done(self) -> bool:
        try:
            return bool(self._g.event.done)
        except Exception:  # noqa: BLE001 - a device error: finish() raises it
            return True

    def finish(self) -> None:
        g = self._g
        try:
            g.event.synchronize()
        finally:
            g.pending = False
            g.lock.release()
