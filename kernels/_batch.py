"""Batches: one run of a plan over several requests of that plan (the worker's dynamic batching).

A plan is *batchable* when every step's op says ``batch=True`` (its implementations take
one more leading axis on every tensor that is not resident), nothing is kept as a resident
tensor and no step updates a resident tensor in place. :meth:`Backend.run_batch` runs such
a plan once over B requests' views; any other plan, or a batch whose joint run fails, is
run request by request, so each request gets its own result or its own error.
"""

from __future__ import annotations

from ._plan import Plan

__all__ = ["batchable"]


def batchable(plan: Plan) -> bool:
    """Whether ``plan`` may run as one batch over several requests (see the module doc)."""
    return bool(plan.steps) and not plan.keep and all(st.op.batch and not st.op.mutates for st in plan.steps)
