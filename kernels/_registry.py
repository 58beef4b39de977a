"""The op registry: specs of tensors, attributes, ops and pipeline steps, and the op table.

Each op module (``elementwise``, ``norm``, ``matmul``, ``quant``) builds :class:`OpSpec`
objects and calls :func:`register`. An op's implementations (``numpy`` and ``cupy``)
share one calling convention, :class:`OpCall`::

    impl(call: OpCall) -> dict[str, array]      # output param -> array

``call.inputs`` are arrays of the backend (bfloat16 as uint16 bits), ``call.out`` holds,
per output param, a destination array the impl may write into (or ``None``), and
``call.xp`` is ``numpy`` or ``cupy``. An impl returns its outputs; returning the very
destination array means "written in place", anything else is copied by the backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._dtypes import DTYPE_NAMES, itemsize
from ._errors import KernelInputError

__all__ = [
    "REQUIRED",
    "TensorSpec",
    "AttrSpec",
    "OpSpec",
    "StepSpec",
    "OpCall",
    "REGISTRY",
    "register",
    "op_table",
    "USER_CODE_MIN",
    "USER_CODE_MAX",
]


class _Required:
    """Sentinel type of :data:`REQUIRED`."""

    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED: Any = _Required()
"""Default of an attribute that every step must give."""


def _with_article(word: str) -> str:
    """``word`` after its indefinite article, by its first letter: "a float", "an int"."""
    return f"{'an' if word[:1].lower() in ('a', 'e', 'i', 'o', 'u') else 'a'} {word}"


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype name of a tensor, e.g. ``TensorSpec((4, 8), "float16")``."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.dtype not in DTYPE_NAMES:
            raise KernelInputError(f"unknown dtype {self.dtype!r}; use one of {', '.join(DTYPE_NAMES)}", field="dtype")
        if any(d < 0 for d in self.shape):
            raise KernelInputError(f"negative dimension in shape {self.shape}", field="shape")

    @property
    def size(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.size * itemsize(self.dtype)


@dataclass(frozen=True)
class AttrSpec:
    """An op attribute: ``kind`` in "float", "int", "str", "bool"; ``default`` or :data:`REQUIRED`."""

    kind: str
    default: Any = REQUIRED

    @property
    def required(self) -> bool:
        """True when steps must give this attribute."""
        return self.default is REQUIRED

    def coerce(self, value: Any, *, attr: str, op: str, step: int) -> Any:
        """Check ``value`` against ``kind`` and return it as that Python type; raises KernelInputError."""
        ok: bool
        if self.kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            conv: Callable[[Any], Any] = float
        elif self.kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
            conv = int
        elif self.kind == "bool":
            ok = isinstance(value, bool)
            conv = bool
        else:
            ok = isinstance(value, str)
            conv = str
        if not ok:
            raise KernelInputError(
                f"attribute {attr!r} must be {_with_article(self.kind)}, got {type(value).__name__}",
                op=op, step=step, field=attr,
            )
        return conv(value)


InferFn = Callable[[Mapping[str, TensorSpec], Mapping[str, Any]], dict[str, TensorSpec]]
#: ``cost(in_specs, out_specs, attrs) -> FLOPs`` of one step (see :mod:`shmrpc.kernels._cost`).
CostFn = Callable[[Mapping[str, TensorSpec], Mapping[str, TensorSpec], Mapping[str, Any]], int]
ImplFn = Callable[["OpCall"], dict[str, Any]]
#: ``maker(inputs, dests, in_specs, attrs)``: see :data:`NUMPY_BOUND`.
BoundFormFn = Callable[[Mapping[str, Any], Mapping[str, Any], Mapping[str, "TensorSpec"], Mapping[str, Any]],
                       "Callable[[], Any] | None"]

#: Built-in NumPy implementations that have a form bound to fixed views, for the NumPy backend's bound runs (a
#: slot's repeated requests): implementation -> ``maker(inputs, dests, in_specs, attrs)``, which returns a
#: callable of no arguments doing exactly what the implementation does over those arrays (the same NumPy calls,
#: writing into ``dests["out"]``), or None where the implementation itself must run. Keyed by the function,
#: so an op whose implementation is replaced loses its bound form; users' ops have none.
NUMPY_BOUND: dict[ImplFn, BoundFormFn] = {}


@dataclass(frozen=True)
class OpSpec:
    """One op: its wire ``code``, parameters, shape/dtype rule and implementations.

    Public through :mod:`shmrpc.kernels.api`, which documents every field and checks a spec
    when it is registered (:func:`shmrpc.kernels.api.register_op`); built-in ops are defined
    the same way. In short: ``infer(inputs, attrs)`` returns the output specs or raises
    KernelInputError naming the tensor parameter and the field; ``numpy`` and ``cupy`` are
    the implementations (either may be None; :attr:`backends` lists those present);
    ``inplace``/``alias``/``elementwise`` are what the backends may assume; ``mutates``
    names resident inputs the op updates in place (a session's KV cache); ``tolerances``
    maps dtype -> (rtol, atol); ``example`` gives small input specs for warmup and tests;
    ``cost`` estimates FLOPs (None: the generic rule of :mod:`shmrpc.kernels._cost`);
    ``batch``: the implementations accept one extra leading (batch) axis on every tensor
    that is not resident, and return their outputs with it (see :mod:`shmrpc.kernels._batch`).
    ``code`` 0 asks :func:`~shmrpc.kernels.api.register_op` to derive one from the name.
    """

    name: str
    code: int = 0
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    attrs: Mapping[str, AttrSpec] = field(default_factory=dict)
    infer: InferFn | None = None
    numpy: ImplFn | None = None
    cupy: ImplFn | None = None
    inplace: bool = False
    alias: bool = False
    elementwise: bool = False
    tolerances: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    doc: str = ""
    example: Mapping[str, TensorSpec] = field(default_factory=dict)
    cost: CostFn | None = None
    mutates: tuple[str, ...] = ()
    budget_s: float = 0.0
    module: str = ""
    batch: bool = False

    def __post_init__(self) -> None:
        for f in ("inputs", "outputs", "mutates"):  # a lone string (``("x_in")``, the comma left out) stays one:
            value = getattr(self, f)  # register_op refuses it by name rather than take its characters as names
            if not isinstance(value, str):
                object.__setattr__(self, f, tuple(value))
        if not 0 <= self.code <= 0xFFFF:
            raise ValueError(f"op code {self.code} of {self.name!r} is not a u16")

    @property
    def backends(self) -> tuple[str, ...]:
        """The backends this op has an implementation for, of ``("numpy", "cupy")``."""
        return tuple(b for b in ("numpy", "cupy") if getattr(self, b) is not None)

    @property
    def builtin(self) -> bool:
        """True for the ops shipped in ``shmrpc.kernels``."""
        return self.code < USER_CODE_MIN

    def rule(self, inputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> dict[str, TensorSpec]:
        """The output specs of one call (the shape/dtype rule); raises KernelInputError."""
        assert self.infer is not None  # register_op refuses a spec without one
        return self.infer(inputs, attrs)


#: Op codes below this are the built-in ops'; users' ops take codes in [USER_CODE_MIN, USER_CODE_MAX].
USER_CODE_MIN = 0x1000
USER_CODE_MAX = 0xFFFF


@dataclass(frozen=True)
class StepSpec:
    """One pipeline step: ``op`` with its params bound to request tensor names, and attrs.

    Example: ``StepSpec("scale", {"x": "a"}, {"out": "b"}, {"a": 2.0})``.
    Output params left unbound get internal names nobody can ask for.
    """

    op: str
    inputs: Mapping[str, str]
    outputs: Mapping[str, str]
    attrs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True, init=False)
class OpCall:
    """What an implementation gets: arrays, their specs, filled attrs, destinations, ``xp``.

    ``workspace`` defaults to a new empty dict. One is made per run of every request, so ``__init__`` is
    written out (a dataclass's generated one runs its default factory through more Python).
    """

    xp: Any
    inputs: dict[str, Any]
    in_specs: Mapping[str, TensorSpec]
    out_specs: Mapping[str, TensorSpec]
    attrs: Mapping[str, Any]
    out: dict[str, Any | None]
    workspace: dict[str, Any]

    def __init__(self, xp: Any, inputs: dict[str, Any], in_specs: Mapping[str, TensorSpec],
                 out_specs: Mapping[str, TensorSpec], attrs: Mapping[str, Any], out: dict[str, Any | None],
                 workspace: dict[str, Any] | None = None) -> None:
        self.xp, self.inputs, self.in_specs, self.out_specs = xp, inputs, in_specs, out_specs
        self.attrs, self.out = attrs, out
        self.workspace = {} if workspace is None else workspace

    def dest(self, param: str) -> Any | None:
        """The destination array for output ``param``, or None (allocate your own)."""
        return self.out.get(param)


REGISTRY: dict[str, OpSpec] = {}
"""name -> OpSpec of every registered op."""

_CODES: dict[int, str] = {}


def _where(spec: OpSpec) -> str:
    return f"op {spec.name!r} (code {spec.code}{', module ' + spec.module if spec.module else ''})"


def register(spec: OpSpec) -> OpSpec:
    """Add a checked ``spec`` to :data:`REGISTRY` (see ``api.register_op``, which checks it first).

    Raises:
        ValueError: the name or the code is taken; the message names both ops.
    """
    other = REGISTRY.get(spec.name)
    if other is None and spec.code in _CODES:
        other = REGISTRY[_CODES[spec.code]]
    if other is not None:
        what = "name" if other.name == spec.name else "code"
        raise ValueError(f"{_where(spec)} and {_where(other)} share a {what}; give one of them another "
                         f"{'name' if what == 'name' else 'code= in ' + hex(USER_CODE_MIN) + '..' + hex(USER_CODE_MAX)}")
    REGISTRY[spec.name] = spec
    _CODES[spec.code] = spec.name
    return spec


def unregister(name: str) -> None:
    """Remove op ``name`` from the registry (tests that define throwaway ops)."""
    spec = REGISTRY.pop(name)
    _CODES.pop(spec.code, None)


def op_table() -> dict[str, dict[str, Any]]:
    """The JSON-able op table the worker announces at handshake, as plain data.

    Its format is the schema's (``shmrpc.schema.optable``, which kernels do not import): the worker
    checks it through ``parse_op_table``, and tests/test_contract.py keeps the two in step.

    Returns ``{name: {"code", "inputs", "outputs", "attrs": {a: {"kind", "default", "required"}},
    "inplace", "alias", "doc", "backends"}}`` sorted by code. Example::

        >>> op_table()["scale"]["attrs"]["a"]
        {'kind': 'float', 'default': 1.0, 'required': False}
    """
    table: dict[str, dict[str, Any]] = {}
    for spec in sorted(REGISTRY.values(), key=lambda s: s.code):
        table[spec.name] = {
            "code": spec.code,
            "inputs": list(spec.inputs),
            "outputs": list(spec.outputs),
            "attrs": {
                a: {"kind": s.kind, "default": None if s.required else s.default, "required": s.required}
                for a, s in spec.attrs.items()
            },
            "inplace": spec.inplace,
            "alias": spec.alias,
            "doc": spec.doc,
            "backends": list(spec.backends),
        }
    return table


def replace_impl(name: str, **changes: Any) -> OpSpec:
    """Swap fields of a registered spec (tests, experiments); returns the new spec."""
    spec = dataclasses.replace(REGISTRY[name], **changes)
    REGISTRY[name] = spec
    return spec
