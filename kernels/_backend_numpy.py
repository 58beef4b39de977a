"""The NumPy backend: runs the NumPy twins on the host, writing into the output views.

Copies: none for inputs (ops read the shared-memory views); the step producing a requested
output writes straight into its view (``out=``) unless that view overlaps memory a later
step (or this step, for ops that are not in place) still reads, in which case it computes
into a fresh array that is copied into the view at the end. Intermediates are ordinary
arrays. Resident tensors are private copies (``put`` copies; kept outputs are copied).

Batches (:meth:`NumpyBackend.run_batch`): a batchable plan over B requests stacks each
request input into one (B, ...) array (a copy), runs every step once and copies each
request's slice into its output view, when ``BATCH_JOINT`` is set. It is off by default: in
``bench/gpu/tiny_probe.py --batch`` (gemm 16x256x256 float16, x and w per request; GPU host's
16 cores, bench/results/gpu-batch-2026-11-30-*.json) the joint run was no faster than one run
per request (B=8: 6825 vs 6676 requests/s in one run, 3772 vs 4883 in the other; NumPy's
matmul loops over the stack anyway). The tests turn it on to check every ``batch=True`` op's
claim without a GPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np

from ._backend_base import Backend, BatchItem, BatchLaunch, BoundRun, RunLaunch, can_write, check_result
from ._batch import batch_plan, batchable
from ._errors import KernelInputError, KernelResourceError, KernelRuntimeError, OpError, is_op_failure
from ._plan import Plan, ResolvedStep
from ._registry import NUMPY_BOUND, OpCall, TensorSpec

__all__ = ["NumpyBackend", "BATCH_JOINT"]

T = TypeVar("T")

#: Run batchable plans jointly in :meth:`NumpyBackend.run_batch` (False: request by request); the
#: environment's ``SHMRPC_NUMPY_BATCH_JOINT=1`` turns it on at import (the batching tests' workers).
BATCH_JOINT = os.environ.get("SHMRPC_NUMPY_BATCH_JOINT", "") == "1"
#: With BATCH_JOINT, a request launched alone (:meth:`NumpyBackend.launch`) says it is done this many seconds after
#: its launch, and when (its ``eta``), as a device run would (``SHMRPC_NUMPY_LAUNCH_S``; 0: done at once, no eta):
#: the worker's wait for a long device run, and its PULSE, are tested this way without a GPU.
LAUNCH_S = float(os.environ.get("SHMRPC_NUMPY_LAUNCH_S", "0") or 0)


def _call_op(st: ResolvedStep, impl: Any, call: OpCall, given: Sequence[tuple[str, np.ndarray]] = ()) -> Any:
    """Step ``st``'s implementation on ``call``, its result checked; errors as an :class:`OpError` of that step.
    ``given``: (output, view) for every output, views checked against the output specs already (a bound run's):
    a result that is exactly those views needs no other check."""
    try:
        res = impl(call)
        if not given or type(res) is not dict or (
                res.get(given[0][0]) is not given[0][1] if len(given) == 1  # a lone output: no generator
                else any(res.get(p) is not v for p, v in given)):
            check_result(st, res, st.out_specs)
    except BaseException as e:  # every failure of an op is its step's error (is_op_failure)
        if not is_op_failure(e):
            raise
        raise _op_failure(st, e) from (None if isinstance(e, OpError) else e)
    return res


def _op_failure(st: ResolvedStep, e: BaseException) -> OpError:
    """What a failure ``e`` of step ``st``'s implementation is raised as: an :class:`OpError` of that step."""
    if isinstance(e, OpError):
        return e.with_context(op=st.op.name, step=st.index)
    if isinstance(e, MemoryError):
        return KernelResourceError(f"out of host memory in {st.op.name!r}: {e}", op=st.op.name, step=st.index)
    if isinstance(e, ValueError) and "read-only" in str(e) and not st.op.builtin:
        return KernelRuntimeError(f"op {st.op.name!r} wrote into one of its inputs, which are read-only unless its "
                                  f"spec names them in `mutates` ({type(e).__name__}: {e})", op=st.op.name,
                                  step=st.index, field="inputs")
    return KernelRuntimeError(f"op {st.op.name!r} failed: {type(e).__name__}: {e}", op=st.op.name, step=st.index)


def _read_only(st: ResolvedStep, ins: dict[str, Any]) -> dict[str, Any]:
    """The inputs a users' op of step ``st`` is handed: read-only views of those its spec does not name in
    ``mutates``, so that an op writing into one by mistake (``x /= n``) fails with its own error instead of changing
    a resident tensor (a shared one included), an intermediate of its pipeline, or its request's input. Built-in
    ops get the arrays as they are."""
    if st.op.builtin:
        return ins
    out: dict[str, Any] = {}
    for p, a in ins.items():
        if p not in st.op.mutates and isinstance(a, np.ndarray) and a.flags.writeable:
            a = a.view()
            a.flags.writeable = False
        out[p] = a
    return out


class NumpyBackend(Backend):
    """Host backend: every op's NumPy twin. ``select_backend("numpy")`` makes one."""

    name = "numpy"

    @property
    def joins_batches(self) -> bool:  # type: ignore[override]
        return BATCH_JOINT

    @property
    def batches_singles(self) -> bool:  # type: ignore[override]
        return BATCH_JOINT  # the joint mode launches a lone request as a batch of one (the worker's path, tested)
    xp = np

    def _to_resident(self, arr: np.ndarray, spec: TensorSpec) -> np.ndarray:
        return np.array(arr, copy=True, order="C")

    def _own(self, arr: Any) -> Any:
        return np.array(arr, copy=True, order="C")

    def run(self, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
            keep_as: Mapping[str, str] | None = None) -> dict[str, float]:
        """Run ``plan`` on host views; returns seconds per stage (h2d/d2h are 0 here).

        ``inputs``: request input name -> NumPy view (not the resident ones); ``outputs``:
        requested output name -> view to write into; ``keep_as``: kept tensor -> resident name.
        Raises KernelInputError, KernelRuntimeError (op/step set), KernelResourceError.
        """
        t0 = time.perf_counter()
        fault = self._consume_injected_fault(plan)
        if fault is not None:
            raise fault
        host_in, host_out = self._host_io(plan, inputs, outputs)
        self._steps(plan, host_in, host_out, [None] * len(plan.steps), keep_as)
        dt = time.perf_counter() - t0
        return {"h2d": 0.0, "kernel": dt, "d2h": 0.0, "total": dt}

    def bind(self, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
             keep_as: Mapping[str, str] | None = None) -> BoundRun:
        """``plan`` over these views as a callable (see :meth:`Backend.bind`); each call equals one :meth:`run`.

        Done once here: the checks of the views (type, shape, dtype; storage-dtype views) and, for every
        step that reads no tensor an earlier step made (a single-op plan: its one step), where it writes
        (its output views or fresh arrays). Per call: the injected fault, the resident tensors' lookup
        (a replaced one is used, a dropped one is a KernelInputError), the check of what each op
        returned, ``keep_as``. Views that fail the checks give a callable that is :meth:`run` itself,
        so each call raises what :meth:`run` raises.
        """
        try:
            host_in, host_out = self._host_io(plan, inputs, outputs)
        except KernelInputError:
            return super().bind(plan, inputs, outputs, keep_as)
        made: set[str] = set()  # names an earlier step wrote (intermediates, or an input rebound in place)
        fixed: list[dict[str, Any] | None] = []
        for st in plan.steps:
            later_names = [n for n, last in plan.last_use.items() if last > st.index]
            if any(n in made for n in st.inputs.values()) or any(n in made for n in later_names):
                fixed.append(None)  # an intermediate may be a view of anything: decide per run
            else:
                # resident tensors are the backend's private copies: they share no memory with a view
                ins = {p: host_in[n] for p, n in st.inputs.items() if n in host_in}
                later = [host_in[n] for n in later_names if n in host_in]
                dests: dict[str, Any] = {}
                for p, n in st.outputs.items():
                    view = host_out.get(n)
                    if view is not None and can_write(view, st, ins, later):
                        dests[p] = view
                fixed.append(dests)
            made.update(st.outputs.values())

        one = plan.steps[0] if len(plan.steps) == 1 else None
        if (one is not None and fixed[0] is not None and not plan.resident and not plan.keep
                and set(host_out) <= set(one.outputs.values())):
            return self._bind_one(plan, one, _read_only(one, {p: host_in[n] for p, n in one.inputs.items()}), fixed[0],
                                  [(p, host_out[n]) for p, n in one.outputs.items() if n in host_out])

        def bound() -> dict[str, float]:
            t0 = time.perf_counter()
            fault = self._consume_injected_fault(plan)
            if fault is not None:
                raise fault
            self._steps(plan, host_in, host_out, fixed, keep_as)
            dt = time.perf_counter() - t0
            return {"h2d": 0.0, "kernel": dt, "d2h": 0.0, "total": dt}
        return bound

    def _bind_one(self, plan: Plan, st: ResolvedStep, ins: dict[str, np.ndarray], dests: dict[str, Any],
                  outs: list[tuple[str, np.ndarray]]) -> BoundRun:
        """The bound run of a one-step plan with nothing resident or kept: what :meth:`_steps` does for it, with
        the step's inputs and destinations looked up once (each call still gets its own dicts and OpCall)."""
        impl = st.op.numpy
        assert impl is not None  # plan() refuses ops without one
        in_specs, out_specs, attrs = st.in_specs, st.out_specs, st.attrs
        # every output has its view, and each is its destination: checked here once (_host_io), not per call
        given = outs if len(outs) == len(out_specs) and all(dests.get(p) is v for p, v in outs) else []
        p1, v1 = given[0] if len(given) == 1 else ("", None)  # the lone output, its copy skipped below
        perf = time.perf_counter
        maker = NUMPY_BOUND.get(impl) if v1 is not None else None
        fast = maker(ins, dests, in_specs, attrs) if maker is not None else None  # the op's own form over the views

        def bound() -> dict[str, float]:
            t0 = perf()
            if self.inject_fault:
                fault = self._consume_injected_fault(plan)
                if fault is not None:
                    raise fault
            if fast is not None:  # no OpCall, no result to check: it writes into the checked views
                try:
                    fast()
                except BaseException as e:  # raised as _call_op raises it
                    if not is_op_failure(e):
                        raise
                    raise _op_failure(st, e) from (None if isinstance(e, OpError) else e)
            else:
                res = _call_op(st, impl, OpCall(np, dict(ins), in_specs, out_specs, attrs, dict(dests)), given)
                if v1 is None or res[p1] is not v1:  # the lone output written into its view needs no copy
                    for p, view in outs:
                        if res[p] is not view:
                            np.copyto(view, res[p])
            dt = perf() - t0
            return {"h2d": 0.0, "kernel": dt, "d2h": 0.0, "total": dt}
        return bound

    def _steps(self, plan: Plan, host_in: Mapping[str, np.ndarray], host_out: Mapping[str, np.ndarray],
               fixed: Sequence[dict[str, Any] | None], keep_as: Mapping[str, str] | None) -> None:
        """Run every step over checked views; ``fixed[i]``: step i's destinations decided already, or None."""
        env: dict[str, Any] = dict(host_in)
        if plan.resident:
            env.update(self._lookup_resident(plan))
        for st, known in zip(plan.steps, fixed):
            ins = {p: env[n] for p, n in st.inputs.items()}
            if known is None:
                later = [env[n] for n, last in plan.last_use.items() if last > st.index and n in env]
                dests: dict[str, Any] = {}
                for p, n in st.outputs.items():
                    view = host_out.get(n)
                    if view is not None and can_write(view, st, ins, later):
                        dests[p] = view
            else:
                dests = dict(known)  # an op may change its call's dicts: each run gets its own
            impl = st.op.numpy
            assert impl is not None  # plan() refuses ops without one
            res = _call_op(st, impl, OpCall(np, _read_only(st, ins), st.in_specs, st.out_specs, st.attrs, dests))
            for p, n in st.outputs.items():
                env[n] = res[p]
        for name, view in host_out.items():
            if env[name] is not view:
                np.copyto(view, env[name])
        self._keep(plan, env, keep_as)

    def launch(self, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> RunLaunch | None:
        """With ``BATCH_JOINT``, for plans of built-in ops: a handle whose ``finish()`` runs :meth:`run` (see
        :meth:`launch_batch`; users' ops are never run by the caller's thread this way). Else None."""
        if not BATCH_JOINT or not all(st.op.builtin for st in plan.steps):
            return None
        return _Deferred(lambda: self.run(plan, inputs, outputs), LAUNCH_S)

    def launch_batch(self, plan: Plan, items: Sequence[BatchItem]) -> BatchLaunch | None:
        """With ``BATCH_JOINT``: a handle whose ``finish()`` runs :meth:`run_batch` (NumPy has no device to start
        work on; the worker's path for launched runs is tested this way without a GPU), for a batch of one too (see
        ``batches_singles``). Else None."""
        if not BATCH_JOINT or not items:
            return None
        return _Deferred(lambda: self.run_batch(plan, items))

    def run_batch(self, plan: Plan, items: Sequence[BatchItem]) -> list[dict[str, float] | Exception]:
        """Run ``plan`` over several requests; see :meth:`Backend.run_batch`.

        A :func:`~shmrpc.kernels._batch.batchable` plan over two requests or more (and
        ``BATCH_JOINT``) runs once on stacked inputs; each item then gets
        ``{"total": seconds of the joint run, "batch": B}``. If a view is wrong or the joint
        run raises, every request runs alone, so each gets its own result or error.
        """
        if len(items) < 2 or not BATCH_JOINT or self.inject_fault or not batchable(plan):
            return super().run_batch(plan, items)
        t0 = time.perf_counter()
        try:
            checked = [self._host_io(plan, ins, outs) for ins, outs in items]
            bp = batch_plan(plan, len(items))
            env: dict[str, Any] = {n: np.stack([c[0][n] for c in checked]) for n in plan.inputs if n not in plan.resident}
            env.update(self._lookup_resident(plan))
            for st, (in_specs, out_specs) in zip(plan.steps, bp.steps):
                impl = st.op.numpy
                assert impl is not None  # plan() refuses ops without one
                res = impl(OpCall(np, _read_only(st, {p: env[n] for p, n in st.inputs.items()}), in_specs, out_specs,
                                  st.attrs, {}))
                check_result(st, res, out_specs)
                for p, n in st.outputs.items():
                    env[n] = res[p]
        except BaseException as e:  # noqa: BLE001 - one request's bad input or an op's error: each request alone
            if not is_op_failure(e):
                raise
            return super().run_batch(plan, items)
        # NOTE: outputs are written only now, after every step ran: an output view over its own
        # request's input (in place) is read before it is written, and a failed batch wrote nothing.
        for b, (_, host_out) in enumerate(checked):
            for n, view in host_out.items():
                np.copyto(view, env[n][b] if n in bp.batched else env[n])
        dt = time.perf_counter() - t0
        return [{"total": dt, "batch": float(len(items))} for _ in items]


class _Deferred(Generic[T]):
    """A run "launched" on NumPy: nothing runs until :meth:`finish`; ``seconds`` > 0: done (and due: ``eta``) that
    long after the launch, else done at once and its ``eta`` not known (0)."""

    __slots__ = ("_run", "eta")

    def __init__(self, run: Callable[[], T], seconds: float = 0.0) -> None:
        self._run = run
        self.eta = time.perf_counter() + seconds if seconds > 0 else 0.0

    def done(self) -> bool:
        return time.perf_counter() >= self.eta

    def finish(self) -> T:
        return self._run()
