"""The CuPy backend's small-request path (CUDA graphs, kept device buffers, sampled timings)
and its chunk pipelines: results equal the plain path bit for bit, a graph writes only its
request's outputs, and it is dropped or bypassed when it would no longer be right.
Skipped with the reason where there is no CuPy/GPU; the size parser runs everywhere."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shmrpc.kernels import REGISTRY, StepSpec, TensorSpec, select_backend
from shmrpc.kernels._cuda_chunks import chunk_ranges, parse_bytes


class Pinned:
    """Page-locked host memory carved into float views at fixed offsets, as the worker's slot views are."""

    def __init__(self, cp: Any, nbytes: int = 1 << 20) -> None:
        self.mem = cp.cuda.alloc_pinned_memory(nbytes)
        self.raw = np.frombuffer(self.mem, np.uint8, nbytes)
        self.raw[:] = 0xAB

    def view(self, offset: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        n = int(np.prod(shape))
        return np.frombuffer(self.mem, dtype, n, offset).reshape(shape)


def test_parse_bytes() -> None:
    assert [parse_bytes(t) for t in ("4M", "512K", "1G", "4096", "2MiB", "1.5M")] == [4 << 20, 512 << 10, 1 << 30, 4096,
                                                                                       2 << 20, 3 << 19]
    for bad in ("", "x", "-1M", "0"):
        with pytest.raises(ValueError, match="size|> 0"):
            parse_bytes(bad, "SHMRPC_CHUNK_BYTES")


@pytest.mark.parametrize(("n", "chunk", "first"), [(1000, 100, 10), (1000, 100, 100), (5, 100, 10), (150, 100, 10),
                                                    (64 << 20, 4 << 20, 1 << 18), (12345, 1000, 1), (7, 1, 1)])
def test_chunk_ranges_cover_everything_once_and_ramp(n: int, chunk: int, first: int) -> None:
    r = chunk_ranges(n, chunk, first)
    assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))
    sizes = [b - a for a, b in r]
    assert all(s > 0 for s in sizes) and max(sizes) <= chunk + 1
    if n > 4 * chunk and first < chunk:
        assert sizes[0] == first and sizes[-1] == first and sizes[1] == 2 * first  # the ramp both ends


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["float32", "float16"])
def test_graph_results_equal_the_plain_path_bit_for_bit(cp: Any, dt: str) -> None:
    steps = [StepSpec("vector_add", {"x": "x", "y": "y"}, {"out": "s"}), StepSpec("gelu", {"x": "s"}, {"out": "g"}),
             StepSpec("scale", {"x": "g"}, {"out": "o"}, {"a": 1.5, "b": -0.25})]
    specs = {"x": TensorSpec((4, 16), dt), "y": TensorSpec((4, 16), dt)}
    host = Pinned(cp)
    x, y, o = host.view(0, (4, 16), dt), host.view(4096, (4, 16), dt), host.view(8192, (4, 16), dt)
    rng = np.random.default_rng(0)
    with select_backend("cupy") as be, select_backend("cupy") as plain:
        plain._graphs.limit = 0  # the plain path only
        plan, plan_plain = be.plan(steps, specs, ["o"]), plain.plan(steps, specs, ["o"])
        served = []
        for _ in range(12):
            x[:] = rng.standard_normal(x.shape).astype(dt)
            y[:] = rng.standard_normal(y.shape).astype(dt)
            served.append(be.run(plan, {"x": x, "y": y}, {"o": o}).get("graph", 0.0))
            want = np.empty_like(o)
            plain.run(plan_plain, {"x": x.copy(), "y": y.copy()}, {"o": want})
            assert o.tobytes() == want.tobytes()
        assert be._graphs.captures == 1 and sum(served) >= 9  # seen once, captured on the second sight


@pytest.mark.gpu
@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize(("op", "attrs", "shape", "dt"), [
    ("scale", {"a": 2.5, "b": -1.0}, (16,), "float32"), ("vector_add", {}, (4, 16), "float16"),
    ("gelu", {}, (3, 7), "float32"), ("echo", {}, (5,), "int32"), ("softmax", {}, (4, 33), "float16"),
    ("layernorm", {}, (2, 64), "float32"), ("layernorm_gelu", {}, (2, 64), "bfloat16")])
def test_a_small_requests_graph_with_or_without_copies_gives_the_plain_paths_bits(
        cp: Any, monkeypatch: pytest.MonkeyPatch, direct: bool, op: str, attrs: dict[str, Any], shape: tuple[int, ...],
        dt: str) -> None:
    """Without copies (the kernels on the views' own pages) and with them, in place and not: the bits of the plain
    path, and only the outputs written."""
    from shmrpc.kernels import _backend_cupy
    from shmrpc.kernels._dtypes import storage_dtype

    monkeypatch.setattr(_backend_cupy, "DIRECT_MAX_BYTES", 65536 if direct else 0)
    entry = REGISTRY[op]
    names = list(entry.inputs)
    specs = {n: TensorSpec(shape if n in ("x", "y") else (shape[-1],), dt) for n in names}
    host = Pinned(cp)
    sdt = storage_dtype(dt)
    rng = np.random.default_rng(1)
    views = {n: host.view(4096 * i, specs[n].shape, sdt) for i, n in enumerate(names)}
    out = host.view(4096 * len(names), shape, sdt)
    with select_backend("cupy") as be, select_backend("cupy") as plain:
        plain._graphs.limit = 0
        for in_place in (False, True):
            dst = views["x"] if in_place else out
            plan = be.plan([StepSpec(op, {n: n for n in names}, {"out": "o"}, attrs)], specs, ["o"])
            plan_plain = plain.plan([StepSpec(op, {n: n for n in names}, {"out": "o"}, attrs)], specs, ["o"])
            for _ in range(4):
                for v in views.values():
                    f = rng.standard_normal(v.shape).astype(np.float32)
                    v[...] = (f.view(np.uint32) >> 16) if dt == "bfloat16" else f.astype(sdt)
                want = np.empty(shape, sdt)
                plain.run(plan_plain, {n: v.copy() for n, v in views.items()}, {"o": want})
                be.run(plan, dict(views), {"o": dst})
                assert dst.tobytes() == want.tobytes()
        assert be._graphs.captures == 2 and be.direct_captures == (2 if direct else 0)
        untouched = np.ones(host.raw.size, bool)
        for v in (*views.values(), out):
            a = v.ctypes.data - host.raw.ctypes.data
            untouched[a:a + v.nbytes] = False
        assert (host.raw[untouched] == 0xAB).all()


@pytest.mark.gpu
def test_a_bound_small_run_launches_its_graph_and_answers_as_run_does(gpu: Any, cp: Any) -> None:
    """The worker's bound run of a slot's views: served by the captured graph (no second lookup of the views), the
    stage sample and an injected fault still go through run(), and after a reset it captures again."""
    from shmrpc.kernels import _backend_cupy
    from shmrpc.kernels._errors import KernelRuntimeError

    host = Pinned(cp)
    x, o = host.view(0, (16,), np.float32), host.view(4096, (16,), np.float32)
    plan = gpu.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0, "b": 1.0})], {"x": x_spec(16)}, ["o"])
    bound = gpu.bind(plan, {"x": x}, {"o": o})
    got = []
    for i in range(2 * _backend_cupy.STAGE_SAMPLE_EVERY):
        x[:] = np.arange(16) + i
        got.append(frozenset(bound()))
        np.testing.assert_array_equal(o, 2 * (np.arange(16, dtype=np.float32) + i) + 1)
    assert gpu._graphs.captures == 1 and gpu._graphs.launches >= len(got) - 4
    assert frozenset({"total", "graph"}) in got and frozenset({"h2d", "kernel", "d2h", "total"}) in got
    gpu.inject_fault = "cuda_error"
    with pytest.raises(KernelRuntimeError, match="injected"):
        bound()
    assert len(gpu._graphs) == 0
    for i in range(4):
        x[:] = 3 * i
        bound()
        np.testing.assert_array_equal(o, np.full(16, 6 * i + 1, np.float32))
    assert gpu._graphs.captures == 2


@pytest.mark.gpu
def test_a_graph_moving_more_than_the_direct_bound_keeps_its_copies(gpu: Any, cp: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound counts inputs and outputs; a plan with a step that is not elementwise gets a quarter of it."""
    from shmrpc.kernels import _backend_cupy

    monkeypatch.setattr(_backend_cupy, "DIRECT_MAX_BYTES", 512)
    host = Pinned(cp)
    cases = [("scale", (64,), 1), ("scale", (65,), 0),  # 2 x 256 B moved: at the bound; 2 x 260 B: over it
             ("softmax", (1, 16), 1), ("softmax", (1, 17), 0)]  # 2 x 64 B: at a quarter; 2 x 68 B: over it
    for op, shape, direct in cases:
        x, o = host.view(0, shape, np.float32), host.view(8192, shape, np.float32)
        x[:] = np.arange(int(np.prod(shape))).reshape(shape) % 7
        plan = gpu.plan([StepSpec(op, {"x": "x"}, {"out": "o"}, {"a": 3.0} if op == "scale" else {})],
                        {"x": TensorSpec(shape, "float32")}, ["o"])
        before = gpu.direct_captures
        for _ in range(3):
            gpu.run(plan, {"x": x}, {"o": o})
        assert gpu.direct_captures - before == direct, (op, shape)
        f = x.astype(np.float64)
        want = 3 * f if op == "scale" else np.exp(f - f.max(-1, keepdims=True)) / np.exp(
            f - f.max(-1, keepdims=True)).sum(-1, keepdims=True)
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)
    assert gpu._graphs.captures == len(cases)


@pytest.mark.gpu
def test_a_graph_writes_only_its_requests_outputs(gpu: Any, cp: Any) -> None:
    plan = gpu.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0})], {"x": TensorSpec((16,), "float32")}, ["o"])
    host = Pinned(cp)
    x = host.view(0, (16,), np.float32)
    x[:] = np.arange(16)
    o1, o2 = host.view(4096, (16,), np.float32), host.view(8192, (16,), np.float32)
    for _ in range(4):
        gpu.run(plan, {"x": x}, {"o": o1})
    assert len(gpu._graphs) == 1
    np.testing.assert_array_equal(o1, 2 * np.arange(16, dtype=np.float32))
    o1[:] = -1  # the first graph's output, now not asked for
    x[:] = 5
    for _ in range(4):
        gpu.run(plan, {"x": x}, {"o": o2})  # other host addresses: another key, another graph
    assert len(gpu._graphs) == 2
    np.testing.assert_array_equal(o2, np.full(16, 10, np.float32))
    np.testing.assert_array_equal(o1, np.full(16, -1, np.float32))
    untouched = np.ones(host.raw.size, bool)
    for off in (0, 4096, 8192):
        untouched[off:off + 64] = False
    assert (host.raw[untouched] == 0xAB).all()


@pytest.mark.gpu
def test_a_replaced_resident_tensor_is_not_read_from_an_old_graph(gpu: Any, cp: Any) -> None:
    host = Pinned(cp)
    x, o = host.view(0, (32,), np.float32), host.view(4096, (32,), np.float32)
    x[:] = 1
    spec = gpu.put("y", np.full(32, 10, np.float32), "float32")
    plan = gpu.plan([StepSpec("vector_add", {"x": "x", "y": "y"}, {"out": "o"})], {"x": x_spec(32), "y": spec}, ["o"],
                    resident={"y": "y"})
    for _ in range(4):
        gpu.run(plan, {"x": x}, {"o": o})
    assert (o == 11).all() and len(gpu._graphs) == 1
    gpu.put("y", np.full(32, 20, np.float32), "float32")
    gpu.run(plan, {"x": x}, {"o": o})
    assert (o == 21).all()


def x_spec(n: int) -> TensorSpec:
    return TensorSpec((n,), "float32")


@pytest.mark.gpu
def test_graphs_are_dropped_on_reset_and_unregister(gpu: Any, cp: Any) -> None:
    host = Pinned(cp)
    x, o = host.view(0, (8,), np.float32), host.view(4096, (8,), np.float32)
    x[:] = 3
    plan = gpu.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0})], {"x": x_spec(8)}, ["o"])
    for _ in range(3):
        gpu.run(plan, {"x": x}, {"o": o})
    assert len(gpu._graphs) == 1
    gpu.inject_fault = "cuda_error"
    with pytest.raises(Exception, match="injected"):
        gpu.run(plan, {"x": x}, {"o": o})
    assert len(gpu._graphs) == 0
    for _ in range(3):
        gpu.run(plan, {"x": x}, {"o": o})
    assert len(gpu._graphs) == 1 and (o == 6).all()
    gpu.unregister_host()
    assert len(gpu._graphs) == 0


@pytest.mark.gpu
def test_pageable_views_and_a_failed_capture_take_the_plain_path(gpu: Any, cp: Any) -> None:
    """Pageable views are never captured; an op that synchronizes fails its capture once, then runs plain."""
    plan = gpu.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0})], {"x": x_spec(8)}, ["o"])
    x, o = np.ones(8, np.float32), np.empty(8, np.float32)
    for _ in range(4):
        assert "graph" not in gpu.run(plan, {"x": x}, {"o": o})
    assert (o == 2).all() and len(gpu._graphs) == 0

    from shmrpc.kernels import _registry

    orig = REGISTRY["gelu"]

    def syncing(call: Any) -> dict[str, Any]:
        float(call.inputs["x"].sum())  # a device-to-host read: not capturable
        assert orig.cupy is not None
        return orig.cupy(call)

    _registry.replace_impl("gelu", cupy=syncing)
    try:
        host = Pinned(cp)
        xp, op = host.view(0, (8,), np.float32), host.view(4096, (8,), np.float32)
        xp[:] = 1
        plan = gpu.plan([StepSpec("gelu", {"x": "x"}, {"out": "o"})], {"x": x_spec(8)}, ["o"])
        outs = []
        for _ in range(5):
            r = gpu.run(plan, {"x": xp}, {"o": op})
            outs.append(op.copy())
        assert id(plan) in gpu._graphs._failed and len(gpu._graphs) == 0 and "graph" not in r
        assert all((a == outs[0]).all() for a in outs) and abs(float(outs[0][0]) - 0.8412) < 1e-3
    finally:
        REGISTRY["gelu"] = orig


@pytest.mark.gpu
def test_small_runs_report_total_and_sampled_stage_timings(gpu: Any) -> None:
    from shmrpc.kernels import _backend_cupy

    plan = gpu.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0})], {"x": x_spec(8)}, ["o"])
    x, o = np.ones(8, np.float32), np.empty(8, np.float32)
    keys = [frozenset(gpu.run(plan, {"x": x}, {"o": o})) for _ in range(2 * _backend_cupy.STAGE_SAMPLE_EVERY)]
    assert keys.count(frozenset({"total"})) >= len(keys) - 3
    assert frozenset({"h2d", "kernel", "d2h", "total"}) in keys


@pytest.mark.gpu
@pytest.mark.parametrize("pipeline", ["streams", "stages"])
@pytest.mark.parametrize(("chunk", "first"), [(256 << 10, 256 << 10), (1 << 20, 1 << 20), (1 << 20, 64 << 10)])
def test_chunk_pipelines_in_place_and_out_of_place(gpu: Any, monkeypatch: pytest.MonkeyPatch, pipeline: str,
                                                   chunk: int, first: int) -> None:
    from shmrpc.kernels import _backend_cupy, _cuda_chunks

    monkeypatch.setattr(_backend_cupy, "CHUNK_THRESHOLD_BYTES", 1 << 20)
    monkeypatch.setattr(_cuda_chunks, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(_cuda_chunks, "CHUNK_PIPELINE", pipeline)
    monkeypatch.setattr(_cuda_chunks, "CHUNK_MIN_BYTES", first)
    n = (3 << 20) // 4 + 13  # ~3 MiB of float32, not a multiple of the chunk
    steps = [StepSpec("scale", {"x": "x"}, {"out": "t"}, {"a": 3.0}), StepSpec("vector_add", {"x": "t", "y": "y"}, {"out": "o"})]
    plan = gpu.plan(steps, {"x": x_spec(n), "y": x_spec(n)}, ["o"])
    x = np.arange(n, dtype=np.float32) % 1000
    y = np.full(n, 2.0, np.float32)
    want = 3 * x + 2
    o = np.empty(n, np.float32)
    times = gpu.run(plan, {"x": x, "y": y}, {"o": o})
    assert times["chunks"] == len(chunk_ranges(n, chunk // 4, first // 4)) and {"h2d", "kernel", "d2h"} <= set(times)
    np.testing.assert_array_equal(o, want)
    gpu.run(plan, {"x": x, "y": y}, {"o": x})  # output over input x
    np.testing.assert_array_equal(x, want)
