"""Dynamic batching on the worker: requests of one plan that arrive in one turn of the loop run as one batch.

A turn of the loop is one drain of the ZeroMQ socket (up to 256 messages) plus one scan of
the lanes. Every CALL of the turn is validated and primed as it is read, exactly as a lone
one; a request whose plan is *batchable* (:func:`shmrpc.kernels._batch.batchable`: every op
says ``batch=True``, nothing kept, no resident tensor updated; ``Prepared.batch``) is not run
at once but parked as a :class:`Pending`. At the end of the turn the parked requests are
grouped by plan (the same :class:`~shmrpc.kernels.Plan` object, or an equal one: same ops,
shapes, dtypes, attributes, resident bindings), in arrival order, at most ``--max-batch`` per
group::

    turn:  drain socket ─┐                         ┌─ group of 1  -> run as a lone request (today's path)
           scan lanes  ──┴─> parked requests ──────┼─ group of B  -> ONE backend.run_batch(plan, B views)
                              (validated, primed)  └─ ...            inline, or one executor task,
                                                                     as one request of that plan would run
           then, per request: its response into its own slot, its own DONE (or its own typed error)

Nothing waits for more requests: a lone request is served in the same turn it arrived, so
latency at low load does not change; batches form only when requests queue up while the
loop is busy (or the worker was descheduled), which is when one run instead of B pays.
"""

from __future__ import annotations

from dataclasses import dataclass

from shmrpc.kernels import Plan

from ._lease import Slot
from ._primed import Primed

__all__ = ["Pending", "group_by_plan"]


@dataclass(slots=True)
class Pending:
    """One validated request parked until the end of the loop's turn."""

    identity: bytes
    slot: Slot
    view: memoryview
    hdr: tuple[int, int, int]  # (request_id, op_code, generation) of the response header
    primed: Primed
    t0: float
    lane: int  # the lane call_seq it came with (0: ZeroMQ)


def group_by_plan(pending: list[Pending], max_batch: int) -> list[list[Pending]]:
    """``pending`` split into groups of one plan, each of at most ``max_batch``, in order of first arrival.

    Example:
        >>> group_by_plan([], 64)
        []
    """
    groups: list[tuple[Plan, list[Pending]]] = []
    for p in pending:
        plan = p.primed.prep.plan
        assert plan is not None  # only requests with something to run are parked
        for g_plan, items in reversed(groups):  # the last group first: a burst of one plan hits at once
            if len(items) < max_batch and (g_plan is plan or g_plan == plan):
                items.append(p)
                break
        else:
            groups.append((plan, [p]))
    return [items for _, items in groups]
