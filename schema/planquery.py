"""The "plan" query: a client asks the worker what outputs a request would produce, before it sends one.

Why: an op's shape rule is Python on the worker (users' ops included), which the client cannot
run, yet the client must choose a slot big enough for inputs *and* outputs before it writes a
byte. So the first call of each signature (ops, attributes, input shapes and dtypes) asks once;
the answer is cached on the client for that signature, and later calls cost nothing extra.

On the wire it is a MANAGE (``M``, :class:`~shmrpc.schema.control.Manage`) with action ``"plan"``,
answered by MANAGED (``m``) or ERROR (the error the call itself would get, naming the op, step and
field), both echoing the MANAGE's ``id`` like every control reply::

    M {"action": "plan", "id": int,
       "steps":   [[op, {param: tensor}, {param: tensor}, {attr: value}], ...],
       "inputs":  {tensor: [shape, dtype]},            # resident inputs included
       "resident": [tensor, ...],                       # which inputs are resident tensors
       "outputs": [tensor, ...], "keep": [tensor, ...]}
    m {"id": int, "outputs": {tensor: [shape, dtype]}}  # the requested outputs, in order

The answer is advice for sizing: the worker still validates the real request in full.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .control import Manage, Managed
from .descriptor import StepDesc
from .dtypes import DTYPE_CODES

__all__ = ["PlanQuery", "encode_plan_query", "decode_plan_query", "encode_plan_answer", "decode_plan_answer"]

_MAX_STEPS = 64
_MAX_TENSORS = 256


@dataclass(frozen=True)
class PlanQuery:
    """A decoded plan query (see the module docstring)."""

    steps: tuple[tuple[str, dict[str, str], dict[str, str], dict[str, Any]], ...]
    inputs: dict[str, tuple[tuple[int, ...], str]]
    resident: tuple[str, ...]
    outputs: tuple[str, ...]
    keep: tuple[str, ...]


def encode_plan_query(steps: Sequence[StepDesc], inputs: Mapping[str, tuple[tuple[int, ...], str]],
                      resident: Sequence[str], outputs: Sequence[str], keep: Sequence[str]) -> Manage:
    """The MANAGE asking for the outputs of ``steps`` over ``inputs`` (name -> (shape, dtype)); the caller sets its id."""
    return Manage("plan", steps=[[s.op, dict(s.inputs), dict(s.outputs), dict(s.attrs)] for s in steps],
                  inputs={n: [list(shape), dt] for n, (shape, dt) in inputs.items()},
                  resident=list(resident), outputs=list(outputs), keep=list(keep))


def _names(obj: Any, key: str) -> tuple[str, ...]:
    v = obj.get(key, [])
    if not isinstance(v, list) or len(v) > _MAX_TENSORS or not all(isinstance(x, str) for x in v):
        raise ValueError(f"plan query: {key} must be a list of names")
    return tuple(v)


def _binding(v: Any, where: str) -> dict[str, str]:
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise ValueError(f"plan query: {where} must be an object of param -> tensor name")
    return dict(v)


def decode_plan_query(msg: Manage) -> PlanQuery:
    """Check a plan query's contents; raises ValueError naming the key at fault."""
    obj = msg.to_json()
    raw_steps = obj.get("steps")
    if not isinstance(raw_steps, list) or not 0 < len(raw_steps) <= _MAX_STEPS:
        raise ValueError(f"plan query: steps must be a list of 1..{_MAX_STEPS} steps")
    steps = []
    for i, st in enumerate(raw_steps):
        if not isinstance(st, list) or len(st) != 4 or not isinstance(st[0], str) or not isinstance(st[3], dict):
            raise ValueError(f"plan query: steps[{i}] must be [op, inputs, outputs, attrs]")
        steps.append((st[0], _binding(st[1], f"steps[{i}].inputs"), _binding(st[2], f"steps[{i}].outputs"), dict(st[3])))
    raw_inputs = obj.get("inputs")
    if not isinstance(raw_inputs, dict) or len(raw_inputs) > _MAX_TENSORS:
        raise ValueError("plan query: inputs must be an object of tensor -> [shape, dtype]")
    inputs = {}
    for n, v in raw_inputs.items():
        if (not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], list) or v[1] not in DTYPE_CODES
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 62 for d in v[0])
                or len(v[0]) > 32):
            raise ValueError(f"plan query: inputs[{n!r}] must be [shape (list of sizes), dtype name]")
        inputs[str(n)] = (tuple(v[0]), str(v[1]))
    return PlanQuery(tuple(steps), inputs, _names(obj, "resident"), _names(obj, "outputs"), _names(obj, "keep"))


def encode_plan_answer(outputs: Mapping[str, tuple[tuple[int, ...], str]], id: int | None = None) -> bytes:
    """The MANAGED frame answering a plan query (``id`` echoes the query's)."""
    return Managed(outputs={n: [list(shape), dt] for n, (shape, dt) in outputs.items()}, id=id).encode()


def decode_plan_answer(reply: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of the outputs a plan answer (MANAGED) lists; raises ValueError when malformed."""
    outs = reply.outputs if isinstance(reply, Managed) else None
    if not isinstance(outs, dict):
        raise ValueError("plan answer: outputs must be an object")
    got = {}
    for n, v in outs.items():
        if not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], list) or v[1] not in DTYPE_CODES:
            raise ValueError(f"plan answer: outputs[{n!r}] must be [shape, dtype]")
        got[str(n)] = (tuple(int(d) for d in v[0]), str(v[1]))
    return got
