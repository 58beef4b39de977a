"""The rows a gathered batch hands its copy launches (:func:`shmrpc.kernels._cuda_gather.issue_gathered`),
checked without a GPU: NumPy stands in for CuPy and each launch is carried out on the host by copying
its table rows, so a wrong source, destination, length or row offset shows as a wrong result."""

from __future__ import annotations

import ctypes
import threading
import types
from typing import Any

import numpy as np
import pytest

from shmrpc.kernels import StepSpec, TensorSpec, select_backend
from shmrpc.kernels import _cuda_gather as gather
from shmrpc.kernels._batch import batch_plan
from shmrpc.kernels._registry import OpCall


class _Dev(np.ndarray):
    """A host array posing as a device array (``.data.ptr``)."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return types.SimpleNamespace(ptr=self.ctypes.data)


class _FakeCp:
    def empty(self, shape: tuple[int, ...], dtype: Any) -> _Dev:
        return np.empty(shape, dtype).view(_Dev)

    def ascontiguousarray(self, a: Any) -> _Dev:
        return np.ascontiguousarray(a).view(_Dev)


class _HostTable(gather.RowTable):
    def __init__(self) -> None:  # no page-locked memory: plain host rows
        self.rows = 0
        self.reserve(2)

    def reserve(self, rows: int) -> None:
        if rows > self.rows:
            self.rows = max(rows, 2 * self.rows)
            self.tab = np.zeros((self.rows, 4), np.uint64)
            self.flat = self.tab.reshape(-1)
            self.arg = np.uint64(self.tab.ctypes.data)


class _NoStream:
    def __enter__(self) -> _NoStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _host_launch(cp: Any, table: gather.RowTable, row0: int, rows: int, max_bytes: int, stream: Any) -> None:
    for r in range(row0, row0 + rows):
        src, dst, n, _ = (int(x) for x in table.tab[r])
        assert 0 < n <= max_bytes
        ctypes.memmove(dst, src, n)


def _step(st: Any, ins: dict[str, Any], in_specs: Any, out_specs: Any, ws: dict[str, Any], xp: Any) -> dict[str, Any]:
    call = OpCall(np, {k: np.asarray(v) for k, v in ins.items()}, in_specs, out_specs, st.attrs, {}, ws)
    return {k: np.ascontiguousarray(v).view(_Dev) for k, v in st.op.numpy(call).items()}


@pytest.mark.parametrize("size", [2, 3, 8, 17])
def test_rows_of_a_gathered_batch(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    monkeypatch.setattr(gather, "_launch", _host_launch)
    be = select_backend("numpy")
    plan = be.plan([StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "h"}), StepSpec("softmax", {"x": "h"}, {"out": "p"})],
                   {"x": TensorSpec((3, 37), "float32"), "w": TensorSpec((37, 5), "float32")}, ["h", "p"])
    buf = np.zeros(1 << 20, np.uint8)
    rng = np.random.default_rng(size)
    off = 4  # views 4 bytes past a 64-byte boundary, sizes no multiple of 16
    checked = []

    def view(shape: tuple[int, int]) -> np.ndarray:
        nonlocal off
        v = np.frombuffer(buf, np.float32, shape[0] * shape[1], off).reshape(shape)
        off += v.nbytes + 68
        return v

    for _ in range(size):
        x, w = view((3, 37)), view((37, 5))
        x[:] = rng.standard_normal(x.shape)
        w[:] = rng.standard_normal(w.shape)
        checked.append(({"x": x, "w": w}, {"h": view((3, 5)), "p": view((3, 5))}))
    access = gather.HostAccess.__new__(gather.HostAccess)  # the buffer stands for a registered range
    access._ranges, access._views = ((buf.ctypes.data,), (buf.ctypes.data + buf.nbytes,)), {}
    access.supported, access._lock, access._cp = False, threading.Lock(), None
    addrs = access.addresses(checked, ["x", "w"], ["h", "p"])
    assert addrs is not None
    outside = ({"x": checked[0][0]["x"], "w": checked[0][0]["w"]}, {"h": np.zeros((3, 5), np.float32), "p": checked[0][1]["p"]})
    assert access.addresses([checked[0], outside], ["x", "w"], ["h", "p"]) is None  # not registered: the memcpy path
    table, bufs = _HostTable(), {}  # type: ignore[var-annotated]
    for _ in range(2):  # the second batch reuses the stacked buffers and the table
        for _, outs in checked:
            outs["h"][:] = 0
            outs["p"][:] = 0
        copying_out = [False]
        gather.issue_gathered(_FakeCp(), _step, plan, batch_plan(plan, size), addrs, {}, _NoStream(), {}, copying_out,
                              table, bufs)
        assert copying_out[0] and set(bufs) == {"x", "w"}
        for ins, outs in checked:
            h = ins["x"].astype(np.float64) @ ins["w"]
            e = np.exp(h - h.max(-1, keepdims=True))
            np.testing.assert_allclose(outs["h"], h, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(outs["p"], e / e.sum(-1, keepdims=True), rtol=1e-4, atol=1e-5)


class _FakeRuntime:
    """Stands in for ``cupy.cuda.runtime``: addresses inside ``pinned`` are page-locked at the same device address."""

    def __init__(self) -> None:
        self.pinned: list[tuple[int, int]] = []

    def deviceGetAttribute(self, attr: int, device: int) -> int:  # noqa: N802 - CuPy's name
        return 1

    def pointerGetAttributes(self, a: int) -> Any:  # noqa: N802 - CuPy's name
        inside = any(lo <= a < hi for lo, hi in self.pinned)
        return types.SimpleNamespace(type=1 if inside else 0, devicePointer=a if inside else 0)


def test_registered_ranges_decide_which_views_a_kernel_may_use() -> None:
    rt = _FakeRuntime()
    access = gather.HostAccess(types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt)), 0)
    assert access.supported
    one, two = np.zeros(8192, np.uint8), np.zeros(8192, np.uint8)
    v1, v2 = one[100:4196], two[8000:8192]
    assert not access.usable(v1) and not access.usable(v2)  # nothing registered, nothing page-locked
    rt.pinned = [(one.ctypes.data, one.ctypes.data + one.nbytes), (two.ctypes.data, two.ctypes.data + two.nbytes)]
    assert access.add(one.ctypes.data, one.nbytes) and access.add(two.ctypes.data, two.nbytes)
    assert access.usable(v1) and access.usable(v2)
    assert access.addresses([({"x": v1}, {"o": v2})], ["x"], ["o"]) == ([[v1.ctypes.data]], [[v2.ctypes.data]])
    assert not access.usable(np.zeros(16, np.uint8))  # pageable, outside every range
    rt.pinned = rt.pinned[1:]
    access.remove(one.ctypes.data)  # unregistered: its views are no longer usable, the other region's still are
    assert not access.usable(v1) and access.usable(v2)
    assert access.addresses([({"x": v1}, {"o": v2})], ["x"], ["o"]) is None
    access.remove()
    rt.pinned = []
    assert not access.usable(v2)
    assert not access.add(one.ctypes.data, one.nbytes)  # not mapped at its own address: refused


class _Checks:
    """What the CheckedItems tests share: one page-locked region registered with a HostAccess of a fake runtime, a
    NumPy backend, the plan x + y -> o of 4 float32 and a host_io that counts its calls."""

    def __init__(self) -> None:
        from shmrpc.kernels._backend_base import Backend

        self.rt = _FakeRuntime()
        self.access = gather.HostAccess(types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=self.rt)), 0)
        self.region = np.zeros(1 << 16, np.uint8)
        self.rt.pinned = [(self.region.ctypes.data, self.region.ctypes.data + self.region.nbytes)]
        assert self.access.add(self.region.ctypes.data, self.region.nbytes)
        self.be = be = select_backend("numpy")
        self.specs = {"x": TensorSpec((4,), "float32"), "y": TensorSpec((4,), "float32")}
        self.plan = be.plan([StepSpec("vector_add", {"x": "x", "y": "y"}, {"out": "o"})], self.specs, ["o"])
        self.calls: list[int] = []

        def host_io(p: Any, ins: Any, outs: Any) -> Any:
            self.calls.append(1)
            return Backend._host_io(be, p, ins, outs)
        self.host_io = host_io

    def unregister(self) -> None:
        """The range is gone (the runtime no longer maps it either)."""
        self.rt.pinned = []
        self.access.remove(self.region.ctypes.data)


def test_what_is_kept_for_a_plan_is_made_once_for_it_and_again_for_another_at_its_key() -> None:
    """``kept_for_plan``: made once per plan; a key whose entry holds another plan (an id come back) is made again;
    the store is forgotten whole once it holds ``limit`` entries."""
    from shmrpc.kernels._plan import kept_for_plan

    ck = _Checks()
    other = ck.be.plan([StepSpec("vector_add", {"x": "y", "y": "x"}, {"out": "o"})], ck.specs, ["o"])
    store: dict[object, tuple[object, object]] = {}
    made: list[str] = []

    def make(tag: str) -> str:
        made.append(tag)
        return tag
    assert kept_for_plan(store, 7, ck.plan, lambda: make("a")) == "a"
    assert kept_for_plan(store, 7, ck.plan, lambda: make("b")) == "a" and made == ["a"]
    assert kept_for_plan(store, 7, other, lambda: make("c")) == "c" and made == ["a", "c"]  # another plan at the key
    assert kept_for_plan(store, 8, ck.plan, lambda: make("d"), limit=2) == "d" and made[-1] == "d"
    assert kept_for_plan(store, 9, ck.plan, lambda: make("e"), limit=2) == "e" and list(store) == [9]


def test_checked_items_are_remembered_by_view_identity_and_forgotten_when_ranges_change() -> None:
    import gc

    from shmrpc.kernels._errors import KernelInputError

    ck = _Checks()
    region, plan, host_io, calls = ck.region, ck.plan, ck.host_io, ck.calls
    items = gather.CheckedItems(ck.access)
    x, y, o = (np.frombuffer(region, np.float32, 4, off) for off in (0, 64, 128))
    ins, outs = {"x": x, "y": y}, {"o": o}
    first = items.get(plan, ins, outs, host_io)
    assert first[2] and first[3] == ((x.ctypes.data, y.ctypes.data), (o.ctypes.data,)) and len(calls) == 1
    again = items.get(plan, {"y": y, "x": x}, {"o": o}, host_io)  # the same objects in other dicts: no new check
    assert len(calls) == 1 and again[3] == first[3] and again[0]["x"] is x and again[1]["o"] is o
    assert list(again[0]) == ["x", "y"] and again[0] is not ins  # another order: new dicts, in the plan's order
    same = items.get(plan, ins, outs, host_io)  # the plan's views in its order (the worker's): handed back as they came
    assert len(calls) == 1 and same[0] is ins and same[1] is outs and same[3] == first[3]
    extra = items.get(plan, {"x": x, "y": y, "z": o}, outs, host_io)  # a name the plan has not: not handed back
    assert len(calls) == 1 and extra[0] == ins and extra[0] is not ins
    x2 = np.frombuffer(region, np.float32, 4, 256)  # another view object: checked
    assert items.get(plan, {"x": x2, "y": y}, outs, host_io)[3] == ((x2.ctypes.data, y.ctypes.data), (o.ctypes.data,))
    assert len(calls) == 2
    with pytest.raises(KernelInputError) as ei:  # a bad view: the backend's typed error, nothing remembered
        items.get(plan, {"x": np.zeros(5, np.float32), "y": y}, outs, host_io)
    assert ei.value.field == "shape" and ei.value.tensor == "x"
    pageable = np.zeros(4, np.float32)  # checked, but no kernel may use it: no addresses
    assert items.get(plan, {"x": pageable, "y": y}, outs, host_io)[3] is None
    strided = np.frombuffer(region, np.float32, 8, 512)[::2]
    assert items.get(plan, {"x": strided, "y": y}, outs, host_io)[2] is False
    n = len(calls)
    del x2
    gc.collect()
    x3 = np.frombuffer(region, np.float32, 4, 256)  # may reuse the dead view's id: still checked
    items.get(plan, {"x": x3, "y": y}, outs, host_io)
    assert len(calls) == n + 1
    items.get(plan, ins, outs, host_io)
    assert len(calls) == n + 1  # the first request's entry still serves
    ck.unregister()  # the range is gone: every entry with it
    assert items.get(plan, ins, outs, host_io)[3] is None and len(calls) == n + 2


def test_an_item_views_is_remembered_by_its_identity_weakly_and_forgotten_when_ranges_change() -> None:
    """CheckedItems.item: an ItemViews whose checks handed its views back is served by its identity and its plan's
    alone (no check, not even of its views' identities: its mappings never change), holds neither it nor its views,
    is not served for another plan or after the host ranges change; a plain pair, a bad view and a view the check
    does not hand back as it came are checked as get() checks them, and not remembered as an item."""
    import gc
    import weakref

    from shmrpc.kernels._backend_base import ItemViews
    from shmrpc.kernels._errors import KernelInputError

    ck = _Checks()
    region, plan, host_io, calls = ck.region, ck.plan, ck.host_io, ck.calls
    other = ck.be.plan([StepSpec("vector_add", {"x": "y", "y": "x"}, {"out": "o"})], ck.specs, ["o"])
    items = gather.CheckedItems(ck.access)
    x, y, o = (np.frombuffer(region, np.float32, 4, off) for off in (0, 64, 128))
    want = ((x.ctypes.data, y.ctypes.data), (o.ctypes.data,))
    iv = ItemViews({"x": x, "y": y}, {"o": o})
    first = items.item(plan, iv, host_io)  # checked (the first sight makes new dicts: not its own yet)
    assert first[2] and first[3] == want and len(calls) == 1 and len(items._items) == 0
    second = items.item(plan, iv, host_io)  # get()'s entry hands its views back: remembered as an item
    assert len(calls) == 1 and second[0] is iv.ins and second[1] is iv.outs and len(items._items) == 1
    third = items.item(plan, iv, host_io)
    assert len(calls) == 1 and third[0] is iv.ins and third[1] is iv.outs and third[2] and third[3] == want
    assert items.item(other, iv, host_io)[3] == want and len(calls) == 2  # another plan: not this entry, checked
    assert items.item(plan, (iv.ins, iv.outs), host_io)[3] == want  # a plain pair: get()'s way, view by view
    dropped = ItemViews({"x": np.frombuffer(region, np.float32, 4, 256), "y": y}, {"o": o})
    items.item(plan, dropped, host_io)
    items.item(plan, dropped, host_io)
    assert len(items._items) == 2
    gone = weakref.ref(dropped.ins["x"])
    del dropped
    gc.collect()
    assert gone() is None  # the entry kept neither the item nor its views
    for _ in range(50):  # a new item, perhaps at the dead one's id: checked, never served by the dead entry
        fresh = ItemViews({"x": np.frombuffer(region, np.float32, 4, 320), "y": y}, {"o": o})
        before = len(calls)
        assert items.item(plan, fresh, host_io)[3] == ((fresh.ins["x"].ctypes.data, y.ctypes.data), (o.ctypes.data,))
        assert len(calls) > before
        del fresh
    with pytest.raises(KernelInputError) as ei:  # a bad view: the backend's typed error, nothing remembered
        items.item(plan, ItemViews({"x": np.zeros(5, np.float32), "y": y}, {"o": o}), host_io)
    assert ei.value.field == "shape" and ei.value.tensor == "x"
    strided = ItemViews({"x": np.frombuffer(region, np.float32, 8, 512)[::2], "y": y}, {"o": o})
    for _ in range(2):  # not contiguous: checked every time
        before = len(calls)
        assert items.item(plan, strided, host_io)[2] is False and len(calls) == before + 1
    assert items.item(plan, iv, host_io)[0] is iv.ins  # still served after the others came and went
    n = len(calls)
    ck.unregister()  # the range is gone: every entry with it
    assert items.item(plan, iv, host_io)[3] is None and len(calls) == n + 1 and len(items._items) == 0


@pytest.mark.parametrize("pers", [(96, 40), (96, 0, 40)])
def test_a_gathered_graphs_rows_after_the_first_batch_change_only_their_host_addresses(pers: tuple[int, ...]) -> None:
    """``row_filler``: every batch's table equals the whole rows of that batch (:func:`_rows_in`, :func:`_rows_out`),
    though after the first only the host address columns are written; a tensor of no bytes has no rows."""
    size, rng = 5, np.random.default_rng(1)
    dsts = [(1 << 40 | i << 20, per) for i, per in enumerate(pers)]
    srcs = [(1 << 41, 24, 24), (1 << 41 | 1 << 20, 0, 0), (1 << 41 | 2 << 20, 8, 0)]
    table = _HostTable()
    table.reserve(size * (len(dsts) + len(srcs)))
    fill = gather.row_filler(table, dsts, srcs)
    for _ in range(4):
        addrs = ([[int(a) for a in rng.integers(1, 1 << 47, size)] for _ in dsts],
                 [[int(a) for a in rng.integers(1, 1 << 47, size)] for _ in srcs])
        fill(addrs)
        want = gather._rows_in(addrs[0], dsts) + gather._rows_out(addrs[1], srcs)
        assert len(want) == 4 * size * (sum(1 for p in pers if p) + 2)
        assert table.flat[:len(want)].tolist() == want
    # the very columns object of the last call: the table holds its rows already, nothing is written; an equal
    # but other object is written again
    table.flat[:len(want)] = 7
    fill(addrs)
    assert table.flat[:len(want)].tolist() == [7] * len(want)
    fill(([list(c) for c in addrs[0]], [list(c) for c in addrs[1]]))
    n_in = len(gather._rows_in(addrs[0], dsts)) // 4
    assert table.tab[:n_in, 0].tolist() == [r[0] for r in np.reshape(want, (-1, 4))[:n_in].tolist()]


def test_a_batchs_address_columns_are_kept_per_sequence_of_its_requests_address_tuples() -> None:
    """``_cupy_runs._columns``: the columns of a batch's requests (per input and output, every request's address);
    the same sequence of address tuple objects gets the same columns object (a graph's filler then writes nothing),
    another order or other tuples their own columns."""
    from shmrpc.kernels import _cupy_runs as runs

    be = types.SimpleNamespace(_kept_columns={})
    ats = [((100 + b, 200 + b), (300 + b,)) for b in range(4)]
    got = [({}, {}, True, a) for a in ats]
    cols = runs._columns(be, got)
    assert cols == ([[100, 101, 102, 103], [200, 201, 202, 203]], [[300, 301, 302, 303]])
    assert runs._columns(be, list(got)) is cols  # the same tuples in the same order
    rev = runs._columns(be, got[::-1])
    assert rev is not cols and rev == ([[103, 102, 101, 100], [203, 202, 201, 200]], [[303, 302, 301, 300]])
    equal = [({}, {}, True, (tuple(a[0]), tuple(a[1]))) for a in ats]  # equal values, other objects: computed
    assert runs._columns(be, equal) == cols
    assert len(be._kept_columns) == 3
