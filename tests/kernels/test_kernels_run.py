"""run() on the NumPy backend: in place, pipelines, zero-copy writes, residents, keep, threads, faults."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from shmrpc.kernels import (
    KernelInputError,
    KernelResourceError,
    KernelRuntimeError,
    StepSpec,
    TensorSpec,
    select_backend,
)

sys.path.insert(0, str(Path(__file__).parent))
from kernel_cases import check_quant, dequant_ref, nonzero, to_f64  # noqa: E402


@pytest.fixture
def be():
    with select_backend("numpy", resident_limit_bytes=1 << 20) as b:
        yield b


def test_vector_add_in_place(be) -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.full((3, 4), 0.5, np.float32)
    spec = TensorSpec((3, 4), "float32")
    plan = be.plan([StepSpec("vector_add", {"x": "x", "y": "y"}, {"out": "o"})], {"x": spec, "y": spec}, ["o"])
    want = x + y
    be.run(plan, {"x": x, "y": y}, {"o": x})  # the output view IS the input view
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32", "float64"])
def test_scale_in_place(be, dt) -> None:
    rng = np.random.default_rng(0)
    f = nonzero(rng, (64,))
    x = (np.asarray(f, np.float32).view(np.uint32) >> 16).astype(np.uint16) if dt == "bfloat16" else f.astype(dt)
    ref = 3.0 * to_f64(x, dt) - 1.0
    plan = be.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 3.0, "b": -1.0})], {"x": TensorSpec((64,), dt)}, ["o"])
    be.run(plan, {"x": x}, {"o": x})
    tol = 1.6e-2 if dt == "bfloat16" else 2e-3
    np.testing.assert_allclose(to_f64(x, dt), ref, rtol=tol, atol=tol)


def test_output_written_in_place_without_copy(be, monkeypatch) -> None:
    spec = TensorSpec((8,), "float32")
    plan = be.plan([StepSpec("vector_add", {"x": "a", "y": "b"}, {"out": "o"})], {"a": spec, "b": spec}, ["o"])
    copies = []
    real = np.copyto
    monkeypatch.setattr(np, "copyto", lambda *a, **k: (copies.append(1), real(*a, **k)))
    out = np.zeros(8, np.float32)
    be.run(plan, {"a": np.ones(8, np.float32), "b": np.ones(8, np.float32)}, {"o": out})
    assert not copies and (out == 2).all()


def test_in_place_output_still_read_later_is_not_clobbered(be) -> None:
    # o aliases x, but step 1 still reads x after step 0 produced o: o must be computed aside and copied last
    spec = TensorSpec((6,), "float64")
    steps = [StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0}), StepSpec("vector_add", {"x": "o", "y": "x"}, {"out": "p"})]
    plan = be.plan(steps, {"x": spec}, ["o", "p"])
    x = np.arange(1.0, 7.0)
    p = np.empty(6)
    be.run(plan, {"x": x}, {"o": x, "p": p})
    np.testing.assert_array_equal(p, 3 * np.arange(1.0, 7.0))
    np.testing.assert_array_equal(x, 2 * np.arange(1.0, 7.0))


def test_pipeline_gemm_layernorm_gelu_softmax(be) -> None:
    rng = np.random.default_rng(1)
    x = nonzero(rng, (5, 32), 0.2).astype(np.float32)
    w = nonzero(rng, (32, 16)).astype(np.float32)
    g, b = nonzero(rng, (16,)).astype(np.float32), nonzero(rng, (16,), 0.1).astype(np.float32)
    steps = [StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "h"}),
             StepSpec("layernorm_gelu", {"x": "h", "gamma": "g", "beta": "b"}, {"out": "a"}),
             StepSpec("softmax", {"x": "a"}, {"out": "y"})]
    specs = {n: TensorSpec(a.shape, "float32") for n, a in dict(x=x, w=w, g=g, b=b).items()}
    plan = be.plan(steps, specs, ["y"])
    y = np.empty((5, 16), np.float32)
    times = be.run(plan, {"x": x, "w": w, "g": g, "b": b}, {"y": y})
    assert set(times) >= {"h2d", "kernel", "d2h"} and times["h2d"] == 0.0
    h = x.astype(np.float64) @ w
    n = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5) * g + b
    a = 0.5 * n * (1 + np.tanh(np.sqrt(2 / np.pi) * (n + 0.044715 * n**3)))
    e = np.exp(a - a.max(-1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(-1, keepdims=True), rtol=2e-5, atol=2e-6)


def test_run_checks_views(be) -> None:
    spec = TensorSpec((4,), "float32")
    plan = be.plan([StepSpec("scale", {"x": "x"}, {"out": "o"})], {"x": spec}, ["o"])
    with pytest.raises(KernelInputError) as ei:
        be.run(plan, {}, {"o": np.empty(4, np.float32)})
    assert (ei.value.tensor, ei.value.field) == ("x", "inputs")
    with pytest.raises(KernelInputError) as ei:
        be.run(plan, {"x": np.ones(5, np.float32)}, {"o": np.empty(4, np.float32)})
    assert (ei.value.tensor, ei.value.field) == ("x", "shape")
    with pytest.raises(KernelInputError) as ei:
        be.run(plan, {"x": np.ones(4, np.float32)}, {"o": np.empty(4, np.float64)})
    assert (ei.value.tensor, ei.value.field) == ("o", "dtype")


def test_resident_put_use_drop_limit(be) -> None:
    w = np.full((4, 4), 2.0, np.float32)
    spec = be.put("W", w, "float32")
    w[:] = 0  # put copied: later writes to the slot do not reach the resident tensor
    assert be.resident() == {"W": spec} and be.resident_bytes == 64
    steps = [StepSpec("gemm", {"x": "x", "w": "weights"}, {"out": "o"})]
    plan = be.plan(steps, {"x": TensorSpec((1, 4), "float32"), "weights": spec}, ["o"], resident={"weights": "W"})
    o = np.empty((1, 4), np.float32)
    be.run(plan, {"x": np.ones((1, 4), np.float32)}, {"o": o})
    assert (o == 8).all()
    with pytest.raises(KernelResourceError) as ei:
        be.put("big", np.zeros(1 << 18, np.float32), "float32")  # 1 MiB + 64 B > 1 MiB
    assert (ei.value.tensor, ei.value.field) == ("big", "resident_limit")
    assert be.resident_bytes == 64
    be.put("W", np.ones((2, 2), np.float32), "float32")  # replacing frees the old bytes
    assert be.resident_bytes == 16
    with pytest.raises(KernelInputError) as ei:  # the plan was made for the (4, 4) tensor
        be.run(plan, {"x": np.ones((1, 4), np.float32)}, {"o": o})
    assert ei.value.field == "resident"
    be.drop("W")
    assert be.resident() == {} and be.resident_bytes == 0
    with pytest.raises(KernelInputError) as ei:
        be.run(plan, {"x": np.ones((1, 4), np.float32)}, {"o": o})
    assert (ei.value.tensor, ei.value.field) == ("weights", "resident")
    with pytest.raises(KernelInputError):
        be.drop("W")
    with pytest.raises(KernelInputError) as ei:
        be.put("x", np.zeros(3, np.float64), "float32")
    assert ei.value.field == "dtype"


def test_keep_stores_outputs_as_resident(be) -> None:
    rng = np.random.default_rng(2)
    w = nonzero(rng, (256, 32)).astype(np.float16)
    steps = [StepSpec("quantize_int4", {"w": "w"}, {"qweight": "q", "scales": "s", "zeros": "z"})]
    plan = be.plan(steps, {"w": TensorSpec(w.shape, "float16")}, [], keep=["q", "s", "z"])
    be.run(plan, {"w": w}, {}, keep_as={"q": "L0.q", "s": "L0.s", "z": "L0.z"})
    res = be.resident()
    assert set(res) == {"L0.q", "L0.s", "L0.z"} and res["L0.q"] == TensorSpec((128, 32), "uint8")
    x = nonzero(rng, (1, 256), 1 / 16).astype(np.float16)
    steps = [StepSpec("gemm_w4a16", {"x": "x", "qweight": "q", "scales": "s", "zeros": "z"}, {"out": "o"})]
    plan = be.plan(steps, {"x": TensorSpec((1, 256), "float16"), "q": res["L0.q"], "s": res["L0.s"], "z": res["L0.z"]},
                   ["o"], resident={"q": "L0.q", "s": "L0.s", "z": "L0.z"})
    o = np.empty((1, 32), np.float16)
    be.run(plan, {"x": x}, {"o": o})
    np.testing.assert_allclose(o.astype(np.float64), x.astype(np.float64) @ w.astype(np.float64), rtol=0.1, atol=0.1)


def test_quantize_round_trip_and_w4a16_vs_dequantized(be) -> None:
    rng = np.random.default_rng(3)
    w = nonzero(rng, (512, 64)).astype(np.float32)
    steps = [StepSpec("quantize_int4", {"w": "w"}, {"qweight": "q", "scales": "s", "zeros": "z"}),
             StepSpec("gemm_w4a16", {"x": "x", "qweight": "q", "scales": "s", "zeros": "z"}, {"out": "o"})]
    x = nonzero(rng, (4, 512), 1 / 22).astype(np.float16)
    plan = be.plan(steps, {"w": TensorSpec(w.shape, "float32"), "x": TensorSpec(x.shape, "float16")}, ["q", "s", "z", "o"])
    outs = {"q": np.empty((256, 64), np.uint8), "s": np.empty((4, 64), np.float16), "z": np.empty((4, 64), np.float16),
            "o": np.empty((4, 64), np.float16)}
    be.run(plan, {"w": w, "x": x}, outs)
    check_quant({"w": w}, {"qweight": outs["q"], "scales": outs["s"], "zeros": outs["z"]}, {"group_size": 128}, "float32")
    ref = x.astype(np.float64) @ dequant_ref(outs["q"], outs["s"], outs["z"])
    np.testing.assert_allclose(outs["o"].astype(np.float64), ref, rtol=4e-3, atol=4e-3)
    # int4 with 15 levels over each group's range: the product moves by ~6% (Frobenius) from the exact one
    exact = x.astype(np.float64) @ w
    assert np.linalg.norm(ref - exact) / np.linalg.norm(exact) < 0.1


def test_concurrent_runs_are_independent(be) -> None:
    spec = TensorSpec((1000,), "float32")
    plan = be.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0})], {"x": spec}, ["o"])
    errors = []

    def worker(i: int) -> None:
        try:
            for _ in range(50):
                x = np.full(1000, float(i), np.float32)
                o = np.empty(1000, np.float32)
                be.run(plan, {"x": x}, {"o": o})
                assert (o == 2 * i).all()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors


def test_fault_injection_raises_once(be) -> None:
    spec = TensorSpec((4,), "float32")
    plan = be.plan([StepSpec("scale", {"x": "x"}, {"out": "o"})], {"x": spec}, ["o"])
    be.inject_fault = "cuda_error"
    with pytest.raises(KernelRuntimeError) as ei:
        be.run(plan, {"x": np.ones(4, np.float32)}, {"o": np.empty(4, np.float32)})
    assert (ei.value.op, ei.value.step) == ("scale", 0)
    be.run(plan, {"x": np.ones(4, np.float32)}, {"o": np.empty(4, np.float32)})


def test_op_failure_is_wrapped(be, monkeypatch) -> None:
    from shmrpc.kernels import REGISTRY
    from shmrpc.kernels._registry import replace_impl

    orig = REGISTRY["gelu"]

    def boom(call):
        raise ZeroDivisionError("boom")

    replace_impl("gelu", numpy=boom)
    try:
        steps = [StepSpec("scale", {"x": "x"}, {"out": "t"}), StepSpec("gelu", {"x": "t"}, {"out": "o"})]
        plan = be.plan(steps, {"x": TensorSpec((4,), "float32")}, ["o"])
        with pytest.raises(KernelRuntimeError) as ei:
            be.run(plan, {"x": np.ones(4, np.float32)}, {"o": np.empty(4, np.float32)})
        assert (ei.value.op, ei.value.step) == ("gelu", 1) and isinstance(ei.value.__cause__, ZeroDivisionError)
    finally:
        REGISTRY["gelu"] = orig


def test_echo_alias_copies_only_into_a_distinct_view(be) -> None:
    spec = TensorSpec((3,), "int32")
    plan = be.plan([StepSpec("echo", {"x": "x"}, {"out": "o"})], {"x": spec}, ["o"])
    assert plan.alias_only
    x = np.array([1, 2, 3], np.int32)
    o = np.zeros(3, np.int32)
    be.run(plan, {"x": x}, {"o": o})
    assert o.tolist() == [1, 2, 3]
    be.run(plan, {"x": x}, {"o": x})
    assert x.tolist() == [1, 2, 3]


def test_select_backend() -> None:
    assert select_backend("auto").name in ("numpy", "cupy")
    with pytest.raises(ValueError):
        select_backend("tpu")


def test_import_pulls_in_no_wire_or_gpu_modules() -> None:
    code = ("import sys, shmrpc.kernels\n"
            "bad = [m for m in ('cupy', 'flatbuffers', 'zmq', 'shmrpc.schema', 'shmrpc.server', 'shmrpc.client') if m in sys.modules]\n"
            "print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_resident_tensors_are_counted_one_per_64_kib_of_the_limit() -> None:
    # tiny tensors cost bookkeeping whatever their bytes: a 128 MiB limit keeps at most 2048 of them (a smaller one
    # 1024)
    from shmrpc.kernels._backend_base import RESIDENT_MIN_COUNT

    for limit, most in ((128 << 20, 2048), (1 << 20, RESIDENT_MIN_COUNT)):
        with select_backend("numpy", resident_limit_bytes=limit) as b:
            for i in range(most):
                b.put(f"t{i}", np.zeros(1, np.float32), "float32")
            with pytest.raises(KernelResourceError) as ei:
                b.put("extra", np.zeros(1, np.float32), "float32")
            assert (ei.value.tensor, ei.value.field) == ("extra", "resident_limit") and "one per 64 KiB" in str(ei.value)
            b.put("t3", np.zeros(2, np.float32), "float32")  # replacing one is not one more
            plan = b.plan([StepSpec("echo", {"x": "x"}, {"out": "o"})], {"x": TensorSpec((1,), "float32")}, [],
                          keep=["o"])
            with pytest.raises(KernelResourceError):  # nor may a request keep one more
                b.run(plan, {"x": np.ones(1, np.float32)}, {}, keep_as={"o": "kept"})
            b.drop("t0")
            b.run(plan, {"x": np.ones(1, np.float32)}, {}, keep_as={"o": "kept"})
            assert len(b.resident()) == most and b.resident_bytes == (most - 2) * 4 + 8 + 4


@pytest.mark.parametrize("dt", ["float16", "float32", "float64"])
def test_gelu_of_a_0d_input_is_a_0d_output(be, dt: str) -> None:
    # `f * f` of a 0-d array is a NumPy scalar, which the op's in-place steps refused ("return arrays must be of
    # ArrayType"): a 0-d input failed on the worker while the docs keep 0-d arrays 0-d
    for shape in ((), (0,), (3,)):
        spec = TensorSpec(shape, dt)
        plan = be.plan([StepSpec("gelu", {"x": "x"}, {"out": "o"})], {"x": spec}, ["o"])
        x = np.full(shape, 1.5, dt)
        o = np.empty(shape, dt)
        be.run(plan, {"x": x}, {"o": o})
        f = x.astype(np.float64)
        ref = 0.5 * f * (1 + np.tanh(np.sqrt(2 / np.pi) * (f + 0.044715 * f**3)))
        np.testing.assert_allclose(o, ref, rtol=1e-3 if dt == "float16" else 1e-6)
