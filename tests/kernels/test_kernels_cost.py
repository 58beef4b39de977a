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
