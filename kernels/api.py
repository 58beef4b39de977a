"""The public op API: define an op in a normal Python module and the worker serves it.

An op is an :class:`OpSpec` given to :func:`register_op` when its module is imported. The
eleven built-in ops (``shmrpc.kernels.elementwise``, ``norm``, ``matmul``, ``quant``) are
defined exactly this way; a worker imports users' modules at start (``shmrpc serve --ops
MODULE`` or the ``shmrpc.ops`` entry-point group), before it announces its op table.

Example (a module ``myops.py``)::

    from shmrpc.kernels.api import OpSpec, OpCall, TensorSpec, register_op, require_float

    def _rule(inputs, attrs):                      # host-side: output specs from input specs
        require_float(inputs["x"], "x")
        return {"out": inputs["x"]}

    def _relu(call: OpCall):                       # one body for NumPy and CuPy (call.xp)
        return {"out": call.xp.maximum(call.inputs["x"], 0, out=call.dest("out"))}

    RELU = register_op(OpSpec("relu", inputs=("x",), outputs=("out",), infer=_rule,
                              numpy=_relu, cupy=_relu, elementwise=True,
                              tolerances={"float32": (0.0, 0.0)}, example={"x": TensorSpec((4, 8), "float32")}))

The fields of :class:`OpSpec`
-----------------------------

==============  =====================================================================
name            unique, 1..64 characters of ``[A-Za-z0-9_.]``, starting with a letter;
                not one of :data:`RESERVED_OP_NAMES` (the worker's own metrics labels)
code            the wire code. Built-in ops: explicit, below :data:`USER_CODE_MIN`.
                Users' ops: 0 (derived from the name, stable across starts) or an
                explicit code in [:data:`USER_CODE_MIN`, :data:`USER_CODE_MAX`]; two ops
                with one code stop the worker's start with both named
inputs/outputs   tensor parameter names, a tuple (``("x",)``; a lone string is refused); a
                pipeline step binds each to a tensor
attrs           attribute name -> :class:`AttrSpec` (``kind`` float/int/str/bool, default).
                No input, output or attribute may be one of :data:`RESERVED_NAMES` (the
                client's own keywords: ``copy``, ``keep``, ``timeout_s`` ...)
infer           ``infer(inputs: {param: TensorSpec}, attrs) -> {output: TensorSpec}``: the
                shape/dtype rule. The worker runs it before anything runs (validation),
                and clients ask the worker for it to size the outputs (no ``out_nbytes``).
                Raise :class:`KernelInputError` naming ``tensor`` and ``field``.
numpy / cupy    ``impl(call: OpCall) -> {output: array}``; either may be None. ``call.xp``
                is ``numpy`` or ``cupy``; one function may serve both. A CuPy impl may use
                any CuPy code (``ElementwiseKernel``, ``RawKernel``, ``RawModule``). Write
                into ``call.dest(p)`` when it is not None, or return new arrays. Each run gets
                a new ``OpCall`` (fields ``xp``, ``inputs``, ``in_specs``, ``out_specs``,
                ``attrs``, ``out``, ``workspace``; slotted: keep state in ``workspace``)
inplace         output 0 may be written over input 0 (request flag IN_PLACE)
alias           output 0 *is* input 0 (nothing computed)
elementwise     element i of every output depends on element i of the inputs only
mutates         input params the op updates in place; each must be bound to one of the
                caller's own resident tensors (a per-session KV cache, say). Every other
                input is read-only (NumPy backend: a write into one is the request's
                ``KernelRuntimeError``; CuPy cannot enforce it, ``check_parity`` finds it)
tolerances      dtype -> (rtol, atol) of an implementation against a float64 reference
                (used by :func:`shmrpc.kernels.testing.check_parity`)
example         small input specs: warmup runs the op once on them
cost            ``cost(in_specs, out_specs, attrs) -> FLOPs`` (a finite number >= 0);
                None: the generic rule. A user op without one never runs on the worker's
                loop thread
budget_s        a request of this op whose run takes longer is counted in the worker's
                ``shmrpc_over_budget_total{op}`` (0: the worker's ``--op-budget``)
batch           the implementations also accept every non-resident input with one more
                leading axis (a batch of requests of the same plan) and return every
                output with it; the worker may then serve concurrent requests of one
                plan with one call (:mod:`shmrpc.kernels._batch`). Default False
doc             one line for the op table
==============  =====================================================================

What the worker guarantees an op: its inputs have the shapes and dtypes the rule accepted,
every array it sees is one of its request's tensors (or the caller's resident ones), and
what it returns is checked against the rule (a missing output, a wrong shape or dtype is a
:class:`KernelRuntimeError` naming op, step and tensor). An exception inside the op, its shape
rule or its cost rule (any ``BaseException``: ``sys.exit()`` included) becomes a ``KernelError``
on the wire for that request; the worker goes on serving.
"""

from __future__ import annotations

import re
import sys

from ._common import (
    TOL_ELEMENTWISE,
    TOL_MATMUL,
    TOL_REDUCTION,
    require_dtype,
    require_float,
    require_ndim,
    require_same,
)
from ._dtypes import DTYPE_NAMES, FLOAT_DTYPES, from_float, to_float
from ._errors import KernelInputError, KernelResourceError, KernelRuntimeError, OpError
from ._registry import (
    REGISTRY,
    REQUIRED,
    USER_CODE_MAX,
    USER_CODE_MIN,
    AttrSpec,
    OpCall,
    OpSpec,
    TensorSpec,
    _with_article,
    register,
)

__all__ = [
    "OpSpec",
    "AttrSpec",
    "TensorSpec",
    "OpCall",
    "REQUIRED",
    "OpSpecError",
    "register_op",
    "user_code",
    "USER_CODE_MIN",
    "USER_CODE_MAX",
    "RESERVED_NAMES",
    "RESERVED_OP_NAMES",
    "registered",
    "OpError",
    "KernelInputError",
    "KernelRuntimeError",
    "KernelResourceError",
    "require_dtype",
    "require_float",
    "require_ndim",
    "require_same",
    "to_float",
    "from_float",
    "DTYPE_NAMES",
    "FLOAT_DTYPES",
    "TOL_ELEMENTWISE",
    "TOL_REDUCTION",
    "TOL_MATMUL",
]

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.]{0,63}$")
_PARAM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_KINDS = ("float", "int", "str", "bool")
_BUILTIN_MODULE = "shmrpc.kernels."

#: Names no input, output or attribute of an op may have: the client's own keyword parameters (``Client.call``'s
#: ``copy``, ``timeout_s``, ``out_nbytes``, ``in_place``, ``keep``; ``submit``'s ``_copy``; ``op`` and ``self``, its
#: positional ones; ``inputs`` and ``outputs``, those of ``Pipeline.then``). Every other keyword of a call is an input
#: or an attribute of the op, so an op attribute named ``copy`` would be taken by ``call()`` as its own option while
#: ``submit()`` passed it to the op.
RESERVED_NAMES = frozenset({"self", "op", "copy", "_copy", "timeout_s", "out_nbytes", "in_place", "keep", "inputs",
                            "outputs"})
#: Names no op may have: the worker's metrics label requests by op name, and by these for requests of another kind
#: (``pipeline``: several steps, ``put``: an upload, ``unknown``: a request refused before its op was known).
RESERVED_OP_NAMES = frozenset({"pipeline", "put", "unknown"})


class OpSpecError(ValueError):
    """An op's spec is invalid or clashes with another op's; the message names the op and the reason."""


def user_code(name: str) -> int:
    """The code a user op named ``name`` gets when it gives none: FNV-1a of the name folded into the user range."""
    h = 0x811C9DC5
    for b in name.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return USER_CODE_MIN + h % (USER_CODE_MAX - USER_CODE_MIN + 1)


def _check(spec: OpSpec, module: str, builtin: bool = False) -> OpSpec:
    import dataclasses

    def bad(why: str) -> OpSpecError:
        return OpSpecError(f"op {spec.name!r}: {why}")

    if not isinstance(spec.name, str) or not _NAME.match(spec.name):
        raise OpSpecError(f"op name {spec.name!r} must be 1..64 characters of [A-Za-z0-9_.], starting with a letter")
    if spec.name in RESERVED_OP_NAMES:
        raise bad(f"the worker's metrics count requests of another kind under {spec.name!r} "
                  f"(names no op may have: {', '.join(sorted(RESERVED_OP_NAMES))}); give it another name")
    for kind in ("inputs", "outputs", "mutates"):
        value = getattr(spec, kind)
        if isinstance(value, str):
            raise bad(f"{kind} must be a tuple of names, not the string {value!r} (for one name write "
                      f"{kind}=({value!r},), with the comma)")
    code = spec.code
    if builtin and not 1 <= code < USER_CODE_MIN:
        raise bad(f"a built-in op needs an explicit code in 1..{USER_CODE_MIN - 1}")
    if not builtin:
        if code == 0:
            code = user_code(spec.name)
        elif not USER_CODE_MIN <= code <= USER_CODE_MAX:
            raise bad(f"code {code} is outside the users' range {USER_CODE_MIN}..{USER_CODE_MAX} "
                      f"(0x{USER_CODE_MIN:X}..0x{USER_CODE_MAX:X}); give one inside it, or 0 to derive one from the name")
    for kind, params in (("inputs", spec.inputs), ("outputs", spec.outputs)):
        for p in params:
            if not isinstance(p, str) or not _PARAM.match(p):
                raise bad(f"{kind} name {p!r} must be an identifier of up to 64 characters")
            if p in RESERVED_NAMES:
                raise bad(_reserved(kind[:-1], p))
        if len(set(params)) != len(params):
            raise bad(f"{kind} {list(params)} names a parameter twice")
    if not spec.outputs:
        raise bad("it has no outputs")
    if set(spec.inputs) & set(spec.outputs):
        raise bad(f"{sorted(set(spec.inputs) & set(spec.outputs))} are both inputs and outputs")
    for a, s in spec.attrs.items():
        if not isinstance(a, str) or not _PARAM.match(a):
            raise bad(f"attribute name {a!r} must be an identifier")
        if a in RESERVED_NAMES:
            raise bad(_reserved("attribute", a))
        if not isinstance(s, AttrSpec) or s.kind not in _KINDS:
            raise bad(f"attribute {a!r} needs an AttrSpec of kind {', '.join(_KINDS)}")
        if not s.required:
            try:
                s.coerce(s.default, attr=a, op=spec.name, step=-1)
            except KernelInputError:
                raise bad(f"attribute {a!r}: default {s.default!r} is not {_with_article(s.kind)}") from None
    if not callable(spec.infer):
        raise bad("infer (the shape/dtype rule) must be a function (inputs, attrs) -> {output: TensorSpec}")
    if spec.numpy is None and spec.cupy is None:
        raise bad("it has neither a numpy nor a cupy implementation")
    for b in ("numpy", "cupy"):
        if getattr(spec, b) is not None and not callable(getattr(spec, b)):
            raise bad(f"its {b} implementation is not callable")
    if spec.cost is not None and not callable(spec.cost):
        raise bad("cost must be a function (in_specs, out_specs, attrs) -> FLOPs")
    for p in spec.mutates:
        if p not in spec.inputs:
            raise bad(f"mutates names {p!r}, which is not one of its inputs {list(spec.inputs)}")
    if spec.mutates and (spec.elementwise or spec.alias or spec.inplace):
        raise bad("an op that mutates a resident input can be neither elementwise, alias nor inplace")
    if (spec.inplace or spec.alias) and not spec.inputs:
        raise bad("inplace and alias need an input 0")
    for dt, tol in spec.tolerances.items():
        if dt not in DTYPE_NAMES or not (isinstance(tol, tuple) and len(tol) == 2 and all(
                isinstance(t, (int, float)) and t >= 0 for t in tol)):
            raise bad(f"tolerances[{dt!r}] must be a dtype name -> (rtol, atol) of non-negative numbers")
    for p, ex in spec.example.items():
        if p not in spec.inputs or not isinstance(ex, TensorSpec):
            raise bad(f"example[{p!r}] must be a TensorSpec of one of its inputs")
    if spec.example and set(spec.example) != set(spec.inputs):
        raise bad(f"example gives {sorted(spec.example)}, it needs every input {list(spec.inputs)}")
    if not (isinstance(spec.budget_s, (int, float)) and spec.budget_s >= 0):
        raise bad(f"budget_s must be a number of seconds >= 0, got {spec.budget_s!r}")
    if not isinstance(spec.doc, str):
        raise bad("doc must be a string")
    return dataclasses.replace(spec, code=code, module=module)


def _reserved(what: str, name: str) -> str:
    return (f"{what} {name!r} is named like a keyword of the client's own (Client.call, submit, Loan.send, "
            f"Pipeline.then), which would take it instead of the op; names no input, output or attribute may have: "
            f"{', '.join(sorted(RESERVED_NAMES))}")


def register_op(spec: OpSpec, *, module: str | None = None) -> OpSpec:
    """Check ``spec`` and add it to the registry the worker serves from.

    Parameters
    ----------
    spec: the op (see the module docstring for every field).
    module: the defining module's name, for messages and ``shmrpc status`` (default: the module that calls
        ``register_op``).

    An op is a built-in one (an explicit code below :data:`USER_CODE_MIN`) only when ``register_op`` is called from
    the modules of ``shmrpc.kernels``; every other is a users' op, whatever its implementations are (a users' op
    may reuse a built-in's: ``numpy=registered()["gelu"].numpy``).

    Returns the registered spec (its ``code`` filled in when it was 0).

    Raises
    ------
    OpSpecError: the spec is invalid, or its name or code is taken (naming both ops).

    Example::

        SQUARE = register_op(OpSpec("square", inputs=("x",), outputs=("out",), infer=lambda i, a: {"out": i["x"]},
                                    numpy=lambda c: {"out": c.xp.square(c.inputs["x"])}))
    """
    if not isinstance(spec, OpSpec):
        raise OpSpecError(f"register_op takes an OpSpec, got {type(spec).__name__}")
    caller = str(sys._getframe(1).f_globals.get("__name__", "") or "")
    if module is None:
        module = caller
    checked = _check(spec, module, builtin=caller.startswith(_BUILTIN_MODULE))
    try:
        return register(checked)
    except ValueError as e:
        raise OpSpecError(str(e)) from None


def registered() -> dict[str, OpSpec]:
    """name -> spec of every op this process has registered (built-in and users')."""
    return dict(REGISTRY)
