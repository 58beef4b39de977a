"""Test your op: its CuPy implementation against its NumPy one (and both against a reference), with its tolerances.

One test body runs the op through the real backends (plan, shape rule, output checks) on
generated inputs, over shapes and dtypes, and compares with the op's ``tolerances[dtype]``.
The project's own parity test (tests/kernels/test_kernels_parity.py) uses it for every
built-in op.

Example, in a user's test file::

    import myops                                   # registers "relu"
    from shmrpc.kernels.testing import check_parity

    def test_relu_parity():
        report = check_parity("relu", shapes=[{"x": (4, 8)}, {"x": (1000,)}], dtypes=["float32", "float16"])
        assert report.compared                     # the CuPy run is skipped (listed) without a GPU

``check_parity`` raises :class:`ParityError` (an AssertionError) naming the op, the dtype,
the shapes, the output and how far off it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._backend_base import Backend, example_array
from ._dtypes import FLOAT_DTYPES, bf16_to_f32, storage_dtype
from ._errors import BackendUnavailable, KernelInputError
from ._registry import REGISTRY, OpSpec, StepSpec, TensorSpec

__all__ = ["ParityError", "ParityReport", "check_parity", "run_op", "as_float64"]

MakeInputs = Callable[[str, np.random.Generator], tuple[dict[str, np.ndarray], dict[str, Any]]]


class ParityError(AssertionError):
    """Two implementations (or one and the reference) differ by more than the op's tolerance."""


@dataclass
class ParityReport:
    """What :func:`check_parity` did: cases compared, cases the shape rule refused, and why a backend was skipped."""

    compared: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def as_float64(a: Any, dtype: str) -> np.ndarray:
    """A host float64 copy of ``a`` (NumPy or CuPy; bfloat16 as uint16 bits)."""
    h = a.get() if hasattr(a, "get") else np.asarray(a)
    if dtype == "bfloat16" and h.dtype == np.uint16:
        return bf16_to_f32(np, h).astype(np.float64)
    return h.astype(np.float64)


def run_op(backend: Backend, op: str, inputs: Mapping[str, np.ndarray], in_dtypes: Mapping[str, str],
           attrs: Mapping[str, Any], *, watch_inputs: bool = False) -> dict[str, np.ndarray]:
    """Run ``op`` alone through ``backend`` on host ``inputs``; returns output param -> host array.

    Inputs the op ``mutates`` are put as resident tensors first (copies: ``inputs`` are not changed).
    ``watch_inputs``: the request also returns every other input as the backend holds it after the op ran (an
    ``echo`` step each), and an op that changed one raises :class:`ParityError`: on the NumPy backend such an op
    fails at once (its inputs are read-only), on CuPy nothing else would tell (device arrays cannot be)."""
    spec = REGISTRY[op]
    specs = {p: TensorSpec(a.shape, in_dtypes[p]) for p, a in inputs.items()}
    resident = {p: f"parity/{p}" for p in spec.mutates}  # an op that updates an input in place gets it resident
    watched = [p for p in spec.inputs if p not in resident] if watch_inputs else []
    sent = {p: np.ascontiguousarray(inputs[p]).tobytes() for p in watched}  # (NumPy's run reads `inputs` themselves)
    for p, name in resident.items():
        backend.put(name, inputs[p], in_dtypes[p])
    try:
        steps = [StepSpec(op, {p: p for p in spec.inputs}, {p: "out." + p for p in spec.outputs}, dict(attrs)),
                 *(StepSpec("echo", {"x": p}, {"out": "in." + p}, {}) for p in watched)]
        plan = backend.plan(steps, specs, ["out." + p for p in spec.outputs] + ["in." + p for p in watched],
                            resident=resident)
        outs = {n: np.full(s.shape, 0x55, dtype=storage_dtype(s.dtype)) for n, s in plan.outputs.items()}
        backend.run(plan, {p: a for p, a in inputs.items() if p not in resident}, outs)
    finally:
        for name in resident.values():
            backend.drop(name)
    for p in watched:
        if outs.pop("in." + p).tobytes() != sent[p]:
            raise ParityError(f"{op} ({backend.name}) changed its input {p!r}: an op may write only into the inputs "
                              f"its spec names in `mutates` (resident tensors); its other inputs may be another "
                              f"step's, or a resident tensor shared by other clients")
    return {n[4:]: a for n, a in outs.items()}


def _param_dtype(spec: OpSpec, p: str, dt: str, in_dtypes: Mapping[str, str]) -> str:
    """An input's dtype in a case of dtype ``dt``: ``in_dtypes`` first, then ``dt`` unless the example says non-float."""
    if p in in_dtypes:
        return in_dtypes[p]
    ex = spec.example.get(p)
    return dt if ex is None or ex.dtype in FLOAT_DTYPES else ex.dtype


def _default_inputs(spec: OpSpec, shapes: Mapping[str, tuple[int, ...]], in_dtypes: Mapping[str, str]) -> MakeInputs:
    def make(dt: str, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        ins = {}
        for p in spec.inputs:
            ex = spec.example.get(p)
            shape = shapes.get(p, ex.shape if ex is not None else ())
            ins[p] = example_array(TensorSpec(tuple(shape), _param_dtype(spec, p, dt, in_dtypes)), rng)
        return ins, {}
    return make


def _compare(got: Any, want: Any, dtype: str, tol: tuple[float, float], what: str) -> None:
    g = as_float64(got, dtype)
    w = want if isinstance(want, np.ndarray) and want.dtype == np.float64 else as_float64(want, dtype)
    if g.shape != w.shape:
        raise ParityError(f"{what}: shape {g.shape}, expected {w.shape}")
    rtol, atol = tol
    err = np.abs(g - w)
    bad = ~(err <= atol + rtol * np.abs(w)) & ~(np.isnan(g) & np.isnan(w))
    if bad.any():
        raise ParityError(f"{what}: {int(bad.sum())} of {bad.size} elements off, worst {float(np.nanmax(err)):.3g} "
                          f"(rtol={rtol}, atol={atol})")


def _cupy_backend() -> tuple[Backend | None, str]:
    from . import select_backend

    try:
        return select_backend("cupy"), ""
    except BackendUnavailable as e:
        return None, str(e)


def check_parity(op: str, *, shapes: Iterable[Mapping[str, tuple[int, ...]]] | None = None,
                 dtypes: Iterable[str] | None = None, attrs: Mapping[str, Any] | None = None,
                 make_inputs: MakeInputs | None = None, in_dtypes: Mapping[str, str] | None = None,
                 reference: Callable[[dict[str, np.ndarray], Mapping[str, Any]], Mapping[str, np.ndarray]] | None = None,
                 seed: int = 0, cupy_slack: float = 2.0) -> ParityReport:
    """Check ``op``'s implementations over generated shapes and dtypes with its tolerances.

    Parameters
    ----------
    op: a registered op's name.
    shapes: per case, input param -> shape (default: the op's ``example`` shapes).
    dtypes: dtypes to try (default: the float dtypes the op gives tolerances for); an input whose
        example dtype is not a float keeps it.
    attrs: attributes of every call; make_inputs: ``make(dtype, rng) -> (inputs, attrs)`` instead of
        generated ones (then ``shapes`` is ignored). in_dtypes: input param -> dtype for inputs that keep
        one dtype whatever the case's (``{"y": "float16"}``).
    reference: ``ref(float64 inputs, attrs) -> {output: float64 array}``; when given, the NumPy
        implementation is checked against it with ``tolerances[dtype]``.
    cupy_slack: the CuPy run is compared with the NumPy one at ``cupy_slack`` times the tolerance.

    Returns a :class:`ParityReport`. Raises :class:`ParityError` on a difference, ``KeyError`` for an
    unknown op. Cases the shape rule refuses are listed in ``report.refused``, not run.
    """
    from ._backend_numpy import NumpyBackend

    spec = REGISTRY[op]
    report = ParityReport()
    dts = list(dtypes) if dtypes is not None else [d for d in spec.tolerances if d in FLOAT_DTYPES]
    cases: list[tuple[str, MakeInputs, str]] = []
    for dt in dts:
        if make_inputs is not None:
            cases.append((dt, make_inputs, "make_inputs"))
        else:
            for sh in (list(shapes) if shapes is not None else [{p: s.shape for p, s in spec.example.items()}]):
                cases.append((dt, _default_inputs(spec, sh, in_dtypes or {}), str(dict(sh))))
    host = NumpyBackend() if "numpy" in spec.backends else None
    if host is None:
        report.skipped["numpy"] = f"op {op!r} has no numpy implementation"
    gpu, why = (_cupy_backend() if "cupy" in spec.backends else (None, f"op {op!r} has no cupy implementation"))
    if gpu is None:
        report.skipped["cupy"] = why
    try:
        for i, (dt, make, where) in enumerate(cases):
            rng = np.random.default_rng(seed + i)
            ins, made_attrs = make(dt, rng)
            defaults = {a: s.default for a, s in spec.attrs.items() if not s.required}
            call_attrs = {**defaults, **made_attrs, **dict(attrs or {})}
            pdt = {p: _param_dtype(spec, p, dt, in_dtypes or {}) for p in ins}
            what = f"{op}[{dt}] {where}"
            tol = spec.tolerances.get(dt, (0.0, 0.0))
            if dt not in spec.tolerances:
                what += f" (compared exactly: the op's tolerances give none for {dt})"
            try:
                got_np = run_op(host, op, ins, pdt, call_attrs, watch_inputs=not spec.builtin) if host is not None else None
            except KernelInputError as e:
                report.refused.append(f"{what}: {e}")
                continue
            if reference is not None and got_np is not None:
                ref = reference({p: as_float64(a, pdt[p]) for p, a in ins.items()}, call_attrs)
                for p, want in ref.items():
                    _compare(got_np[p], np.asarray(want, np.float64), dt, tol, f"numpy {what}.{p} vs reference")
            if gpu is not None:
                got_gpu = run_op(gpu, op, ins, pdt, call_attrs, watch_inputs=not spec.builtin)
                base = got_np if got_np is not None else (
                    {p: np.asarray(w, np.float64) for p, w in reference({p: as_float64(a, pdt[p]) for p, a in ins.items()},
                                                                        call_attrs).items()} if reference else None)
                for p, a in got_gpu.items():
                    if base is not None:
                        _compare(a, base[p], dt, (cupy_slack * tol[0], cupy_slack * tol[1]), f"cupy {what}.{p}")
            report.compared.append(what)
    finally:
        if gpu is not None:
            gpu.close()
    return report
