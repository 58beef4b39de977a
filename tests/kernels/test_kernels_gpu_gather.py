"""Batches on CuPy by one gather and one scatter launch (:mod:`shmrpc.kernels._cuda_gather`):
the same bits as the plain joint run (memcpy per tensor per request) and the per-request results
within each op's tolerance, for every ``batch=True`` op at B = 2, 3, 8, 17 with odd sizes and
unaligned views; in-place batches; a failing request fails alone; views in one registered region
and across two; pageable views take the memcpy path. Graphs of gathered batches (one per plan
and B): the same bits as the gathered run for batches on ever other slots, in place once
captured, a refused capture, dropped on reset, unregister and close. GPU tests skip with the
reason where there is no CuPy/GPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support.pinned import Pinned

from shmrpc.kernels import REGISTRY, KernelRuntimeError, StepSpec, TensorSpec, select_backend
from shmrpc.kernels._batch import batchable
from shmrpc.kernels._cuda_blas import BLAS_OPS
from shmrpc.kernels._registry import unregister
from shmrpc.kernels.api import OpCall, OpSpec, register_op, require_float

pytestmark = pytest.mark.gpu
_F16, _BF16, _F32 = "float16", "bfloat16", "float32"


@pytest.fixture
def gpu(cp: Any) -> Iterator[Any]:  # conftest's cp: skipped with the reason where there is no CuPy/GPU
    with select_backend("cupy") as be:
        if not be.gather_batches:
            pytest.skip(f"the gather path is off on this device: {be._host_access.why}")
        be._batch_graphs.limit = 0  # graphs would take over repeated batches: the gather path is under test
        be._gather_graphs.limit = 0
        be.gather_min_batch = 2  # every batch size under test takes the gather path
        yield be


def _host(cp: Any, nbytes: int = 8 << 20, pinned: bool = True) -> Pinned:
    """Host memory handing out views ``shift`` bytes past where the last left off (64-byte rounding, 64 bytes apart)."""
    return Pinned(cp, nbytes, align=64, gap=64, pinned=pinned)


def _fill(rng: np.random.Generator, v: np.ndarray, dt: str) -> None:
    f = (rng.standard_normal(v.shape) * 0.5).astype(np.float32)
    v[...] = (f.view(np.uint32) >> 16).astype(np.uint16) if dt == _BF16 else f.astype(dt)


def _f64(a: np.ndarray, dt: str) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64) if dt == _BF16 else a.astype(np.float64)


# every batch=True op, at sizes whose bytes are no multiple of 16: (op, steps, specs, outputs, resident, attrs)
CASES: list[tuple[str, list[StepSpec], dict[str, TensorSpec], list[str], dict[str, TensorSpec]]] = [
    ("echo", [StepSpec("echo", {"x": "x"}, {"out": "o"})], {"x": TensorSpec((3, 7), _F32)}, ["o"], {}),
    ("vector_add", [StepSpec("vector_add", {"x": "x", "y": "y"}, {"out": "o"})],
     {"x": TensorSpec((37,), _F16), "y": TensorSpec((37,), _F16)}, ["o"], {}),
    ("scale", [StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 1.5})], {"x": TensorSpec((5, 9), _F32)}, ["o"], {}),
    ("gelu", [StepSpec("gelu", {"x": "x"}, {"out": "o"})], {"x": TensorSpec((1001,), _BF16)}, ["o"], {}),
    ("gemm", [StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "o"})],
     {"x": TensorSpec((3, 37), _F16), "w": TensorSpec((37, 5), _F16)}, ["o"], {}),
    ("gemm_bias", [StepSpec("gemm_bias", {"x": "x", "w": "w", "bias": "b"}, {"out": "o"})],
     {"x": TensorSpec((5, 33), _BF16), "w": TensorSpec((33, 7), _BF16), "b": TensorSpec((7,), _BF16)}, ["o"], {}),
    ("layernorm", [StepSpec("layernorm", {"x": "x", "gamma": "g", "beta": "b"}, {"out": "o"})],
     {"x": TensorSpec((3, 33), _F32), "g": TensorSpec((33,), _F32), "b": TensorSpec((33,), _F32)}, ["o"], {}),
    ("layernorm_gelu", [StepSpec("layernorm_gelu", {"x": "x", "gamma": "g", "beta": "b"}, {"out": "o"})],
     {"x": TensorSpec((5, 77), _F16)}, ["o"], {"g": TensorSpec((77,), _F16), "b": TensorSpec((77,), _F16)}),
    ("softmax", [StepSpec("softmax", {"x": "x"}, {"out": "o"})], {"x": TensorSpec((7, 13), _F16)}, ["o"], {}),
    ("gemm", [StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "h"}), StepSpec("softmax", {"x": "h"}, {"out": "p"})],
     {"x": TensorSpec((4, 64), _F16)}, ["h", "p"], {"w": TensorSpec((64, 24), _F16)}),
]


def _plan(be: Any, case: Any, seed: int = 1) -> Any:
    _, steps, specs, outs, resident = case
    rng = np.random.default_rng(seed)
    names = {}
    for k, s in resident.items():
        names[k] = f"r_{k}"
        a = np.empty(s.shape, np.uint16 if s.dtype == _BF16 else s.dtype)
        _fill(rng, a, s.dtype)
        specs = {**specs, k: be.put(names[k], a, s.dtype)}
    return be.plan(steps, specs, outs, resident=names)


def _items(host: Pinned, plan: Any, size: int, seed: int, shifts: tuple[int, ...] = (0,)) -> list[Any]:
    rng = np.random.default_rng(seed)
    items = []
    for b in range(size):
        ins = {}
        for i, (n, s) in enumerate((n, s) for n, s in plan.inputs.items() if n not in plan.resident):
            ins[n] = host.view(s.shape, s.dtype, shifts[(b + i) % len(shifts)])
            _fill(rng, ins[n], s.dtype)
        outs = {n: host.view(s.shape, s.dtype, shifts[(b + 1) % len(shifts)]) for n, s in plan.outputs.items()}
        items.append((ins, outs))
    return items


def _outputs(items: list[Any]) -> list[dict[str, bytes]]:
    return [{n: v.tobytes() for n, v in outs.items()} for _, outs in items]


def _served(res: list[Any], size: int, how: str | None) -> None:
    assert all(isinstance(r, dict) and r.get("batch") == float(size) for r in res), res
    assert all((how in r) if how else ("gather" not in r and "graph" not in r) for r in res), res


def test_every_batch_op_has_a_case() -> None:
    assert {c[0] for c in CASES} >= {n for n, s in REGISTRY.items() if s.batch and s.builtin}


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{'-'.join(c[3])}" for c in CASES])
@pytest.mark.parametrize("size", [2, 3, 8, 17])
def test_gather_equals_plain_joint_run_bit_for_bit_and_each_request_alone(gpu: Any, cp: Any, case: Any, size: int) -> None:
    plan = _plan(gpu, case)
    assert batchable(plan)
    host = _host(cp)
    shifts = (0, 2, 4, 6, 8, 10, 12, 14) if all(s.dtype != _F32 for s in plan.tensors.values()) else (0, 4, 8, 12)
    items = _items(host, plan, size, seed=size, shifts=shifts)  # 16-aligned, 4-aligned and 2-aligned views
    _served(gpu.run_batch(plan, items), size, "gather")
    got = _outputs(items)
    gpu.gather_batches = False
    _served(gpu.run_batch(plan, items), size, None)
    assert _outputs(items) == got  # the same kernels on the same data: the same bits
    assert host.untouched()  # nothing written outside the outputs
    for (ins, outs), g in zip(items, got):
        want = {n: np.empty_like(v) for n, v in outs.items()}
        gpu.run(plan, ins, want)
        for n, spec in plan.outputs.items():
            op = next(st.op for st in plan.steps if n in st.outputs.values())
            rtol, atol = op.tolerances[spec.dtype]
            have = np.frombuffer(g[n], want[n].dtype).reshape(want[n].shape)
            np.testing.assert_allclose(_f64(have, spec.dtype), _f64(want[n], spec.dtype), rtol=rtol, atol=atol,
                                       err_msg=f"output {n!r}")


@pytest.mark.parametrize("size", [3, 8])
def test_in_place_batch(gpu: Any, cp: Any, size: int) -> None:
    plan = gpu.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 3.0})], {"x": TensorSpec((3, 11), _F32)}, ["o"])
    host = _host(cp)
    rng = np.random.default_rng(size)
    views = [host.view((3, 11), _F32, 4 * (b % 4)) for b in range(size)]
    for v in views:
        _fill(rng, v, _F32)
    before = [v.copy() for v in views]
    _served(gpu.run_batch(plan, [({"x": v}, {"o": v}) for v in views]), size, "gather")
    for v, b in zip(views, before):
        np.testing.assert_array_equal(v, b * np.float32(3.0))
    assert host.untouched()


@pytest.fixture
def failing_op() -> Iterator[str]:
    """A batch-safe op that raises on a request holding the marker -7."""

    def infer(inputs: Any, attrs: Any) -> dict[str, TensorSpec]:
        require_float(inputs["x"], "x")
        return {"out": inputs["x"]}

    def impl(call: OpCall) -> dict[str, Any]:
        x = call.inputs["x"]
        if bool((x == -7).any()):
            raise ValueError("the input holds the marker -7")
        return {"out": x * 2}

    register_op(OpSpec("t_gather_fail", inputs=("x",), outputs=("out",), infer=infer, numpy=impl, cupy=impl,
                       tolerances={"float32": (0.0, 0.0)}, example={"x": TensorSpec((5,), "float32")}, batch=True))
    yield "t_gather_fail"
    if "t_gather_fail" in REGISTRY:
        unregister("t_gather_fail")


def test_a_failing_request_fails_alone(gpu: Any, cp: Any, failing_op: str) -> None:
    plan = gpu.plan([StepSpec(failing_op, {"x": "x"}, {"out": "o"})], {"x": TensorSpec((5,), _F32)}, ["o"])
    host = _host(cp)
    items = []
    for i in range(5):
        x, o = host.view((5,), _F32), host.view((5,), _F32)
        x[:] = i
        o[:] = 0
        items.append(({"x": x}, {"o": o}))
    items[2][0]["x"][1] = -7
    _served(gpu.run_batch(plan, [it for i, it in enumerate(items) if i != 2]), 4, "gather")  # the path is live
    res = gpu.run_batch(plan, items)
    assert isinstance(res[2], KernelRuntimeError) and (res[2].op, res[2].step) == (failing_op, 0)
    for i in (0, 1, 3, 4):
        assert isinstance(res[i], dict) and "batch" not in res[i]  # run alone after the joint run failed
        np.testing.assert_array_equal(items[i][1]["o"], np.full(5, 2 * i, np.float32))
    np.testing.assert_array_equal(items[2][1]["o"], np.zeros(5, np.float32))  # its output untouched


def _registered(be: Any, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """A page-aligned NumPy buffer registered with the backend (the worker's regions are registered so)."""
    raw = np.empty(nbytes + 4096, np.uint8)
    start = (-raw.ctypes.data) % 4096
    buf = raw[start:start + nbytes]
    buf[:] = 0xAB
    be.register_host(buf.ctypes.data, nbytes)
    return raw, buf


@pytest.mark.parametrize("regions", [1, 2])
def test_views_in_registered_regions(gpu: Any, regions: int) -> None:
    case = CASES[4]  # gemm, x and w per request
    plan = _plan(gpu, case)
    bufs = [_registered(gpu, 1 << 20) for _ in range(regions)]
    try:
        rng = np.random.default_rng(regions)
        offs = [0] * regions
        items = []
        for b in range(8):
            r = b % regions
            views = {}
            for n, s in (*((n, s) for n, s in plan.inputs.items()), *plan.outputs.items()):
                nb = s.nbytes
                views[n] = np.frombuffer(bufs[r][1], np.float16, nb // 2, offs[r]).reshape(s.shape)
                offs[r] += -(-nb // 64) * 64
            for n in plan.inputs:
                _fill(rng, views[n], _F16)
            items.append(({n: views[n] for n in plan.inputs}, {"o": views["o"]}))
        _served(gpu.run_batch(plan, items), 8, "gather")
        got = _outputs(items)
        gpu.gather_batches = False
        _served(gpu.run_batch(plan, items), 8, None)
        assert _outputs(items) == got
        gpu.gather_batches = True
        gpu.unregister_host(bufs[0][1].ctypes.data)  # pageable again: the memcpy path, never a kernel reading it
        _served(gpu.run_batch(plan, items), 8, None)
        assert _outputs(items) == got
    finally:
        gpu.unregister_host()


def test_pageable_views_take_the_memcpy_path(gpu: Any, cp: Any) -> None:
    plan = _plan(gpu, CASES[8])
    host, pageable = _host(cp), _host(cp, 1 << 20, pinned=False)
    items = _items(host, plan, 4, seed=4)
    items[3] = ({"x": pageable.view((7, 13), _F16)}, items[3][1])
    items[3][0]["x"][:] = 1
    _served(gpu.run_batch(plan, items), 4, None)
    _served(gpu.run_batch(plan, items[:3]), 3, "gather")
    assert host.untouched() and pageable.untouched()


def test_large_requests_keep_the_memcpy_path(gpu: Any, cp: Any) -> None:
    plan = gpu.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0})], {"x": TensorSpec(((1 << 20) + 3,), _F32)},
                    ["o"])  # 8 MiB moved per request: over GATHER_MAX_BYTES
    host = _host(cp, 20 << 20)
    items = _items(host, plan, 2, seed=5)
    _served(gpu.run_batch(plan, items), 2, None)
    for ins, outs in items:
        np.testing.assert_array_equal(outs["o"], ins["x"] * np.float32(2.0))


def test_batches_under_the_minimum_keep_the_memcpy_path(gpu: Any, cp: Any) -> None:
    plan = _plan(gpu, CASES[8])
    host = _host(cp)
    gpu.gather_min_batch = 8
    small, big = _items(host, plan, 7, seed=7), _items(host, plan, 8, seed=8)
    _served(gpu.run_batch(plan, small), 7, None)
    _served(gpu.run_batch(plan, big), 8, "gather")
    got = _outputs(small + big)
    gpu.gather_batches = False
    _served(gpu.run_batch(plan, small), 7, None)
    _served(gpu.run_batch(plan, big), 8, None)
    assert _outputs(small + big) == got


# -- graphs of gathered batches ---------------------------------------------------------------------------


@pytest.fixture
def graphed(cp: Any) -> Iterator[Any]:
    with select_backend("cupy") as be:
        if not be.gather_batches or not be._gather_graphs.limit:
            pytest.skip(f"the gather path or its graphs are off on this device: {be._host_access.why}")
        be._batch_graphs.limit = 0
        be.gather_min_batch = 2
        yield be


def _plain(be: Any, plan: Any, items: list[Any]) -> list[dict[str, bytes]]:
    """The outputs of the plain gathered run of ``items`` (graphs off for that run), restored after."""
    kept = [{n: v.copy() for n, v in outs.items()} for _, outs in items]
    limit, be._gather_graphs.limit = be._gather_graphs.limit, 0
    try:
        _served(be.run_batch(plan, items), len(items), "gather")
        got = _outputs(items)
    finally:
        be._gather_graphs.limit = limit
    for (_, outs), k in zip(items, kept):
        for n, v in outs.items():
            v[...] = k[n]
    return got


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{'-'.join(c[3])}" for c in CASES])
@pytest.mark.parametrize("size", [2, 3, 9])
def test_a_gather_graph_serves_every_batch_of_its_plan_and_size_bit_for_bit(graphed: Any, cp: Any, case: Any,
                                                                           size: int) -> None:
    plan = _plan(graphed, case)
    host = _host(cp)
    shifts = (0, 2, 4, 6) if all(s.dtype != _F32 for s in plan.tensors.values()) else (0, 4, 8, 12)
    gg = graphed._gather_graphs
    served = []
    for r in range(4):  # four batches on four other sets of slots
        items = _items(host, plan, size, seed=10 * size + r, shifts=shifts)
        want = _plain(graphed, plan, items)
        res = graphed.run_batch(plan, items)
        _served(res, size, "gather")
        served.append(res[0].get("graph", 0.0))
        assert _outputs(items) == want, f"batch {r}"
    assert host.untouched()
    if plan.resident and any(st.op.name in BLAS_OPS for st in plan.steps):  # a broadcast product: refused once
        assert id(plan) in gg._failed and gg.captures == 0 and served == [0, 0, 0, 0], (gg.last_error, served)
        return
    assert gg.last_error == "" and (gg.captures, gg.launches) == (1, 2) and served == [0, 1, 1, 1], (gg.last_error, served)
    other = _items(host, plan, size + 1, seed=99, shifts=shifts)  # another B: another key, first sight
    assert "graph" not in graphed.run_batch(plan, other)[0] and len(gg) == 1


def test_a_gather_graph_serves_in_place_batches_but_is_captured_from_others(graphed: Any, cp: Any) -> None:
    plan = graphed.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 3.0})], {"x": TensorSpec((3, 11), _F32)}, ["o"])
    host = _host(cp)
    rng = np.random.default_rng(5)
    gg = graphed._gather_graphs

    def in_place() -> list[Any]:
        views = [host.view((3, 11), _F32, 4 * (b % 4)) for b in range(4)]
        for v in views:
            _fill(rng, v, _F32)
        before = [v.copy() for v in views]
        res = graphed.run_batch(plan, [({"x": v}, {"o": v}) for v in views])
        for v, b in zip(views, before):
            np.testing.assert_array_equal(v, b * np.float32(3.0))
        return res

    for _ in range(3):
        assert "graph" not in in_place()[0]  # never captured from an in-place batch
    assert gg.captures == 0
    items = _items(host, plan, 4, seed=6)
    res = graphed.run_batch(plan, items)
    assert res[0].get("graph") == 1.0 and gg.captures == 1
    for ins, outs in items:
        np.testing.assert_array_equal(outs["o"], ins["x"] * np.float32(3.0))
    assert in_place()[0].get("graph") == 1.0 and gg.launches == 1
    assert host.untouched()


def test_a_refused_capture_leaves_the_gathered_run(graphed: Any, cp: Any) -> None:
    """A resident weight makes a broadcast product that only cupy.matmul issues: the capture is refused
    once, the warm run's result stands, and that plan keeps the gathered run."""
    w = (np.random.default_rng(2).standard_normal((64, 32)) * 0.1).astype(np.float16)
    spec = graphed.put("w", w, "float16")
    plan = graphed.plan([StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "o"})],
                        {"x": TensorSpec((16, 64), _F16), "w": spec}, ["o"], resident={"w": "w"})
    host = _host(cp)
    for r in range(4):
        items = _items(host, plan, 4, seed=r)
        res = graphed.run_batch(plan, items)
        _served(res, 4, "gather")
        assert "graph" not in res[0]
        for ins, outs in items:
            want = ins["x"].astype(np.float32) @ w.astype(np.float32)
            np.testing.assert_allclose(outs["o"].astype(np.float32), want, rtol=2e-2, atol=2e-2)
    gg = graphed._gather_graphs
    assert id(plan) in gg._failed and len(gg) == 0 and gg.last_error
    assert host.untouched()


def test_gather_graphs_are_dropped_on_reset_unregister_and_close(cp: Any) -> None:
    host = _host(cp)
    with select_backend("cupy") as be:
        if not be.gather_batches or not be._gather_graphs.limit:
            pytest.skip(f"the gather path or its graphs are off on this device: {be._host_access.why}")
        be.gather_min_batch = 2
        gg = be._gather_graphs
        plan = be.plan([StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "o"})],
                       {"x": TensorSpec((4, 8), _F32), "w": TensorSpec((8, 4), _F32)}, ["o"])
        items = _items(host, plan, 2, seed=1)
        for ins, _ in items:
            ins["x"][:] = 1
            ins["w"][:] = 2
        for _ in range(2):
            be.run_batch(plan, items)
        assert len(gg) == 1
        be.inject_fault = "cuda_error"
        res = be.run_batch(plan, items)  # an injected fault runs request by request, each failing once
        assert any(isinstance(r, Exception) for r in res) and len(gg) == 0
        for _ in range(2):
            res = be.run_batch(plan, items)
        assert len(gg) == 1 and res[0].get("graph") == 1.0 and all((o["o"] == 16).all() for _, o in items)
        be.unregister_host()
        assert len(gg) == 0
        for _ in range(2):
            be.run_batch(plan, items)
        assert len(gg) == 1
    assert len(gg) == 0 and gg._sh.blas is None


def test_a_launched_batch_is_answered_by_finish(graphed: Any, cp: Any) -> None:
    """launch_batch: a batch whose graph exists starts on the device and returns; finish() waits and answers it
    (the same bits as the gathered run); no graph yet, or its graph still in use: None (run_batch runs it)."""
    plan = _plan(graphed, CASES[4])  # gemm, x and w per request
    host = _host(cp)
    items = [_items(host, plan, 3, seed=s) for s in range(4)]
    assert graphed.launch_batch(plan, items[0]) is None  # no graph of (plan, 3) yet
    for its in items[:2]:
        graphed.run_batch(plan, its)  # first sight, then the capture
    want = _plain(graphed, plan, items[2])
    h = graphed.launch_batch(plan, items[2])
    assert h is not None
    assert graphed.launch_batch(plan, items[3]) is None  # its graph is this launch's until finish()
    res = h.finish()
    _served(res, 3, "gather")
    assert all(r["graph"] == 1.0 for r in res) and _outputs(items[2]) == want
    want3 = _plain(graphed, plan, items[3])
    h = graphed.launch_batch(plan, items[3])
    assert h is not None
    other = _items(host, plan, 3, seed=9)  # a run of the same graph on this thread before finish(): waits for it
    want_other = _plain(graphed, plan, other)
    assert graphed.run_batch(plan, other)[0]["graph"] == 1.0 and _outputs(other) == want_other
    h.finish()
    assert _outputs(items[3]) == want3 and host.untouched()
    assert graphed.launch_batch(plan, [items[3][0]]) is None  # one request: no graph of (plan, 1) yet


@pytest.mark.parametrize("case", [CASES[4], CASES[2]], ids=["gemm", "scale"])
def test_a_lone_request_runs_and_launches_as_a_batch_of_one(graphed: Any, cp: Any, case: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """BATCH_SINGLES (opt-in): a lone request of a plan a gathered graph may serve is a batch of one (run_batch:
    first sight, then the capture; launch_batch: launched, answered by finish()), with the op's result in every
    form; with BATCH_SINGLES off (the default) it runs as before (no batch, never launched)."""
    from shmrpc.kernels import _cupy_runs

    monkeypatch.setattr(_cupy_runs, "BATCH_SINGLES", True)
    plan = _plan(graphed, case)
    host = _host(cp)
    gg = graphed._gather_graphs
    items = [_items(host, plan, 1, seed=s) for s in range(4)]
    ref = []
    for its in items:
        (ins, outs), = its
        if case[0] == "gemm":
            ref.append(ins["x"].astype(np.float64) @ ins["w"].astype(np.float64))
        else:
            ref.append(ins["x"].astype(np.float64) * 1.5)
    assert graphed.launch_batch(plan, items[0]) is None  # no graph of (plan, 1) yet
    got = []
    for its in items[:2]:  # first sight, then the capture (its warm run is this request's answer)
        (res,) = graphed.run_batch(plan, its)
        assert isinstance(res, dict) and res.get("batch") == 1.0, res
        got.append(_outputs(its))
    assert gg.captures == 1, gg.last_error
    h = graphed.launch_batch(plan, items[2])
    assert h is not None
    (res,) = h.finish()
    assert res["graph"] == 1.0 and res["batch"] == 1.0
    got.append(_outputs(items[2]))
    monkeypatch.setattr(_cupy_runs, "BATCH_SINGLES", False)
    assert graphed.launch_batch(plan, items[3]) is None
    (res,) = graphed.run_batch(plan, items[3])
    assert "batch" not in res and "gather" not in res
    got.append(_outputs(items[3]))
    for k, (its, want) in enumerate(zip(items, ref)):
        (_, outs), = its
        np.testing.assert_allclose(outs["o"].astype(np.float64), want, rtol=2e-2, atol=2e-2, err_msg=f"request {k}")
    if case[0] == "scale":  # elementwise: every form gives the same bits as the plain run
        for k in range(3):
            (ins, outs), = items[k]
            np.testing.assert_array_equal(outs["o"], ins["x"] * np.float32(1.5))
    assert host.untouched()
