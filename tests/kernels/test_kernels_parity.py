"""One test body per (op, dtype): the NumPy twin against an independent float64 reference,
and (marked gpu) the CuPy implementation against the NumPy twin, with per-dtype tolerances."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmrpc.kernels import REGISTRY, StepSpec, TensorSpec, select_backend
from shmrpc.kernels.testing import check_parity

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: make kernel_cases importable
from kernel_cases import CASES, check_quant, to_f64  # noqa: E402

PAIRS = [(op, dt) for op, case in CASES.items() for dt in case.dtypes]
SEED = 1234


def _spec_dtype(op: str, param: str, dt: str) -> str:
    return CASES[op].in_dtypes.get(param, dt)


def run_op(backend: Any, op: str, dt: str, seed: int = SEED):
    """Run ``op`` alone through ``backend`` on the case's inputs; returns (inputs, outputs, attrs)."""
    rng = np.random.default_rng(seed)
    ins, attrs = CASES[op].make(dt, rng)
    spec = REGISTRY[op]
    specs = {p: TensorSpec(a.shape, _spec_dtype(op, p, dt)) for p, a in ins.items()}
    plan = backend.plan([StepSpec(op, {p: p for p in spec.inputs}, {p: "o_" + p for p in spec.outputs}, attrs)],
                        specs, ["o_" + p for p in spec.outputs])
    outs = {n: np.full(s.shape, 0x55, dtype=np.uint16 if s.dtype == "bfloat16" else s.dtype) for n, s in plan.outputs.items()}
    backend.run(plan, ins, outs)
    return ins, {n[2:]: a for n, a in outs.items()}, attrs


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str, tol: tuple[float, float], what: str) -> None:
    rtol, atol = tol
    g = to_f64(got, dtype)
    err = np.abs(g - want)
    bad = err > atol + rtol * np.abs(want)
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} off, worst {err.max():.3g} (rtol={rtol}, atol={atol})"


def test_every_registered_op_has_a_case() -> None:
    assert sorted(REGISTRY) == sorted(CASES)


@pytest.mark.parametrize(("op", "dt"), PAIRS)
def test_numpy_twin_matches_float64_reference(op: str, dt: str) -> None:
    case = CASES[op]
    if case.ref is None:
        be = select_backend("numpy")
        ins, outs, attrs = run_op(be, op, dt)
        check_quant(ins, outs, attrs, dt)
        return
    # the users' helper (shmrpc.kernels.testing) is the test body: NumPy against the reference here,
    # and CuPy against NumPy too where there is a GPU
    report = check_parity(op, dtypes=[dt], make_inputs=case.make, in_dtypes=case.in_dtypes, reference=case.ref,
                          seed=SEED)
    assert report.compared == [f"{op}[{dt}] make_inputs"], report


def _cupy_or_skip() -> Any:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
        return cupy
    except Exception as e:  # ImportError, CUDARuntimeError ...
        pytest.skip(f"no CuPy/GPU: {type(e).__name__}: {e}")


@pytest.mark.gpu
@pytest.mark.parametrize(("op", "dt"), PAIRS)
def test_cupy_matches_numpy_twin(op: str, dt: str) -> None:
    _cupy_or_skip()
    if CASES[op].ref is None:
        with select_backend("cupy") as gpu:
            ins, outs_gpu, attrs = run_op(gpu, op, dt)
        check_quant(ins, outs_gpu, attrs, dt)
        return
    report = check_parity(op, dtypes=[dt], make_inputs=CASES[op].make, in_dtypes=CASES[op].in_dtypes, seed=SEED)
    assert "cupy" not in report.skipped and report.compared, report
