"""Batches: one run of a plan over several requests of that plan (the worker's dynamic batching).

A plan is *batchable* when every step's op says ``batch=True`` (its implementations take
one more leading axis on every tensor that is not resident), nothing is kept as a resident
tensor and no step updates a resident tensor in place. :meth:`Backend.run_batch` runs such
a plan once over B requests' views; any other plan, or a batch whose joint run fails, is
run request by request, so each request gets its own result or its own error.

Which tensors carry the batch axis (``B`` requests)::

    request inputs that are not resident      (B, *spec.shape)     one slice per request
    resident inputs                           spec.shape           shared by all requests
    outputs of a step with a batched input    (B, *spec.shape)
    outputs of a step reading residents only  spec.shape           the same for every request

:func:`batch_plan` works this out once per (plan, B); the backends use it for the specs they
hand to each step (so an op's result is checked against ``(B, *shape)``) and to know which
output to slice per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ._plan import Plan
from ._registry import TensorSpec

__all__ = ["batchable", "BatchPlan", "batch_plan"]


def batchable(plan: Plan) -> bool:
    """Whether ``plan`` may run as one batch over several requests (see the module doc)."""
    return bool(plan.steps) and not plan.keep and all(st.op.batch and not st.op.mutates for st in plan.steps)


@dataclass(frozen=True)
class BatchPlan:
    """Specs of a batchable plan run over ``size`` requests at once.

    ``batched``: names of the tensors that carry the leading batch axis; ``steps``: per step,
    (in_specs, out_specs) with ``(size, *shape)`` for the batched tensors.
    """

    size: int
    batched: frozenset[str]
    steps: tuple[tuple[Mapping[str, TensorSpec], Mapping[str, TensorSpec]], ...]


def _with_axis(spec: TensorSpec, size: int) -> TensorSpec:
    return TensorSpec((size, *spec.shape), spec.dtype)


def batch_plan(plan: Plan, size: int) -> BatchPlan:
    """The batched specs of ``plan`` over ``size`` requests (pure; callers may cache it per (plan, size))."""
    batched = {n for n in plan.inputs if n not in plan.resident}
    steps = []
    for st in plan.steps:
        is_b = any(n in batched for n in st.inputs.values())
        ins = {p: _with_axis(sp, size) if st.inputs[p] in batched else sp for p, sp in st.in_specs.items()}
        outs = {p: _with_axis(sp, size) if is_b else sp for p, sp in st.out_specs.items()}
        if is_b:
            batched.update(st.outputs.values())
        steps.append((ins, outs))
    return BatchPlan(size, frozenset(batched), tuple(steps))
