"""Backend.bind: a bound run over fixed views gives what run() gives, and still checks per call what can change."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmrpc.kernels import (
    REGISTRY,
    KernelInputError,
    KernelResourceError,
    KernelRuntimeError,
    StepSpec,
    TensorSpec,
    select_backend,
)
from shmrpc.kernels._backend_base import Backend, example_array
from shmrpc.kernels._dtypes import storage_dtype
from shmrpc.kernels._registry import unregister
from shmrpc.kernels.api import OpCall, OpSpec, register_op


@pytest.fixture
def be() -> Iterator[Any]:
    with select_backend("numpy", resident_limit_bytes=1 << 20) as b:
        yield b


@pytest.mark.parametrize("name", sorted(n for n, s in REGISTRY.items() if s.example and "numpy" in s.backends))
def test_a_bound_run_equals_run_for_every_op_on_its_example(be: Any, name: str) -> None:
    spec = REGISTRY[name]
    outs = {p: f"out_{p}" for p in spec.outputs}
    plan = be.plan([StepSpec(name, {p: p for p in spec.inputs}, outs, {})], dict(spec.example), list(outs.values()))
    rng = np.random.default_rng(3)
    host_in = {p: example_array(s, rng) for p, s in spec.example.items()}
    want = {n: np.zeros(s.shape, storage_dtype(s.dtype)) for n, s in plan.outputs.items()}
    got = {n: np.ones(s.shape, storage_dtype(s.dtype)) for n, s in plan.outputs.items()}
    be.run(plan, host_in, want)
    bound = be.bind(plan, host_in, got)
    stages = bound()
    assert set(stages) >= {"h2d", "kernel", "d2h", "total"}
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=f"{name} output {n}")
    for p, a in host_in.items():  # a second call over new contents gives the new result
        a[...] = example_array(spec.example[p], rng)
    be.run(plan, host_in, want)
    bound()
    for n in want:
        np.testing.assert_array_equal(got[n], want[n], err_msg=f"{name} output {n}, second run")


def test_an_in_place_bound_run_reads_what_the_last_run_wrote(be: Any) -> None:
    spec = TensorSpec((3, 4), "float32")
    plan = be.plan([StepSpec("vector_add", {"x": "x", "y": "y"}, {"out": "o"})], {"x": spec, "y": spec}, ["o"])
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.full((3, 4), 0.5, np.float32)
    start = x.copy()
    bound = be.bind(plan, {"x": x, "y": y}, {"o": x})  # the output view IS the input view
    bound()
    bound()
    np.testing.assert_array_equal(x, start + 1.0)
    y[...] = 2.0
    bound()
    np.testing.assert_array_equal(x, start + 3.0)


def test_a_bound_pipeline_with_an_output_over_an_input_still_read_later(be: Any) -> None:
    # o aliases x, but step 1 still reads x after step 0 produced o: o must be computed aside and copied last
    spec = TensorSpec((6,), "float64")
    steps = [StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0}), StepSpec("vector_add", {"x": "o", "y": "x"}, {"out": "p"})]
    plan = be.plan(steps, {"x": spec}, ["o", "p"])
    x = np.arange(1.0, 7.0)
    p = np.empty(6)
    bound = be.bind(plan, {"x": x}, {"o": x, "p": p})
    bound()
    np.testing.assert_array_equal(p, 3 * np.arange(1.0, 7.0))
    np.testing.assert_array_equal(x, 2 * np.arange(1.0, 7.0))
    bound()  # the views now hold the first run's outputs
    np.testing.assert_array_equal(p, 6 * np.arange(1.0, 7.0))
    np.testing.assert_array_equal(x, 4 * np.arange(1.0, 7.0))


def test_a_bound_step_after_an_intermediate_that_is_a_view_does_not_clobber_it(be: Any) -> None:
    # echo's intermediate h IS x; step 1 writes o over x while step 2 still reads h: o must go aside
    spec = TensorSpec((4,), "float32")
    steps = [StepSpec("echo", {"x": "x"}, {"out": "h"}), StepSpec("scale", {"x": "y"}, {"out": "o"}, {"a": 2.0}),
             StepSpec("vector_add", {"x": "h", "y": "y"}, {"out": "p"})]
    plan = be.plan(steps, {"x": spec, "y": spec}, ["o", "p"])
    x, y, p = np.arange(4, dtype=np.float32), np.full(4, 10.0, np.float32), np.empty(4, np.float32)
    bound = be.bind(plan, {"x": x, "y": y}, {"o": x, "p": p})
    bound()
    np.testing.assert_array_equal(p, np.arange(4) + 10.0)
    np.testing.assert_array_equal(x, 20.0)
    bound()
    np.testing.assert_array_equal(p, 30.0)


def test_a_bound_pipeline_with_intermediates_equals_run(be: Any) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 32)).astype(np.float32)
    w = rng.standard_normal((32, 16)).astype(np.float32)
    g, b = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    steps = [StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "h"}),
             StepSpec("layernorm_gelu", {"x": "h", "gamma": "g", "beta": "b"}, {"out": "a"}),
             StepSpec("softmax", {"x": "a"}, {"out": "y"})]
    ins = dict(x=x, w=w, g=g, b=b)
    plan = be.plan(steps, {n: TensorSpec(a.shape, "float32") for n, a in ins.items()}, ["h", "y"])
    want = {"h": np.empty((5, 16), np.float32), "y": np.empty((5, 16), np.float32)}
    got = {"h": np.empty((5, 16), np.float32), "y": np.empty((5, 16), np.float32)}
    bound = be.bind(plan, ins, got)
    for _ in range(2):
        be.run(plan, ins, want)
        bound()
        for n in want:
            np.testing.assert_array_equal(got[n], want[n])
        x[...] = rng.standard_normal((5, 32))


def test_a_bound_run_uses_the_resident_tensor_of_the_time_and_fails_once_it_is_dropped(be: Any) -> None:
    spec = TensorSpec((4,), "float32")
    be.put("W", np.full(4, 1.0, np.float32), "float32")
    plan = be.plan([StepSpec("vector_add", {"x": "x", "y": "w"}, {"out": "o"})], {"x": spec, "w": spec}, ["o"],
                   resident={"w": "W"})
    x, o = np.arange(4, dtype=np.float32), np.empty(4, np.float32)
    bound = be.bind(plan, {"x": x}, {"o": o})
    bound()
    np.testing.assert_array_equal(o, x + 1.0)
    be.put("W", np.full(4, 10.0, np.float32), "float32")  # replaced between two runs
    bound()
    np.testing.assert_array_equal(o, x + 10.0)
    be.drop("W")
    with pytest.raises(KernelInputError) as run_err:
        be.run(plan, {"x": x}, {"o": o})
    with pytest.raises(KernelInputError) as bound_err:
        bound()
    assert (bound_err.value.tensor, bound_err.value.field) == ("w", "resident") == \
        (run_err.value.tensor, run_err.value.field)


def test_a_bound_run_keeps_outputs_as_resident_each_time(be: Any) -> None:
    spec = TensorSpec((4,), "float32")
    plan = be.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0})], {"x": spec}, [], keep=["o"])
    x = np.ones(4, np.float32)
    bound = be.bind(plan, {"x": x}, {}, keep_as={"o": "K"})
    bound()
    x[...] = 3.0
    bound()
    assert be.resident()["K"] == spec
    got = np.empty(4, np.float32)
    echo = be.plan([StepSpec("scale", {"x": "k"}, {"out": "y"}, {"a": 1.0})], {"k": spec}, ["y"], resident={"k": "K"})
    be.run(echo, {}, {"y": got})
    np.testing.assert_array_equal(got, np.full(4, 6.0, np.float32))


def test_an_injected_fault_fails_the_next_bound_run_once(be: Any) -> None:
    spec = TensorSpec((4,), "float32")
    plan = be.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0})], {"x": spec}, ["o"])
    x, o = np.ones(4, np.float32), np.zeros(4, np.float32)
    bound = be.bind(plan, {"x": x}, {"o": o})
    be.inject_fault = "cuda_error"
    with pytest.raises(KernelRuntimeError) as ei:
        bound()
    assert (ei.value.op, ei.value.step) == ("scale", 0)
    np.testing.assert_array_equal(o, 0.0)
    bound()
    np.testing.assert_array_equal(o, 2.0)


def test_bad_views_give_a_bound_run_raising_what_run_raises(be: Any) -> None:
    spec = TensorSpec((4,), "float32")
    plan = be.plan([StepSpec("scale", {"x": "x"}, {"out": "o"})], {"x": spec}, ["o"])
    for ins, outs, where in (({}, {"o": np.empty(4, np.float32)}, ("x", "inputs")),
                             ({"x": np.ones(5, np.float32)}, {"o": np.empty(4, np.float32)}, ("x", "shape")),
                             ({"x": np.ones(4, np.float32)}, {"o": np.empty(4, np.float64)}, ("o", "dtype"))):
        bound = be.bind(plan, ins, outs)
        for _ in range(2):
            with pytest.raises(KernelInputError) as ei:
                bound()
            assert (ei.value.tensor, ei.value.field) == where


def _same(inputs: Any, attrs: Any) -> dict[str, TensorSpec]:
    return {"out": inputs["x"]}


def test_what_a_users_op_returns_is_checked_on_every_bound_run() -> None:
    calls: list[int] = []

    def flaky(call: OpCall) -> dict[str, Any]:
        calls.append(1)
        shape = call.inputs["x"].shape if len(calls) == 1 else (1,)  # right the first time, wrong the second
        return {"out": np.zeros(shape, np.float32)}

    register_op(OpSpec("t_bind_flaky", inputs=("x",), outputs=("out",), infer=_same, numpy=flaky,
                       tolerances={"float32": (0.0, 0.0)}))
    try:
        with select_backend("numpy") as b:
            plan = b.plan([StepSpec("t_bind_flaky", {"x": "x"}, {"out": "y"})], {"x": TensorSpec((2, 3), "float32")}, ["y"])
            bound = b.bind(plan, {"x": np.ones((2, 3), np.float32)}, {"y": np.ones((2, 3), np.float32)})
            bound()
            with pytest.raises(KernelRuntimeError, match=r"shape rule says \(2, 3\)") as ei:
                bound()
            assert (ei.value.op, ei.value.step, ei.value.tensor, ei.value.field) == ("t_bind_flaky", 0, "out", "shape")
    finally:
        unregister("t_bind_flaky")


def test_a_bound_run_whose_op_returns_its_destination_skips_no_check_of_anything_else() -> None:
    # the result check is skipped only for the very views the bind checked; any other array is checked
    turn: list[int] = []

    def into_dest_then_wrong_dtype(call: OpCall) -> dict[str, Any]:
        turn.append(1)
        d = call.dest("out")
        if len(turn) == 1 and d is not None:
            np.multiply(call.inputs["x"], 2, out=d)
            return {"out": d}
        return {"out": np.zeros(call.inputs["x"].shape, np.float64)}

    register_op(OpSpec("t_bind_dest", inputs=("x",), outputs=("out",), infer=_same, numpy=into_dest_then_wrong_dtype,
                       tolerances={"float32": (0.0, 0.0)}))
    try:
        with select_backend("numpy") as b:
            plan = b.plan([StepSpec("t_bind_dest", {"x": "x"}, {"out": "y"})], {"x": TensorSpec((2, 3), "float32")}, ["y"])
            y = np.zeros((2, 3), np.float32)
            bound = b.bind(plan, {"x": np.ones((2, 3), np.float32)}, {"y": y})
            bound()
            np.testing.assert_array_equal(y, 2.0)
            with pytest.raises(KernelRuntimeError, match="shape rule says float32") as ei:
                bound()
            assert (ei.value.op, ei.value.tensor, ei.value.field) == ("t_bind_dest", "out", "dtype")
    finally:
        unregister("t_bind_dest")


def test_the_default_bind_calls_run_each_time() -> None:
    seen: list[Any] = []

    class Recording(Backend):
        name = "recording"

        def run(self, plan: Any, inputs: Any, outputs: Any, keep_as: Any = None) -> dict[str, float]:
            seen.append((plan, inputs, outputs, keep_as))
            return {"total": 0.0}

    rb = Recording()
    bound = rb.bind("plan", {"x": 1}, {"y": 2}, keep_as={"y": "Y"})  # type: ignore[arg-type]
    assert seen == []
    assert bound() == {"total": 0.0} and bound() == {"total": 0.0}
    assert seen == [("plan", {"x": 1}, {"y": 2}, {"y": "Y"})] * 2


def test_a_bound_run_copies_a_result_that_is_not_its_destination_and_maps_an_ops_failure() -> None:
    turn: list[int] = []

    def fresh_then_fail(call: OpCall) -> dict[str, Any]:
        turn.append(1)
        assert call.workspace == {} and call.dest("out") is not None
        call.workspace["mine"] = 1  # a workspace of this call only: the next starts empty
        if len(turn) == 1:
            return {"out": call.inputs["x"] * 3}  # right shape and dtype, another array: copied into the view
        if len(turn) == 2:
            raise MemoryError("no room")
        raise ValueError("bad value")

    register_op(OpSpec("t_bind_fresh", inputs=("x",), outputs=("out",), infer=_same, numpy=fresh_then_fail,
                       tolerances={"float32": (0.0, 0.0)}))
    try:
        with select_backend("numpy") as b:
            plan = b.plan([StepSpec("t_bind_fresh", {"x": "x"}, {"out": "y"})], {"x": TensorSpec((2, 3), "float32")}, ["y"])
            y = np.zeros((2, 3), np.float32)
            bound = b.bind(plan, {"x": np.ones((2, 3), np.float32)}, {"y": y})
            bound()
            np.testing.assert_array_equal(y, 3.0)
            with pytest.raises(KernelResourceError, match="out of host memory") as res_err:
                bound()
            with pytest.raises(KernelRuntimeError, match="ValueError: bad value") as run_err:
                bound()
            for ei in (res_err, run_err):
                assert (ei.value.op, ei.value.step) == ("t_bind_fresh", 0)
            assert isinstance(run_err.value.__cause__, ValueError)
    finally:
        unregister("t_bind_fresh")


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "bfloat16"])
@pytest.mark.parametrize("op", ["echo", "vector_add", "scale"])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_bound_form_gives_the_bits_of_the_implementation(be: Any, op: str, dtype: str, in_place: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the built-in ops' bound forms (NUMPY_BOUND) against run(), bit for bit, and used wherever they apply
    from shmrpc.kernels import _registry

    if op == "scale" and dtype == "int32":
        pytest.skip("scale takes float dtypes only")
    made: list[Any] = []
    for impl, maker in list(_registry.NUMPY_BOUND.items()):
        monkeypatch.setitem(_registry.NUMPY_BOUND, impl, lambda *a, _m=maker: made.append(_m(*a)) or made[-1])
    spec = TensorSpec((3, 5), dtype)
    names = ("x", "y") if op == "vector_add" else ("x",)
    attrs = {"a": -1.75, "b": 0.5} if op == "scale" else {}
    plan = be.plan([StepSpec(op, {n: n for n in names}, {"out": "o"}, attrs)], {n: spec for n in names}, ["o"])
    rng = np.random.default_rng(5)
    ins = {n: example_array(spec, rng) for n in names}
    want = np.zeros(spec.shape, storage_dtype(dtype))
    be.run(plan, {n: a.copy() for n, a in ins.items()}, {"o": want})
    out = ins["x"] if in_place else np.ones(spec.shape, storage_dtype(dtype))
    bound = be.bind(plan, ins, {"o": out})
    bound()
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
    if in_place and op == "echo":
        assert made == [None]  # out is x: nothing to do, the implementation's own path says so
    elif op != "echo" and (dtype == "bfloat16" or (op == "scale" and dtype == "float16")):
        assert made == [None]  # computed in float32 and rounded: the implementation runs
    else:
        assert len(made) == 1 and made[0] is not None
