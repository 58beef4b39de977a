"""shmrpc.kernels: the op registry and the NumPy / CuPy backends that run pipelines of ops.

Sees arrays only: no FlatBuffers, no ZeroMQ, no shmrpc.schema. CuPy is imported only
when the CuPy backend is selected, so ``import shmrpc.kernels`` works without it.

Ops are defined with the public op API, :mod:`shmrpc.kernels.api` (``OpSpec``,
``register_op``), built-in ones included; :mod:`shmrpc.kernels.testing` checks an op's
implementations against each other and a reference (``check_parity``).

Example::

    >>> import numpy as np
    >>> from shmrpc.kernels import select_backend, StepSpec, TensorSpec
    >>> be = select_backend("numpy")
    >>> plan = be.plan([StepSpec("scale", {"x": "a"}, {"out": "b"}, {"a": 2.0, "b": 1.0})],
    ...                {"a": TensorSpec((3,), "float32")}, ["b"])
    >>> out = np.empty(3, np.float32)
    >>> _ = be.run(plan, {"a": np.arange(3, dtype=np.float32)}, {"b": out})
    >>> out.tolist()
    [1.0, 3.0, 5.0]
"""

from __future__ import annotations

from . import elementwise, matmul, norm, quant  # noqa: F401  (registers the ops)
from ._backend_base import Backend
from ._cost import PlanCost, check_memory, estimate
from ._errors import (
    BackendUnavailable,
    KernelFatalError,
    KernelInputError,
    KernelResourceError,
    KernelRuntimeError,
    OpError,
)
from ._plan import Plan, ResolvedStep
from ._registry import REGISTRY, REQUIRED, AttrSpec, OpCall, OpSpec, StepSpec, TensorSpec, op_table

__all__ = [
    "REGISTRY",
    "REQUIRED",
    "OpSpec",
    "AttrSpec",
    "TensorSpec",
    "StepSpec",
    "OpCall",
    "Plan",
    "ResolvedStep",
    "PlanCost",
    "estimate",
    "check_memory",
    "Backend",
    "OpError",
    "KernelInputError",
    "KernelResourceError",
    "KernelRuntimeError",
    "KernelFatalError",
    "BackendUnavailable",
    "select_backend",
    "op_table",
]


def select_backend(kind: str = "auto", *, resident_limit_bytes: int | None = None, device: int = 0) -> Backend:
    """Make the backend that runs pipelines.

    Parameters
    ----------
    kind: "auto" (CuPy when it imports and sees a GPU, else NumPy), "numpy" or "cupy".
    resident_limit_bytes: cap on bytes held by resident tensors (None: no cap).
    device: CUDA device ordinal (CuPy only).

    Returns a :class:`Backend`. Raises BackendUnavailable for "cupy" without CuPy or a GPU,
    ValueError for an unknown kind. Example: ``be = select_backend("auto", resident_limit_bytes=8 << 30)``.
    """
    if kind not in ("auto", "numpy", "cupy"):
        raise ValueError(f"unknown backend {kind!r}; use 'auto', 'numpy' or 'cupy'")
    if kind in ("auto", "cupy"):
        try:
            from ._backend_cupy import CupyBackend

            return CupyBackend(resident_limit_bytes=resident_limit_bytes, device=device)
        except BackendUnavailable:
            if kind == "cupy":
                raise
    from ._backend_numpy import NumpyBackend

    return NumpyBackend(resident_limit_bytes=resident_limit_bytes)
