"""What a plan will cost before it runs: floating-point operations and bytes of memory.

The worker uses the estimate twice, before any kernel starts:

- **where it runs**: a request of little estimated work runs on the loop thread, all others
  in the executor (the loop thread only routes);
- **whether it runs**: the bytes every step produces (intermediates, outputs, kept tensors)
  plus the largest step's scratch must fit ``--request-memory-limit``, else
  :class:`KernelResourceError` naming the step that crosses it.

Per step::

    flops      op.cost(in_specs, out_specs, attrs) when the op gives a rule, else default_flops
    out        bytes of the step's outputs (each is a new array, even when later freed)
    scratch    for 16-bit dtypes: inputs and outputs widened to float32 (what the twins do)

The memory figure is an upper bound: it counts every step's outputs as alive at once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._errors import KernelInputError, KernelResourceError, OpError, is_op_failure
from ._plan import Plan, ResolvedStep
from ._registry import TensorSpec

__all__ = ["PlanCost", "estimate", "default_flops", "check_memory"]

_WIDENED = ("float16", "bfloat16")


@dataclass(frozen=True)
class PlanCost:
    """Estimated cost of a plan.

    ``flops``: floating-point operations of all steps; ``touched_nbytes``: bytes of the
    inputs and of every step's outputs; ``step_nbytes``: per step, bytes alive once it has
    run (all outputs so far plus its scratch); ``memory_nbytes``: the largest of those.
    """

    flops: int
    touched_nbytes: int
    step_nbytes: tuple[int, ...]

    @property
    def memory_nbytes(self) -> int:
        """Peak bytes of intermediates, outputs and scratch."""
        return max(self.step_nbytes, default=0)


def default_flops(in_specs: Mapping[str, TensorSpec], out_specs: Mapping[str, TensorSpec],
                  attrs: Mapping[str, Any]) -> int:
    """The rule for ops without their own: 16 per element of every input and output for ops whose output has the
    first input's shape (elementwise, row-wise norms), else ``2 x output elements x`` the first input's last
    dimension plus 16 per element of the first input (contractions such as matrix products)."""
    first = next(iter(in_specs.values()), None)
    n_out = sum(s.size for s in out_specs.values())
    if first is None or not first.shape or any(s.shape == first.shape for s in out_specs.values()):
        return 16 * (n_out + sum(s.size for s in in_specs.values()))
    return 2 * n_out * max(1, first.shape[-1]) + 16 * first.size


def _step_flops(st: ResolvedStep) -> int:
    """Step ``st``'s FLOPs by its op's cost rule (else :func:`default_flops`). A rule that raises (``sys.exit()``
    included: :func:`~._errors.is_op_failure`) or gives something other than a finite number >= 0 is that request's
    :class:`KernelInputError` naming the op, its module and ``field="cost"``, as a failing shape rule is."""
    op = st.op
    if op.alias:
        return 0
    if op.cost is None:
        return default_flops(st.in_specs, st.out_specs, st.attrs)
    where = "" if op.builtin else f" (a bug in the op's module {op.module!r})"
    try:
        flops = op.cost(st.in_specs, st.out_specs, st.attrs)
    except OpError as e:
        raise e.with_context(op=op.name, step=st.index) from None
    except BaseException as e:  # noqa: BLE001 - a rule's bug is the request's error, not the worker's
        if not is_op_failure(e):
            raise
        raise KernelInputError(f"the cost rule of op {op.name!r} raised {type(e).__name__}: {e}{where}",
                               op=op.name, step=st.index, field="cost") from e
    if isinstance(flops, bool) or not isinstance(flops, numbers.Real) or not math.isfinite(flops) or flops < 0:
        try:
            text = repr(flops)[:100]
        except Exception:  # noqa: BLE001 - only for the message
            text = f"a {type(flops).__name__}"
        raise KernelInputError(f"the cost rule of op {op.name!r} returned {text}; it must give a number of "
                               f"FLOPs >= 0{where}", op=op.name, step=st.index, field="cost")
    return int(flops)


def _scratch(st: ResolvedStep) -> int:
    specs = list(st.in_specs.values()) + list(st.out_specs.values())
    if st.op.alias or not any(s.dtype in _WIDENED for s in specs):
        return 0
    return 4 * sum(s.size for s in specs)


def estimate(plan: Plan) -> PlanCost:
    """The estimated cost of ``plan`` (pure; cheap next to planning).

    Raises:
        KernelInputError: an op's cost rule raised or gave no number of FLOPs (``field="cost"``, op and step set).
    """
    flops = 0
    produced = 0
    per_step = []
    for st in plan.steps:
        flops += _step_flops(st)
        produced += sum(s.nbytes for s in st.out_specs.values())
        per_step.append(produced + _scratch(st))
    touched = sum(s.nbytes for s in plan.inputs.values()) + produced
    return PlanCost(flops, touched, tuple(per_step))


def check_memory(plan: Plan, cost: PlanCost, limit_nbytes: int) -> None:
    """Refuse ``plan`` when a step takes its memory over ``limit_nbytes`` (0: no limit).

    Raises:
        KernelResourceError: naming the step, its op and the limit (``field="request_memory_limit"``).
    """
    if not limit_nbytes:
        return
    for st, nbytes in zip(plan.steps, cost.step_nbytes):
        if nbytes > limit_nbytes:
            raise KernelResourceError(
                f"step {st.index} ({st.op.name}) would bring this request's intermediates and outputs to "
                f"{_size(nbytes)}, over the worker's per-request limit of {_size(limit_nbytes)} "
                "(--request-memory-limit): split the request or ask the worker's owner to raise the limit",
                op=st.op.name, step=st.index, field="request_memory_limit")


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"
