"""Pipelines: several registered ops chained in one request, intermediates kept by the worker."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmrpc.schema.descriptor import StepDesc
from shmrpc.schema.errors import InvalidRequestError, UnknownOpError
from shmrpc.schema.optable import OpEntry, fits_kind, with_article

__all__ = ["Pipeline", "resolve", "check_attrs", "plain_attrs", "ATTR_TYPES"]

# what an attribute value may be (schema/descriptor.py encodes these four; a NumPy scalar is first made the Python
# value it holds: plain_attrs)
ATTR_TYPES = (bool, int, float, str)
_FLOAT_INT_MAX = int(1.7976931348623157e308)  # the largest int a float64 holds


@dataclass(frozen=True)
class _Step:
    op: str
    inputs: tuple[tuple[str, str], ...] | None
    outputs: tuple[tuple[str, str], ...] | None
    attrs: tuple[tuple[str, Any], ...]


class Pipeline:
    """A chain of ops run in one request; only the final outputs come back.

    Binding rules, when ``inputs``/``outputs`` are not given: a step's first parameter takes the
    previous step's first output (the first step's takes the request tensor of the same name),
    its other parameters take request tensors of the same names, and step ``i``'s outputs are
    named ``"{i}.{param}"``. The pipeline returns the last step's outputs unless ``outputs`` is set.

    Example::

        p = Pipeline().then("scale", a=2.0).then("vector_add", inputs={"x": "0.out", "y": "y"})
        out = client.call(p, x=a, y=b)["1.out"]
    """

    def __init__(self, outputs: tuple[str, ...] | None = None) -> None:
        self.steps: tuple[_Step, ...] = ()
        self.outputs = outputs

    def then(self, op: str, *, inputs: dict[str, str] | None = None, outputs: dict[str, str] | None = None,
             **attrs: Any) -> Pipeline:
        """A new pipeline with one more step.

        Raises:
            InvalidRequestError: an attribute value that is not a bool, int, float or str (``field``: its name).
        """
        attrs = plain_attrs(attrs)
        check_attrs(op, attrs, len(self.steps))
        p = Pipeline(self.outputs)
        p.steps = self.steps + (_Step(op, tuple(inputs.items()) if inputs is not None else None,
                                      tuple(outputs.items()) if outputs is not None else None,
                                      tuple(sorted(attrs.items()))),)
        return p

    def _key(self) -> Any:
        # attribute values with their types: a=1 and a=True are equal in Python, not on the wire
        return (tuple((s.op, s.inputs, s.outputs, tuple((k, type(v), v) for k, v in s.attrs)) for s in self.steps),
                self.outputs)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Pipeline) and self._key() == other._key()


def check_attrs(op: str | Pipeline, attrs: Mapping[str, Any], step: int = -1) -> None:
    """Refuse an attribute value that cannot travel, before it is encoded or used in a cache key: an attribute is a
    bool, int, float or str.

    Raises:
        InvalidRequestError: naming the attribute (``field``) and its type.
    """
    for k, v in attrs.items():
        if not isinstance(v, ATTR_TYPES):
            raise InvalidRequestError(f"attribute {k!r} is a {type(v).__name__}: an attribute is a bool, int, float "
                                      "or str", op=op if isinstance(op, str) else "", step=step, field=k)


def plain_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """``attrs`` with each NumPy scalar made the Python value it holds (``a=x.max()`` gives a ``np.float32``): a
    NumPy scalar is an attribute value, not a tensor (``_interop.is_array_like``); ``attrs`` itself when it has none."""
    for v in attrs.values():
        if isinstance(v, np.generic):
            return {k: v.item() if isinstance(v, np.generic) else v for k, v in attrs.items()}
    return attrs


def _attrs(spec: OpEntry, op: str, step: int, given: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    out = []
    for k, v in given.items():
        a = spec.attrs.get(k)
        if a is None:
            raise InvalidRequestError(f"op {op!r} has no attribute or input {k!r} (it takes inputs "
                                      f"{list(spec.inputs)} and attributes {sorted(spec.attrs)})",
                                      op=op, step=step, field=k)
        if not fits_kind(a.kind, v):  # (an int for a float attribute travels as a float)
            raise InvalidRequestError(f"attribute {k!r} of op {op!r} takes {with_article(a.kind)}, got "
                                      f"{type(v).__name__} {v!r:.40}", op=op, step=step, field=k)
        if (a.kind == "float" and isinstance(v, int) and abs(v) > _FLOAT_INT_MAX) or \
                (a.kind == "int" and isinstance(v, int) and not -(1 << 63) <= v < 1 << 63):
            raise InvalidRequestError(f"attribute {k!r} of op {op!r}: {v!r:.30} is out of the wire's range "
                                      f"({'int64' if a.kind == 'int' else 'float64'})", op=op, step=step, field=k)
        if a.kind == "float" and isinstance(v, int):
            v = float(v)
        out.append((k, v))
    return tuple(out)


def _unbound(op: str | Pipeline, tensors: list[str], steps: list[StepDesc], spec: OpEntry | None) -> None:
    """Refuse a request tensor that no step reads: a keyword the op does not take as an input would be sent and
    ignored (an array given for an attribute, ``a=np.array(2.0)``, or a misspelt input), and the call would run
    without it."""
    bound = {t for s in steps for _, t in s.inputs}
    for name in tensors:
        if name in bound:
            continue
        where = op if isinstance(op, str) else "the pipeline"
        if spec is not None and name in spec.attrs:
            raise InvalidRequestError(f"attribute {name!r} of op {op!r} was given an array: an attribute is a bool, "
                                      "int, float or str (pass a.item() or float(a))", op=str(op), step=0, field=name)
        made = {t for s in steps for _, t in s.outputs}  # a pipeline's steps' own outputs are not the caller's inputs
        ins = list(spec.inputs) if spec is not None else sorted(bound - made)
        raise InvalidRequestError(f"{where} reads no input {name!r} (its inputs: {ins})",
                                  op=op if isinstance(op, str) else "", tensor=name, field=name)


def resolve(op_table: Mapping[str, OpEntry], op: str | Pipeline, tensors: list[str],
            attrs: dict[str, Any]) -> tuple[list[StepDesc], list[str]]:
    """Steps of the request for ``op`` over request tensors ``tensors``, and the output names.

    Raises:
        UnknownOpError: an op not in the worker's table.
        InvalidRequestError: an attribute the op does not take, or an input left unbound.
    """
    if isinstance(op, str):
        spec = op_table.get(op)
        if spec is None:
            raise UnknownOpError(f"op {op!r} is not in the worker's op table ({sorted(op_table)})", op=op, field="op")
        missing = [p for p in spec.inputs if p not in tensors]
        if missing:
            raise InvalidRequestError(f"op {op!r} needs input {missing[0]!r}", op=op, step=0, tensor=missing[0],
                                      field=missing[0])
        step = StepDesc(op, spec.code, tuple((p, p) for p in spec.inputs),
                        tuple((p, p) for p in spec.outputs), _attrs(spec, op, 0, attrs))
        if len(tensors) > len(spec.inputs):
            _unbound(op, tensors, [step], spec)
        return [step], list(spec.outputs)
    if attrs:
        raise InvalidRequestError("attributes of a pipeline go on its steps", field=next(iter(attrs)))
    if not op.steps:
        raise InvalidRequestError("the pipeline has no steps", field="steps")
    steps: list[StepDesc] = []
    prev_out = ""
    for i, st in enumerate(op.steps):
        spec = op_table.get(st.op)
        if spec is None:
            raise UnknownOpError(f"op {st.op!r} is not in the worker's op table", op=st.op, step=i, field="op")
        if st.inputs is not None:
            ins = st.inputs
        else:
            ins = tuple((p, prev_out if (j == 0 and prev_out) else p) for j, p in enumerate(spec.inputs))
        outs = st.outputs if st.outputs is not None else tuple((p, f"{i}.{p}") for p in spec.outputs)
        steps.append(StepDesc(st.op, spec.code, ins, outs, _attrs(spec, st.op, i, dict(st.attrs))))
        prev_out = outs[0][1] if outs else ""
    _unbound(op, tensors, steps, None)
    outputs = list(op.outputs) if op.outputs is not None else [t for _, t in steps[-1].outputs]
    return steps, outputs
