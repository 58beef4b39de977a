"""Requests of real shapes (``--shape NAME=16x256``): checking them, their bytes, their payloads.

Without ``--shape`` every input of the op gets a 1-D payload of ``--sizes`` bytes. With it, each named
input of ``--op`` gets its own shape (all of ``--dtype``), and the run has one size: the request's
bytes (all inputs together), which is what the peers (pyzmq ...) then move each way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._transport import payload_of

__all__ = ["check_shapes", "shapes_nbytes", "shaped_payload", "shapes_label"]


def shapes_nbytes(shapes: Mapping[str, tuple[int, ...]], dtype: str) -> int:
    """Bytes of all the inputs of ``shapes`` in ``dtype`` together (the request's payload)."""
    return sum(math.prod(s) for s in shapes.values()) * np.dtype(dtype).itemsize


def shapes_label(shapes: Mapping[str, tuple[int, ...]], dtype: str) -> str:
    """``"x=16x256, w=256x256 float16"``: the request in a table title or a plot's."""
    return ", ".join(f"{n}={'x'.join(map(str, s))}" for n, s in shapes.items()) + f" {dtype}"


def check_shapes(op: str, shapes: Mapping[str, tuple[int, ...]], dtype: str,
                 attrs: Mapping[str, Any] | None = None) -> None:
    """Refuse, before any process starts, shapes that ``op`` cannot take.

    An op this process knows (the built-ins, ``shmrpc.kernels``) must get a shape for each of its inputs
    and for nothing else, and its shape rule must accept them; an op it does not know (a user's op on a
    worker given with ``--name``) is left to the worker.

    Raises:
        ValueError: naming the input (or the op's rule's complaint).
    """
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise ValueError(f"--dtype {dtype!r} is not a NumPy dtype") from None
    try:
        from shmrpc import kernels
    except ImportError:  # pragma: no cover - the bench tool ships with the kernels
        return
    spec = kernels.REGISTRY.get(op)
    if spec is None:
        return
    missing = [n for n in spec.inputs if n not in shapes]
    extra = [n for n in shapes if n not in spec.inputs]
    if missing or extra:
        raise ValueError(f"--shape: op {op!r} takes inputs {', '.join(spec.inputs)}; "
                         + (f"no shape for {', '.join(missing)}" if missing else "")
                         + ("; " if missing and extra else "")
                         + (f"it has no input {', '.join(extra)}" if extra else ""))
    if spec.infer is None:
        return
    try:
        spec.rule({n: kernels.TensorSpec(tuple(s), dt.name) for n, s in shapes.items()}, dict(attrs or {}))
    except Exception as exc:  # noqa: BLE001 - the op's own words, as a usage error
        raise ValueError(f"--shape: op {op!r} refuses {shapes_label(shapes, dtype)}: {exc}") from None


def shaped_payload(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """A deterministic input of ``shape``: :func:`payload_of`'s items (small finite values for floating dtypes: no
    NaN, no subnormals, which would time other arithmetic than a user's)."""
    n = math.prod(shape)
    return payload_of(n * np.dtype(dtype).itemsize, dtype).reshape(shape)
