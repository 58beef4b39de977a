"""The steady path of ``Client.call``: what a repeated call signature needs, worked out once.

A call's signature is everything that decides the slot's layout and the descriptor: the op (or
pipeline), each input's name, shape and NumPy dtype, the attributes with their types, ``in_place``,
``keep`` and ``out_nbytes``. The first call of a signature builds a :class:`CallPlan` (slot bytes,
every input's offset, the descriptor bytes); later calls look the plan up by the *whole* signature
(a dictionary key compared field by field, never a flag or a counter; :func:`steady_key` makes it in
one pass over the keywords) and only copy their bytes into the slot. The response is still checked
every time (see :func:`read_outputs`).

Nothing here does I/O; ``Client._call_now`` (the caller) takes the slot, rings and waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmrpc.schema import dtypes
from shmrpc.schema.descriptor import ResponseDesc, TensorRef
from shmrpc.schema.errors import RequestError, RequestTooLargeError
from shmrpc.schema.layout import align_up, tensor_align

from ._pipeline import ATTR_TYPES
from ._slot import Resident

__all__ = ["CallPlan", "PLAIN_ATTRS", "steady_key", "plan_inputs", "OutputCheck", "read_outputs", "outputs_did_not_fit"]

_NDARRAY = np.ndarray
# attribute values a key takes as they are, exactly of these types (anything else is array-like, a reference or
# refused: the general path sorts it)
PLAIN_ATTRS = frozenset(ATTR_TYPES)


@dataclass(frozen=True)
class CallPlan:
    """One call signature's slot layout and descriptor.

    Attributes:
        need: slot bytes (descriptor area, inputs, room for the outputs).
        writes: (offset, nbytes) of each input in the slot, in the order of the signature.
        tensors: the descriptor's input tensors (what a Loan would record).
        cursor: the slot offset after the last input (a Loan's cursor).
        desc: (descriptor bytes, op_code, header flags, output names), as ``Client._describe`` returns.
        soon: the descriptor and inputs end near the slot's start (copied in within a few µs): such a call through
            an idle lane rings early (``ClientLane.soon``).
        fits: the largest slot a kept loan may have to serve this call (a small call does not hold a large slot).
        learn: None, or, when the room for the outputs is a guess, (the signature's ``OutputSizer`` key, its plan
            cache key or None): the first call of a signature is sent without asking the worker for the outputs'
            sizes, and its answer says them (``Client._learned``).
    """

    need: int
    writes: tuple[tuple[int, int], ...]
    tensors: tuple[TensorRef, ...]
    cursor: int
    desc: tuple[bytes, int, int, tuple[str, ...]]
    soon: bool
    fits: int
    learn: Any = None


def steady_key(op: Any, kwargs: dict[str, Any], in_place: bool, keep: Any, out_nbytes: int | None,
               residents: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
               ) -> tuple[tuple[Any, ...], list[np.ndarray]] | None:
    """The plan cache's key of a call and its arrays in the order given, in one pass over the keywords; None when a
    keyword is neither a NumPy array, a plain attribute value (int, float, bool or str) nor a :class:`Resident` whose
    shape and dtype ``residents`` records (the client's record of its resident tensors): that call goes the general
    way. An array of any strides is taken: the one copy into the slot reads it in C order (``view[...] = a``), so a
    strided or Fortran-ordered array is not first made contiguous by a copy of its own.

    The key holds, per keyword, its name and either the array's shape and NumPy dtype, the value with its type
    (``a=1``, ``a=1.0`` and ``a=True`` compare equal in Python but are encoded differently on the wire), or the
    resident tensor's name with the shape and dtype recorded for it now (a tensor put again with another shape gets
    another plan). Nothing here
    checks that the call is valid: a key gets a plan only once the first call of it was planned
    (``Client._plan_of``), and a call that one would refuse never gets one.
    """
    parts: list[Any] = [op, in_place, keep, out_nbytes]
    arrays: list[np.ndarray] = []
    for k, v in kwargs.items():
        t = type(v)
        if t is _NDARRAY:
            parts += (k, v.shape, v.dtype)
            arrays.append(v)
        elif t in PLAIN_ATTRS:
            parts += (k, t, v)
        elif t is Resident and residents is not None and (spec := residents.get(v.name)) is not None:
            parts += (k, t, v.name, spec)
        else:
            return None
    return tuple(parts), arrays


def plan_inputs(inputs: tuple[tuple[str, tuple[int, ...], str], ...], desc_nbytes: int
                ) -> tuple[tuple[tuple[int, int], ...], tuple[TensorRef, ...], int]:
    """Offsets of ``inputs`` (name, shape, wire dtype) placed as ``Loan.array`` places them, one after another
    from the end of the descriptor area; returns (writes, tensors, cursor)."""
    cursor = desc_nbytes
    writes, tensors = [], []
    for name, shape, wire in inputs:
        nbytes = math.prod(shape) * dtypes.itemsize(wire)
        off = align_up(cursor, tensor_align(nbytes))
        writes.append((off, nbytes))
        tensors.append(TensorRef(name, wire, shape, off, nbytes))
        cursor = off + nbytes
    return tuple(writes), tuple(tensors), cursor


@dataclass(frozen=True)
class OutputCheck:
    """A response descriptor checked against the slot and the outputs asked for: (name, dtype, count, offset,
    shape) per output, ready to view."""

    outputs: tuple[tuple[str, np.dtype, int, int, tuple[int, ...]], ...]


def read_outputs(resp: ResponseDesc, asked: tuple[str, ...], slot_nbytes: int) -> OutputCheck:
    """Check a (successful) response's outputs: the names asked for in order, each inside the slot, each
    shape and dtype making its byte count.

    Raises:
        RequestError: naming the field that is wrong (``outputs``, ``offset``, ``shape``, ``dtype``).
    """
    if tuple(t.name for t in resp.outputs) != asked:  # the slot is shared: never trust what is read back
        raise RequestError(f"the response names outputs {[t.name for t in resp.outputs]}, not the "
                           f"{list(asked)} asked for", field="outputs")
    outs = []
    for t in resp.outputs:
        if t.offset < 0 or t.offset + t.nbytes > slot_nbytes:
            raise RequestError(f"output {t.name!r} lies outside the slot", tensor=t.name, field="offset")
        try:
            dt = dtypes.numpy_dtype(t.dtype)
        except (KeyError, ValueError, TypeError):
            raise RequestError(f"output {t.name!r} has an unknown dtype {t.dtype!r}", tensor=t.name,
                               field="dtype") from None
        if any(d < 0 for d in t.shape) or math.prod(t.shape) * dt.itemsize != t.nbytes:
            raise RequestError(f"output {t.name!r}: shape {t.shape} of {t.dtype} does not make {t.nbytes} bytes",
                               tensor=t.name, field="shape")
        outs.append((t.name, dt, t.nbytes // dt.itemsize, t.offset, tuple(t.shape)))
    return OutputCheck(tuple(outs))


def outputs_did_not_fit(e: BaseException) -> bool:
    """Whether ``e`` is the worker's refusal of a request whose outputs did not fit the room its slot left them
    (before anything ran): a request sent with a guessed room is sent again, asking first (``Client._call_guessed``,
    ``AsyncClient``'s answers)."""
    return isinstance(e, RequestTooLargeError) and e.field == "outputs"
