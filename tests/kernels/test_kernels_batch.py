"""Backend.run_batch: B requests of one plan in one call equal B runs, on NumPy always and on
CuPy under the gpu marker; a failing or malformed request fails alone; plans that may not
batch run request by request."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmrpc.kernels import REGISTRY, KernelInputError, KernelRuntimeError, StepSpec, TensorSpec, select_backend
from shmrpc.kernels._batch import batch_plan, batchable
from shmrpc.kernels._registry import unregister
from shmrpc.kernels.api import OpCall, OpSpec, register_op, require_float


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def be(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A backend whose run_batch runs batchable plans jointly (NumPy's joint path is opt-in)."""
    from shmrpc.kernels import _backend_numpy

    monkeypatch.setattr(_backend_numpy, "BATCH_JOINT", True)
    if request.param == "cupy":
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() < 1:
                raise RuntimeError("no CUDA device")
        except Exception as e:
            pytest.skip(f"no CuPy/GPU: {type(e).__name__}: {e}")
    with select_backend(request.param) as b:
        yield b


def _storage(dt: str) -> Any:
    return np.uint16 if dt == "bfloat16" else np.dtype(dt)


def _rand(rng: np.random.Generator, spec: TensorSpec) -> np.ndarray:
    f = (rng.standard_normal(spec.shape) * 0.5).astype(np.float32)
    if spec.dtype == "bfloat16":
        return (f.view(np.uint32) >> 16).astype(np.uint16)
    return f.astype(spec.dtype)


def _as_f64(a: np.ndarray, dt: str) -> np.ndarray:
    if dt == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def _items(plan: Any, n: int, seed: int) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ins = {k: _rand(rng, s) for k, s in plan.inputs.items() if k not in plan.resident}
        outs = {k: np.full(s.shape, 0x7E, _storage(s.dtype)) for k, s in plan.outputs.items()}
        out.append((ins, outs))
    return out


# (name, steps, input specs, outputs, resident {request name: spec} put before planning)
_F16, _BF16, _F32 = "float16", "bfloat16", "float32"
CASES: list[tuple[str, list[StepSpec], dict[str, TensorSpec], list[str], dict[str, TensorSpec]]] = [
    ("gemm, w per request", [StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "o"})],
     {"x": TensorSpec((16, 64), _F16), "w": TensorSpec((64, 32), _F16)}, ["o"], {}),
    ("gemm, resident w", [StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "o"})],
     {"x": TensorSpec((8, 64), _F32)}, ["o"], {"w": TensorSpec((64, 48), _F32)}),
    ("gemm_bias bf16, bias per request", [StepSpec("gemm_bias", {"x": "x", "w": "w", "bias": "b"}, {"out": "o"})],
     {"x": TensorSpec((4, 32), _BF16), "w": TensorSpec((32, 16), _BF16), "b": TensorSpec((16,), _BF16)}, ["o"], {}),
    ("layernorm, gamma/beta per request", [StepSpec("layernorm", {"x": "x", "gamma": "g", "beta": "b"}, {"out": "o"})],
     {"x": TensorSpec((3, 128), _F32), "g": TensorSpec((128,), _F32), "b": TensorSpec((128,), _F32)}, ["o"], {}),
    ("layernorm_gelu f16, resident gamma/beta", [StepSpec("layernorm_gelu", {"x": "x", "gamma": "g", "beta": "b"}, {"out": "o"})],
     {"x": TensorSpec((5, 256), _F16)}, ["o"], {"g": TensorSpec((256,), _F16), "b": TensorSpec((256,), _F16)}),
    ("softmax f16", [StepSpec("softmax", {"x": "x"}, {"out": "o"})], {"x": TensorSpec((6, 100), _F16)}, ["o"], {}),
    ("gemm -> layernorm_gelu -> softmax, two outputs",
     [StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "h"}),
      StepSpec("layernorm_gelu", {"x": "h", "gamma": "g", "beta": "b"}, {"out": "a"}),
      StepSpec("softmax", {"x": "a"}, {"out": "p"})],
     {"x": TensorSpec((4, 64), _F16), "g": TensorSpec((32,), _F16), "b": TensorSpec((32,), _F16)}, ["h", "p"],
     {"w": TensorSpec((64, 32), _F16)}),
]


def _plan(be: Any, steps: list[StepSpec], specs: dict[str, TensorSpec], outs: list[str],
          resident: dict[str, TensorSpec], seed: int = 1) -> Any:
    rng = np.random.default_rng(seed)
    names = {}
    for k, s in resident.items():
        names[k] = f"r_{k}"
        specs = {**specs, k: be.put(names[k], _rand(rng, s), s.dtype)}
    return be.plan(steps, specs, outs, resident=names)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("size", [2, 5])
def test_run_batch_equals_one_run_per_request(be: Any, case: Any, size: int) -> None:
    _, steps, specs, outs, resident = case
    plan = _plan(be, steps, specs, outs, resident)
    assert batchable(plan)
    items = _items(plan, size, seed=size)
    res = be.run_batch(plan, items)
    assert [r.get("batch") if isinstance(r, dict) else r for r in res] == [float(size)] * size  # one joint run
    for ins, got in items:
        want = {k: np.empty_like(v) for k, v in got.items()}
        be.run(plan, ins, want)
        for k, spec in plan.outputs.items():
            op = next(st.op for st in plan.steps if k in st.outputs.values())
            rtol, atol = op.tolerances[spec.dtype]
            np.testing.assert_allclose(_as_f64(got[k], spec.dtype), _as_f64(want[k], spec.dtype), rtol=rtol, atol=atol,
                                       err_msg=f"output {k!r}")


def test_batch_plan_marks_what_carries_the_request_axis() -> None:
    be = select_backend("numpy")
    w = be.put("w", np.ones((8, 4), np.float32), "float32")
    g = TensorSpec((4,), "float32")
    plan = be.plan([StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "h"}),
                    StepSpec("layernorm", {"x": "h", "gamma": "g", "beta": "g"}, {"out": "o"})],
                   {"x": TensorSpec((2, 8), "float32"), "w": w, "g": g}, ["o"], resident={"w": "w"})
    bp = batch_plan(plan, 3)
    assert bp.batched == {"x", "g", "h", "o"}
    assert bp.steps[0][0]["x"].shape == (3, 2, 8) and bp.steps[0][0]["w"].shape == (8, 4)
    assert bp.steps[1][1]["out"].shape == (3, 2, 4)


@pytest.fixture
def failing_op() -> Iterator[str]:
    """An op declared batch-safe that raises on a request holding the marker -7 (its twin on CuPy too)."""

    def infer(inputs: Any, attrs: Any) -> dict[str, TensorSpec]:
        require_float(inputs["x"], "x")
        return {"out": inputs["x"]}

    def impl(call: OpCall) -> dict[str, Any]:
        x = call.inputs["x"]
        if bool((x == -7).any()):
            raise ValueError("the input holds the marker -7")
        return {"out": x * 2}

    register_op(OpSpec("t_batch_fail", inputs=("x",), outputs=("out",), infer=infer, numpy=impl, cupy=impl,
                       tolerances={"float32": (0.0, 0.0)}, example={"x": TensorSpec((4,), "float32")}, batch=True))
    yield "t_batch_fail"
    if "t_batch_fail" in REGISTRY:
        unregister("t_batch_fail")


def test_a_failing_request_fails_alone(be: Any, failing_op: str) -> None:
    plan = be.plan([StepSpec(failing_op, {"x": "x"}, {"out": "o"})], {"x": TensorSpec((4,), "float32")}, ["o"])
    assert batchable(plan)
    items = [({"x": np.full(4, i, np.float32)}, {"o": np.zeros(4, np.float32)}) for i in range(4)]
    items[2][0]["x"][1] = -7
    res = be.run_batch(plan, items)
    assert isinstance(res[2], KernelRuntimeError) and (res[2].op, res[2].step) == (failing_op, 0)
    assert "-7" in str(res[2])
    for i in (0, 1, 3):
        assert isinstance(res[i], dict) and "batch" not in res[i]  # run alone, after the joint run failed
        np.testing.assert_array_equal(items[i][1]["o"], np.full(4, 2 * i, np.float32))


def test_a_malformed_request_fails_alone_naming_the_field(be: Any) -> None:
    plan = be.plan([StepSpec("softmax", {"x": "x"}, {"out": "o"})], {"x": TensorSpec((2, 8), "float32")}, ["o"])
    items = _items(plan, 3, seed=3)
    items[1] = ({"x": np.zeros((2, 7), np.float32)}, items[1][1])
    res = be.run_batch(plan, items)
    assert isinstance(res[1], KernelInputError) and (res[1].tensor, res[1].field) == ("x", "shape")
    assert isinstance(res[0], dict) and isinstance(res[2], dict)
    for i in (0, 2):
        x = items[i][0]["x"].astype(np.float64)
        e = np.exp(x - x.max(-1, keepdims=True))
        np.testing.assert_allclose(items[i][1]["o"], e / e.sum(-1, keepdims=True), rtol=2e-5, atol=2e-5)


def test_plans_that_may_not_batch_run_request_by_request(be: Any) -> None:
    """scale is not declared batch-safe here (its module is another's), and a plan that keeps a tensor never batches."""
    spec = TensorSpec((4, 8), "float32")
    plans = [be.plan([StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "o"})], {"x": spec, "w": TensorSpec((8, 8), "float32")},
                     ["o"], keep=["o"])]
    if not REGISTRY["scale"].batch:
        plans.append(be.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 3.0})], {"x": spec}, ["o"]))
    for plan in plans:
        assert not batchable(plan)
        items = _items(plan, 3, seed=4)
        res = be.run_batch(plan, items)
        assert all(isinstance(r, dict) and "batch" not in r for r in res)


def test_numpy_runs_request_by_request_unless_asked() -> None:
    from shmrpc.kernels import _backend_numpy

    assert _backend_numpy.BATCH_JOINT is False  # measured no faster (bench/gpu/tiny_probe.py --batch)
    be = select_backend("numpy")
    plan = be.plan([StepSpec("softmax", {"x": "x"}, {"out": "o"})], {"x": TensorSpec((2, 8), "float32")}, ["o"])
    res = be.run_batch(plan, _items(plan, 3, seed=5))
    assert all(isinstance(r, dict) and "batch" not in r for r in res)
