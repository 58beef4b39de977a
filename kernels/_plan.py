"""Pipeline planning: check a list of steps against the registry and infer every tensor.

:func:`build_plan` is pure: the same arguments give an equal :class:`Plan`, and a Plan
is immutable, so the server may cache it (keyed by the descriptor bytes) and run it
from many threads at once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

from ._errors import KernelInputError, OpError, is_op_failure
from ._registry import REGISTRY, OpSpec, StepSpec, TensorSpec

__all__ = ["Plan", "ResolvedStep", "bounded_put", "build_plan", "kept_for_plan"]

T = TypeVar("T")


def kept_for_plan(store: dict[Any, tuple[Plan, Any]], key: Hashable, plan: Plan, make: Callable[[], T],
                  limit: int = 256) -> T:
    """``make()``'s value for ``plan``, kept in ``store`` under ``key`` (holding ``id(plan)``) with the plan itself, so
    that a key whose plan is gone and whose id came back is made again; the whole store is forgotten once it holds
    ``limit``. A plan never changes, so what is derived from it alone is made once per plan."""
    entry = store.get(key)
    if entry is not None and entry[0] is plan:
        return entry[1]  # type: ignore[no-any-return]
    value = make()
    bounded_put(store, key, (plan, value), limit)
    return value


def bounded_put(store: dict[Any, Any], key: Hashable, value: Any, limit: int) -> None:
    """``store[key] = value``, forgetting the whole store first when it holds ``limit`` entries: the bound of the
    kernels' memo stores, whose steady use has few keys (a stream of ever new ones gains nothing from keeping them)."""
    if len(store) >= limit:
        store.clear()
    store[key] = value


def _frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(d))


@dataclass(frozen=True)
class ResolvedStep:
    """A checked step: the op, bindings (param -> tensor name), filled attrs and all specs."""

    index: int
    op: OpSpec
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]
    attrs: Mapping[str, Any]
    in_specs: Mapping[str, TensorSpec]
    out_specs: Mapping[str, TensorSpec]


@dataclass(frozen=True)
class Plan:
    """A checked pipeline, ready for ``backend.run``.

    ``inputs``: request inputs (resident ones included) -> spec; ``resident``: request
    name -> resident name; ``outputs``: the requested outputs, in the order asked;
    ``keep``: outputs to store as resident tensors; ``tensors``: every tensor's spec;
    ``last_use``: tensor -> index of the last step reading it (-1: none).
    """

    steps: tuple[ResolvedStep, ...]
    inputs: Mapping[str, TensorSpec]
    resident: Mapping[str, str]
    outputs: Mapping[str, TensorSpec]
    keep: Mapping[str, TensorSpec]
    tensors: Mapping[str, TensorSpec]
    last_use: Mapping[str, int]

    @property
    def alias_only(self) -> bool:
        """True when every step is an alias op (nothing to compute)."""
        return all(s.op.alias for s in self.steps)

    @property
    def elementwise(self) -> bool:
        """True when every step is elementwise over one shape (backends may chunk the run)."""
        return bool(self.steps) and all(s.op.elementwise for s in self.steps)


def _resolve_step(i: int, step: StepSpec, tensors: dict[str, TensorSpec], resident: Mapping[str, str]) -> ResolvedStep:
    op = REGISTRY.get(step.op)
    if op is None:
        raise KernelInputError(f"unknown op {step.op!r}; the op table lists the known ones", op=step.op, step=i, field="op")
    for p in step.inputs:
        if p not in op.inputs:
            raise KernelInputError(f"op {op.name!r} has no input {p!r}; it takes {list(op.inputs)}", tensor=p, field="inputs")
    for p in step.outputs:
        if p not in op.outputs:
            raise KernelInputError(f"op {op.name!r} has no output {p!r}; it gives {list(op.outputs)}", tensor=p, field="outputs")
    in_specs: dict[str, TensorSpec] = {}
    for p in op.inputs:
        name = step.inputs.get(p)
        if name is None:
            raise KernelInputError(f"input {p!r} of op {op.name!r} is not bound to a tensor", tensor=p, field="inputs")
        if name not in tensors:
            raise KernelInputError(
                f"tensor {name!r} (input {p!r}) is neither a request input, a resident tensor nor an earlier step's output",
                tensor=p, field="inputs",
            )
        in_specs[p] = tensors[name]
    attrs: dict[str, Any] = {}
    for a in step.attrs:
        if a not in op.attrs:
            raise KernelInputError(f"op {op.name!r} has no attribute {a!r}; it takes {list(op.attrs)}", field=a)
    for a, aspec in op.attrs.items():
        if a in step.attrs:
            attrs[a] = aspec.coerce(step.attrs[a], attr=a, op=op.name, step=i)
        elif aspec.required:
            raise KernelInputError(f"attribute {a!r} of op {op.name!r} is required", field=a)
        else:
            attrs[a] = aspec.default
    try:
        out_specs = op.rule(MappingProxyType(in_specs), MappingProxyType(attrs))
    except OpError:
        raise
    except BaseException as e:  # noqa: BLE001 - a rule's bug (sys.exit() included) is the request's error, not the worker's
        if not is_op_failure(e):
            raise
        where = "" if op.builtin else f" (a bug in the op's module {op.module!r})"
        raise KernelInputError(f"the shape rule of op {op.name!r} raised {type(e).__name__}: {e}{where}",
                               field="infer") from e
    if not isinstance(out_specs, dict) or set(out_specs) != set(op.outputs) or \
            not all(isinstance(s, TensorSpec) for s in out_specs.values()):
        raise KernelInputError(f"the shape rule of op {op.name!r} returned {out_specs!r}; it must give a TensorSpec "
                               f"for each of its outputs {list(op.outputs)} (a bug in the op's module {op.module!r})",
                               field="infer")
    for p in op.mutates:
        name = step.inputs[p]
        if name not in resident:
            raise KernelInputError(f"op {op.name!r} updates its input {p!r} in place, so it must be bound to one of "
                                   f"your resident tensors; {name!r} is not one", tensor=p, field="resident")
    outputs: dict[str, str] = {}
    for p in op.outputs:
        name = step.outputs.get(p, f"#{i}.{p}")
        if name in tensors:
            raise KernelInputError(f"step output {name!r} redefines an existing tensor; give it a new name", tensor=p, field="outputs")
        outputs[p] = name
        tensors[name] = out_specs[p]
    return ResolvedStep(i, op, _frozen(dict(step.inputs)), _frozen(outputs), _frozen(attrs), _frozen(in_specs), _frozen(out_specs))


def build_plan(
    steps: Iterable[StepSpec],
    inputs: Mapping[str, TensorSpec],
    outputs: Iterable[str],
    keep: Iterable[str] = (),
    resident: Mapping[str, str] | None = None,
) -> Plan:
    """Check ``steps`` and infer every tensor; see ``Backend.plan`` for the contract.

    Raises KernelInputError with ``step``/``op`` set for step errors, and with
    ``field`` "outputs"/"keep"/"resident" for the request-level ones.
    """
    resident = dict(resident or {})
    for name in resident:
        if name not in inputs:
            raise KernelInputError(f"resident binding {name!r} has no TensorSpec among the inputs", tensor=name, field="resident")
    tensors: dict[str, TensorSpec] = {}
    for name, spec in inputs.items():
        if not isinstance(spec, TensorSpec):
            raise KernelInputError(f"input {name!r} needs a TensorSpec", tensor=name, field="dtype")
        tensors[name] = spec
    resolved: list[ResolvedStep] = []
    for i, step in enumerate(steps):
        try:
            resolved.append(_resolve_step(i, step, tensors, resident))
        except OpError as e:
            raise e.with_context(op=step.op, step=i) from None
    out_names = list(outputs)
    keep_names = list(keep)
    if not out_names and not keep_names:
        raise KernelInputError("the request asks for no outputs", field="outputs")
    for kind, names in (("outputs", out_names), ("keep", keep_names)):
        seen: set[str] = set()
        for name in names:
            if name not in tensors or name.startswith("#"):
                raise KernelInputError(f"requested {kind[:-1] if kind == 'outputs' else 'kept'} tensor {name!r} is not produced by any step",
                                       tensor=name, field=kind)
            if name in seen:
                raise KernelInputError(f"tensor {name!r} is asked for twice", tensor=name, field=kind)
            seen.add(name)
    last_use: dict[str, int] = {name: -1 for name in tensors}
    for st in resolved:
        for name in st.inputs.values():
            last_use[name] = st.index
    return Plan(
        steps=tuple(resolved),
        inputs=_frozen(inputs),
        resident=_frozen(resident),
        outputs=_frozen({n: tensors[n] for n in out_names}),
        keep=_frozen({n: tensors[n] for n in keep_names}),
        tensors=_frozen(tensors),
        last_use=_frozen(last_use),
    )
