"""Cost estimates from a plan: FLOPs per step, bytes of intermediates and outputs, the memory limit."""

from __future__ import annotations

import pytest

from shmrpc.kernels import KernelResourceError, StepSpec, TensorSpec, check_memory, estimate, select_backend


@pytest.fixture
def be():
    return select_backend("numpy")


def test_gemm_chain_flops_and_bytes(be) -> None:
    n = 1000
    plan = be.plan([StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "a"}),
                    StepSpec("gemm", {"x": "a", "w": "v"}, {"out": "y"})],
                   {"x": TensorSpec((n, 1), "float32"), "w": TensorSpec((1, n), "float32"),
                    "v": TensorSpec((n, 1), "float32")}, ["y"])
    cost = estimate(plan)
    assert cost.flops == 2 * n * 1 * n + 2 * n * n * 1
    assert cost.step_nbytes == (4 * n * n, 4 * n * n + 4 * n)
    assert cost.memory_nbytes == 4 * n * n + 4 * n
    assert cost.touched_nbytes == 3 * 4 * n + 4 * n * n + 4 * n


def test_memory_limit_names_the_step_that_crosses_it(be) -> None:
    plan = be.plan([StepSpec("scale", {"x": "x"}, {"out": "a"}), StepSpec("scale", {"x": "a"}, {"out": "b"})],
                   {"x": TensorSpec((1024,), "float32")}, ["b"])
    cost = estimate(plan)
    check_memory(plan, cost, 8192)
    check_memory(plan, cost, 0)  # 0: no limit
    with pytest.raises(KernelResourceError) as e:
        check_memory(plan, cost, 6000)
    assert (e.value.op, e.value.step, e.value.field) == ("scale", 1, "request_memory_limit")
    assert "--request-memory-limit" in e.value.message


def test_half_precision_counts_the_widened_scratch(be) -> None:
    plan = be.plan([StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "y"})],
                   {"x": TensorSpec((8, 4), "float16"), "w": TensorSpec((4, 8), "float16")}, ["y"])
    assert estimate(plan).memory_nbytes == 2 * 64 + 4 * (32 + 32 + 64)


def test_elementwise_estimate_is_small_and_alias_is_free(be) -> None:
    x = {"x": TensorSpec((1000,), "float32")}
    assert estimate(be.plan([StepSpec("echo", {"x": "x"}, {"out": "y"})], x, ["y"])).flops == 0
    assert estimate(be.plan([StepSpec("scale", {"x": "x"}, {"out": "y"})], x, ["y"])).flops == 16 * 2000


@pytest.mark.parametrize(("cost", "says"), [
    (lambda i, o, a: 1 / 0, "the cost rule of op 't_cost_bad' raised ZeroDivisionError: division by zero"),
    (lambda i, o, a: (_ for _ in ()).throw(SystemExit("no")), "raised SystemExit: no"),
    (lambda i, o, a: None, "returned None; it must give a number of FLOPs >= 0"),
    (lambda i, o, a: float("nan"), "returned nan"),
    (lambda i, o, a: "many", "returned 'many'"),
    (lambda i, o, a: -1, "returned -1"),
    (lambda i, o, a: True, "returned True"),
], ids=["raises", "exits", "none", "nan", "str", "negative", "bool"])
def test_a_cost_rule_that_fails_is_the_requests_input_error_naming_the_op(be, cost, says: str) -> None:
    """As a failing shape rule: KernelInputError naming the op, its step, its module and field "cost"."""
    from shmrpc.kernels import REGISTRY, KernelInputError
    from shmrpc.kernels._registry import unregister
    from shmrpc.kernels.api import OpSpec, register_op

    register_op(OpSpec("t_cost_bad", inputs=("x",), outputs=("out",), infer=lambda i, a: {"out": i["x"]},
                       numpy=lambda c: {"out": c.inputs["x"]}, cost=cost))
    try:
        plan = be.plan([StepSpec("scale", {"x": "x"}, {"out": "a"}), StepSpec("t_cost_bad", {"x": "a"}, {"out": "y"})],
                       {"x": TensorSpec((4,), "float32")}, ["y"])
        with pytest.raises(KernelInputError, match=says.replace("(", r"\(")) as e:
            estimate(plan)
        assert (e.value.op, e.value.step, e.value.field) == ("t_cost_bad", 1, "cost")
        assert f"(a bug in the op's module '{__name__}')" in e.value.message
    finally:
        if "t_cost_bad" in REGISTRY:
            unregister("t_cost_bad")


def test_a_cost_rule_may_give_any_finite_number(be) -> None:
    import numpy as np

    from shmrpc.kernels import REGISTRY
    from shmrpc.kernels._registry import unregister
    from shmrpc.kernels.api import OpSpec, register_op

    for value, flops in ((2.5e3, 2500), (np.int64(7), 7), (0, 0)):
        register_op(OpSpec("t_cost_num", inputs=("x",), outputs=("out",), infer=lambda i, a: {"out": i["x"]},
                           numpy=lambda c: {"out": c.inputs["x"]}, cost=lambda i, o, a, v=value: v))
        try:
            plan = be.plan([StepSpec("t_cost_num", {"x": "x"}, {"out": "y"})], {"x": TensorSpec((4,), "float32")}, ["y"])
            assert estimate(plan).flops == flops
        finally:
            if "t_cost_num" in REGISTRY:
                unregister("t_cost_num")
