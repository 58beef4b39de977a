"""How many bytes of outputs a call needs: asked of the worker (or learned from an answer) once per signature, then cached.

An op's shape rule is Python on the worker, so the client asks (a plan query, see
``shmrpc.schema.planquery``) the first time it calls an op or pipeline with given input
shapes, dtypes, attributes and kept outputs; the answer is cached for that signature, so a
steady stream of identical calls pays the question once. ``Client.call`` asks only when its
first call of a signature, sent with room for outputs as large as the inputs, was refused for
want of room; otherwise it learns the sizes from the answer (:meth:`OutputSizer.learn`). ``Client.call(out_nbytes=...)``
still wins when given (no question asked).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shmrpc.schema.control import Manage
from shmrpc.schema.errors import RequestError
from shmrpc.schema.layout import align_up, tensor_align
from shmrpc.schema.optable import OpEntry
from shmrpc.schema.planquery import decode_plan_answer, encode_plan_query

from ._caches import bounded_put
from ._pipeline import Pipeline, resolve

__all__ = ["OutputSizer", "placed_nbytes"]


def placed_nbytes(sizes: list[int]) -> int:
    """Bytes tensors of ``sizes`` take in a slot, each at its alignment (an upper bound of the worker's placing)."""
    return sum(align_up(n, tensor_align(n)) + tensor_align(n) for n in sizes)


class OutputSizer:
    """Output bytes per call signature, asked of the worker on a miss (``ask(Manage) -> its reply``)."""

    def __init__(self, ask: Callable[[Manage], Any]) -> None:
        self._ask = ask
        self._cache: dict[Any, int] = {}

    def __len__(self) -> int:
        return len(self._cache)

    @staticmethod
    def key(op: str | Pipeline, inputs: Mapping[str, tuple[tuple[int, ...], str]], resident: tuple[str, ...],
            attrs: Mapping[str, Any], keep: tuple[str, ...]) -> Any:
        """The signature's key: what the outputs' sizes may depend on."""
        return (op, tuple(inputs.items()), resident, tuple(sorted(((k, type(v), v) for k, v in attrs.items()),
                                                                   key=lambda kv: kv[0])), keep)

    def cached(self, op: str | Pipeline, inputs: Mapping[str, tuple[tuple[int, ...], str]], resident: tuple[str, ...],
               attrs: Mapping[str, Any], keep: tuple[str, ...]) -> tuple[Any, int | None]:
        """(the signature's key, the bytes known for it without asking: cached, asked or learned; else None)."""
        if isinstance(op, Pipeline) and op.outputs == ():
            return None, 0  # everything is kept on the worker (Client.put): nothing comes back
        key = self.key(op, inputs, resident, attrs, keep)
        return key, self._cache.get(key)

    def learn(self, key: Any, sizes: list[int]) -> int:
        """Cache (and return) the bytes to reserve for outputs of ``sizes`` bytes under ``key``: what the worker
        answered a question, or a call sent without one whose outputs fitted the room it guessed (``Client.call``)."""
        nbytes = placed_nbytes(sizes)
        bounded_put(self._cache, key, nbytes)
        return nbytes

    def out_nbytes(self, op_table: Mapping[str, OpEntry], op: str | Pipeline,
                   inputs: Mapping[str, tuple[tuple[int, ...], str]], resident: tuple[str, ...],
                   attrs: Mapping[str, Any], keep: tuple[str, ...]) -> int | None:
        """Bytes to reserve for the outputs of ``op`` over ``inputs`` (name -> (shape, dtype name)).

        Returns None when the worker refuses the plan (the call will fail; nothing is cached).
        Raises what resolving the op raises locally (UnknownOpError, InvalidRequestError).
        """
        key, hit = self.cached(op, inputs, resident, attrs, keep)
        return hit if hit is not None else self.ask(key, op_table, op, inputs, resident, attrs, keep)

    def ask(self, key: Any, op_table: Mapping[str, OpEntry], op: str | Pipeline,
            inputs: Mapping[str, tuple[tuple[int, ...], str]], resident: tuple[str, ...], attrs: Mapping[str, Any],
            keep: tuple[str, ...]) -> int | None:
        """:meth:`out_nbytes` of a signature whose bytes are not known (``key``: :meth:`cached`'s): asked."""
        steps, outputs = resolve(op_table, op, list(inputs), dict(attrs))
        want = [o for o in outputs if o not in keep]
        try:
            answer = decode_plan_answer(self._ask(encode_plan_query(steps, inputs, resident, want, keep)))
        except RequestError:
            # the request itself will be refused: send it anyway (sized as before), so the worker answers it
            # with the authoritative error and counts and logs it like any failed request
            return None
        from shmrpc.schema.dtypes import itemsize

        sizes = []
        for shape, dt in answer.values():
            n = itemsize(dt)
            for d in shape:
                n *= d
            sizes.append(n)
        return self.learn(key, sizes)
