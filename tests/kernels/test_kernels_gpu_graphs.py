"""CUDA graphs of batches keyed by their slots (:mod:`shmrpc.kernels._cuda_batch`, cuBLAS products
through :mod:`._cuda_blas`) and of whole chunked runs (``ChunkGraphs``): results equal the plain path
bit for bit, a graph writes only its requests' outputs, and plans or views that may not be captured
take the plain path. The graphs of gathered batches, which take these batches over where kernels
may use host addresses, are off here (they are tested in test_kernels_gpu_gather.py). GPU tests
skip with the reason where there is no CuPy/GPU; the helpers that need no device run everywhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from support.pinned import Pinned

from shmrpc.kernels import StepSpec, TensorSpec, select_backend
from shmrpc.kernels._cuda_batch import _overlap, address


@pytest.fixture(autouse=True)
def _slot_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backends made in these tests keep the slot-keyed batch graphs (no graphs of gathered batches)."""
    from shmrpc.kernels import _cuda_gather

    monkeypatch.setattr(_cuda_gather, "GATHER_GRAPHS", 0)


def _fill(rng: np.random.Generator, v: np.ndarray, dt: str) -> None:
    f = (rng.standard_normal(v.shape) * 0.5).astype(np.float32)
    v[...] = (f.view(np.uint32) >> 16).astype(np.uint16) if dt == "bfloat16" else f.astype(dt)


def _batch(host: Pinned, plan: Any, size: int, dt: str) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    items = []
    for _ in range(size):
        ins = {n: host.view(s.shape, s.dtype) for n, s in plan.inputs.items() if n not in plan.resident}
        outs = {n: host.view(s.shape, s.dtype) for n, s in plan.outputs.items()}
        items.append((ins, outs))
    return items


def test_address_is_remembered_for_views_only_and_overlap() -> None:
    base = np.zeros(64, np.float32)
    v = base[8:16]
    assert address(v) == v.ctypes.data == address(v)
    assert address(base) == base.ctypes.data  # an owning array: looked up each time
    assert not _overlap([(0, 10), (10, 20), (30, 40)])
    assert _overlap([(0, 100), (30, 40), (50, 60)]) and _overlap([(5, 15), (0, 10)])


GEMM = [StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "o"})]
CASES = {
    "gemm-float16": (GEMM, {"x": ((16, 64), "float16"), "w": ((64, 32), "float16")}),
    "gemm-float32": (GEMM, {"x": ((8, 32), "float32"), "w": ((32, 48), "float32")}),
    "gemm-bfloat16": (GEMM, {"x": ((16, 64), "bfloat16"), "w": ((64, 32), "bfloat16")}),
    "gemm_bias-float16": ([StepSpec("gemm_bias", {"x": "x", "w": "w", "bias": "b"}, {"out": "o"})],
                          {"x": ((16, 64), "float16"), "w": ((64, 32), "float16"), "b": ((32,), "float16")}),
    "gemm-gelu-float16": ([StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "t"}), StepSpec("gelu", {"x": "t"}, {"out": "o"})],
                          {"x": ((16, 64), "float16"), "w": ((64, 32), "float16")}),
    "softmax-float32": ([StepSpec("softmax", {"x": "x"}, {"out": "o"})], {"x": ((4, 100), "float32")}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("size", [2, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_graph_equals_the_plain_joint_run_bit_for_bit(cp: Any, case: str, size: int) -> None:
    steps, ins = CASES[case]
    specs = {n: TensorSpec(shape, dt) for n, (shape, dt) in ins.items()}
    host = Pinned(cp)
    rng = np.random.default_rng(size)
    with select_backend("cupy") as be, select_backend("cupy") as plain:
        plain._batch_graphs.limit = 0  # the plain joint path only
        plan, plan_plain = be.plan(steps, specs, ["o"]), plain.plan(steps, specs, ["o"])
        items = _batch(host, plan, size, "")
        served = []
        for _ in range(6):
            for its, _ in items:
                for n, v in its.items():
                    _fill(rng, v, specs[n].dtype)
            want = [({n: v.copy() for n, v in i.items()}, {n: np.empty_like(v) for n, v in o.items()}) for i, o in items]
            res = be.run_batch(plan, items)
            assert all(isinstance(r, dict) for r in res), res
            served.append(res[0].get("graph", 0.0))  # type: ignore[union-attr]
            plain.run_batch(plan_plain, want)
            for (_, got), (_, ref) in zip(items, want):
                assert got["o"].tobytes() == ref["o"].tobytes()
        bg = be._batch_graphs
        assert bg.last_error == "" and bg.captures == 1 and sum(served) == 4, (bg.last_error, served)  # third sight on
        assert host.untouched()


@pytest.mark.gpu
def test_a_batch_graph_writes_only_its_requests_outputs(gpu: Any, cp: Any) -> None:
    specs = {"x": TensorSpec((16, 64), "float16"), "w": TensorSpec((64, 32), "float16")}
    plan = gpu.plan(GEMM, specs, ["o"])
    host = Pinned(cp)
    a, b = _batch(host, plan, 4, ""), _batch(host, plan, 4, "")
    rng = np.random.default_rng(1)
    for items in (a, b):
        for ins, _ in items:
            _fill(rng, ins["x"], "float16")
            _fill(rng, ins["w"], "float16")
    for _ in range(3):
        gpu.run_batch(plan, a)
    first = [o["o"].copy() for _, o in a]
    for _, o in a:
        o["o"][:] = 0  # a's outputs, now not asked for
    for _ in range(3):
        res = gpu.run_batch(plan, b)
    assert len(gpu._batch_graphs) == 2 and res[0].get("graph") == 1.0  # type: ignore[union-attr]
    assert all((o["o"] == 0).all() for _, o in a) and host.untouched()
    got = [o["o"].copy() for _, o in b]
    for _, o in b:
        o["o"][:] = 0
    res = gpu.run_batch(plan, [b[2], b[0], b[3], b[1]])  # the same requests in another order: the same graph
    assert len(gpu._batch_graphs) == 2 and res[0].get("graph") == 1.0  # type: ignore[union-attr]
    assert all(o["o"].tobytes() == g.tobytes() for (_, o), g in zip(b, got))
    for (ins, _), f in zip(a, first):
        want = (ins["x"].astype(np.float32) @ ins["w"].astype(np.float32)).astype(np.float16)
        np.testing.assert_allclose(f.astype(np.float32), want.astype(np.float32), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_batches_that_may_not_be_captured_run_the_plain_path(gpu: Any, cp: Any) -> None:
    """A resident weight (a broadcast product CuPy must issue) fails its capture once; pageable views never try."""
    w = (np.random.default_rng(2).standard_normal((64, 32)) * 0.1).astype(np.float16)
    spec = gpu.put("w", w, "float16")
    plan = gpu.plan(GEMM, {"x": TensorSpec((16, 64), "float16"), "w": spec}, ["o"], resident={"w": "w"})
    host = Pinned(cp)
    items = _batch(host, plan, 4, "")
    rng = np.random.default_rng(3)
    for _ in range(4):
        for ins, _ in items:
            _fill(rng, ins["x"], "float16")
        res = gpu.run_batch(plan, items)
        assert all(isinstance(r, dict) and "graph" not in r for r in res)
        for ins, o in items:
            want = (ins["x"].astype(np.float32) @ w.astype(np.float32))
            np.testing.assert_allclose(o["o"].astype(np.float32), want, rtol=2e-2, atol=2e-2)
    assert id(plan) in gpu._batch_graphs._failed and len(gpu._batch_graphs) == 0

    plan2 = gpu.plan(GEMM, {"x": TensorSpec((4, 8), "float32"), "w": TensorSpec((8, 4), "float32")}, ["o"])
    pageable = [({"x": np.ones((4, 8), np.float32), "w": np.ones((8, 4), np.float32)}, {"o": np.empty((4, 4), np.float32)})
                for _ in range(3)]
    for _ in range(4):
        res = gpu.run_batch(plan2, pageable)
        assert all(isinstance(r, dict) and "graph" not in r for r in res)
    assert all((o["o"] == 8).all() for _, o in pageable) and len(gpu._batch_graphs) == 0


@pytest.mark.gpu
def test_batch_graphs_are_dropped_on_reset_unregister_and_close(cp: Any) -> None:
    host = Pinned(cp)
    with select_backend("cupy") as be:
        plan = be.plan(GEMM, {"x": TensorSpec((4, 8), "float32"), "w": TensorSpec((8, 4), "float32")}, ["o"])
        items = _batch(host, plan, 2, "")
        for ins, _ in items:
            ins["x"][:] = 1
            ins["w"][:] = 2
        for _ in range(3):
            be.run_batch(plan, items)
        assert len(be._batch_graphs) == 1
        be.inject_fault = "cuda_error"
        res = be.run_batch(plan, items)  # an injected fault runs request by request, each failing once
        assert any(isinstance(r, Exception) for r in res) and len(be._batch_graphs) == 0
        for _ in range(3):
            res = be.run_batch(plan, items)
        assert len(be._batch_graphs) == 1 and all((o["o"] == 16).all() for _, o in items)
        be.unregister_host()
        assert len(be._batch_graphs) == 0
        for _ in range(3):
            be.run_batch(plan, items)
        assert len(be._batch_graphs) == 1
    assert len(be._batch_graphs) == 0 and be._batch_graphs._sh.blas is None


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["stages", "streams"])
def test_chunk_graph_equals_the_plain_chunked_run_in_and_out_of_place(gpu: Any, cp: Any, monkeypatch: pytest.MonkeyPatch,
                                                                      pipeline: str) -> None:
    from shmrpc.kernels import _backend_cupy, _cuda_chunks

    monkeypatch.setattr(_backend_cupy, "CHUNK_THRESHOLD_BYTES", 1 << 20)
    monkeypatch.setattr(_cuda_chunks, "CHUNK_BYTES", 256 << 10)
    monkeypatch.setattr(_cuda_chunks, "CHUNK_MIN_BYTES", 256 << 10)
    monkeypatch.setattr(_cuda_chunks, "CHUNK_PIPELINE", pipeline)
    n = (3 << 20) // 4 + 13
    steps = [StepSpec("scale", {"x": "x"}, {"out": "t"}, {"a": 3.0}), StepSpec("vector_add", {"x": "t", "y": "y"}, {"out": "o"})]
    plan = gpu.plan(steps, {"x": TensorSpec((n,), "float32"), "y": TensorSpec((n,), "float32")}, ["o"])
    host = Pinned(cp, 16 << 20)
    x, y, o = host.view((n,), np.float32), host.view((n,), np.float32), host.view((n,), np.float32)
    y[:] = 2
    served = []
    for i in range(5):
        x[:] = (np.arange(n, dtype=np.float32) + i) % 1000
        want = 3 * x + 2
        served.append(gpu.run(plan, {"x": x, "y": y}, {"o": o}).get("graph", 0.0))
        assert o.tobytes() == want.tobytes()
    for i in range(4):  # in place: the output over input x, another key
        x[:] = (np.arange(n, dtype=np.float32) * 7 + i) % 1000
        want = 3 * x + 2
        served.append(gpu.run(plan, {"x": x, "y": y}, {"o": x}).get("graph", 0.0))
        assert x.tobytes() == want.tobytes()
    cg = gpu._chunk_graphs
    assert cg.last_error == "" and cg.captures == 2 and served == [0, 0, 1, 1, 1, 0, 0, 1, 1], (cg.last_error, served)
    assert host.untouched()
    gpu.unregister_host()
    assert len(cg) == 0


@pytest.mark.gpu
def test_chunk_graphs_off_and_pageable_views_run_the_plain_path(gpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from shmrpc.kernels import _backend_cupy

    monkeypatch.setattr(_backend_cupy, "CHUNK_THRESHOLD_BYTES", 1 << 20)
    n = 1 << 19
    plan = gpu.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0})], {"x": TensorSpec((n,), "float32")}, ["o"])
    x, o = np.ones(n, np.float32), np.empty(n, np.float32)
    for _ in range(4):
        assert "graph" not in gpu.run(plan, {"x": x}, {"o": o})
    assert (o == 2).all() and len(gpu._chunk_graphs) == 0


@pytest.mark.gpu
def test_a_plan_whose_batches_do_not_repeat_stops_being_captured(gpu: Any, cp: Any) -> None:
    from shmrpc.kernels import _cuda_batch

    plan = gpu.plan(GEMM, {"x": TensorSpec((4, 8), "float32"), "w": TensorSpec((8, 4), "float32")}, ["o"])
    host = Pinned(cp, 8 << 20)
    items = _batch(host, plan, 2 * (_cuda_batch.PAYBACK_MIN_CAPTURES + 1), "")
    for i, (ins, _) in enumerate(items):
        ins["x"][:] = i
        ins["w"][:] = 1
    for p in range(_cuda_batch.PAYBACK_MIN_CAPTURES + 1):  # every pair seen three times, then never again
        pair = items[2 * p: 2 * p + 2]
        for _ in range(3):
            res = gpu.run_batch(plan, pair)
        assert all((o["o"] == 8 * (2 * p + b)).all() for b, (_, o) in enumerate(pair))
    bg = gpu._batch_graphs
    assert bg.captures == _cuda_batch.PAYBACK_MIN_CAPTURES and id(plan) in bg._failed and "seldom" in bg.last_error
    assert "graph" not in res[0] and host.untouched()  # type: ignore[operator]


@pytest.mark.gpu
def test_a_chunk_graph_launch_is_answered_by_finish(gpu: Any, cp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """launch(): a large request whose chunk graph exists starts on the device and returns; finish() waits and
    answers it; no graph yet, or its graph not finished: None (run() serves it); the next launch knows its eta."""
    from shmrpc.kernels import _backend_cupy, _cuda_chunks

    monkeypatch.setattr(_backend_cupy, "CHUNK_THRESHOLD_BYTES", 1 << 20)
    monkeypatch.setattr(_cuda_chunks, "CHUNK_BYTES", 256 << 10)
    monkeypatch.setattr(_cuda_chunks, "CHUNK_MIN_BYTES", 256 << 10)
    n = (3 << 20) // 4 + 5
    plan = gpu.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 3.0, "b": 1.0})], {"x": TensorSpec((n,), "float32")},
                    ["o"])
    host = Pinned(cp, 16 << 20)
    x, o = host.view((n,), np.float32), host.view((n,), np.float32)
    assert gpu.launch(plan, {"x": x}, {"o": o}) is None  # no graph yet
    for i in range(2):  # the plain chunked run, then its capture
        x[:] = (np.arange(n, dtype=np.float32) + i) % 1000
        gpu.run(plan, {"x": x}, {"o": o})
        assert o.tobytes() == (3 * x + 1).tobytes()
    for i in range(2, 5):
        x[:] = (np.arange(n, dtype=np.float32) * 7 + i) % 1000
        h = gpu.launch(plan, {"x": x}, {"o": o})
        assert h is not None and (h.eta > 0) == (i > 2)  # the second launch knows how long the first took
        assert gpu.launch(plan, {"x": x}, {"o": o}) is None  # its graph is this launch's until finish()
        res = h.finish()
        assert res["graph"] == 1.0 and res["chunks"] > 1 and o.tobytes() == (3 * x + 1).tobytes()
    assert gpu.launch(plan, {"x": x[:-1].reshape(-1)}, {"o": o}) is None  # a bad view: run() reports it
    gpu.unregister_host()
    assert host.untouched()
