"""The call half of :class:`~._client.Client`: ``call()`` (its steady path and the kept loan), ``submit()``, and
what both need (the split of keyword arguments, the outputs' size, the descriptor bytes).

:class:`Calls` holds these methods; :class:`~._client.Client` owns the state they use (declared below) and the
slots, the connection and the control requests (docs/client.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from threading import get_ident
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from shmrpc.schema import dtypes
from shmrpc.schema.descriptor import RequestDesc, TensorRef, encode_request
from shmrpc.schema.errors import InvalidRequestError, RequestError, RequestTooLargeError
from shmrpc.schema.header import HEADER_NBYTES
from shmrpc.schema.layout import Geometry, align_up, tensor_align
from shmrpc.schema.optable import OpEntry

from ._caches import bounded_put
from ._callplan import PLAIN_ATTRS, CallPlan, outputs_did_not_fit, plan_inputs, steady_key
from ._desctemplate import DescTemplates
from ._inflight import Inflight
from ._interop import DeviceInput, as_input, is_array_like
from ._loan import CallFuture, Loan
from ._pipeline import Pipeline, check_attrs, plain_attrs, resolve
from ._sizing import OutputSizer
from ._slot import _FORKS, _GUESS, _IN_PLACE, _KEEP, Resident, _Slot
from ._trace import ClientTracing

if TYPE_CHECKING:
    from ._client import Client
    from ._connection import Connection

__all__ = ["Calls"]


class _NoSlot(Exception):
    """``_submit(nowait=True)`` would wait: no free slot of the client's own fits (``need``: the bytes it asks), or the
    request needs a reply of the worker first (a new signature's output sizes, a resident tensor's spec; ``need`` 0;
    ``asked``: the id of that question, sent already, when the client tells an event loop of its reply): the caller
    sends it later or from elsewhere."""

    def __init__(self, need: int = 0, asked: int = 0) -> None:
        Exception.__init__(self, need, asked)
        self.need, self.asked = need, asked


class Calls:
    """``call()`` and ``submit()``: the half of :class:`~._client.Client` this module holds."""

    timeout_s: float
    geometry: Geometry
    op_table: dict[str, OpEntry]
    _closed: bool
    _fork_gen: int
    _inflight: Inflight
    _tracing: ClientTracing | None
    _plans: dict[Any, CallPlan]
    _kept: list[Loan]
    _params: dict[str, frozenset[str]]
    _specs: dict[str, tuple[tuple[int, ...], np.dtype]]
    _desc_cache: dict[Any, tuple[bytes, int, int, tuple[str, ...]]]
    _templates: DescTemplates
    _sizer: OutputSizer
    _t: Connection
    _nowait_thread: int

    def _client(self) -> Client:
        """This client, typed as the :class:`~._client.Client` it is (loans and futures hold the whole of it)."""
        return cast("Client", self)

    if TYPE_CHECKING:
        def _check(self) -> None: ...

        def _take(self, nbytes: int, deadline: float) -> _Slot: ...

        def _take_free(self, nbytes: int) -> _Slot | None: ...

        def _drop_kept(self) -> bool: ...

        def _resident_spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]: ...

    def call(self, op: str | Pipeline, *, copy: bool = True, timeout_s: float | None = None,
             out_nbytes: int | None = None, in_place: bool = False, keep: tuple[str, ...] = (),
             **kwargs: Any) -> dict[str, np.ndarray]:
        """Run ``op`` (or a :class:`Pipeline`) on arrays; the convenient path.

        Each array argument is copied into a slot (the one copy the caller chose by holding the
        data elsewhere); other keyword arguments are the op's attributes.

        Args:
            op: an op name from ``op_table`` or a Pipeline.
            copy: return copies (default), or views into the slot valid while you hold them
                (the slot stays reserved until every view is gone).
            timeout_s: patience for this call, slot wait included.
            out_nbytes: bytes to reserve for outputs. Not needed: the first call of a signature gets room for
                outputs as large as its inputs and learns their sizes from its answer; when they did not fit,
                the client asks the worker for them (the ops' shape rules) and sends the call again.
            in_place: let the op write its output over its first input.
            keep: output names to keep on the worker as resident tensors instead of returning them.

        Returns:
            ``{output name: array}``.

        Raises:
            InvalidRequestError (with ``field``), KernelError (with ``op``, ``step``, ``tensor``),
            BusyError, Timeout, WorkerGoneError.
        """
        again = True  # (a `while` costs the steady path a few ns where a `for` over two tries costs tens)
        while True:
            try:
                if self._tracing is None:
                    got = self._steady(op, kwargs, in_place, keep, out_nbytes, GUESS_ANY)
                    if got is not None:
                        if got[0].learn is None:
                            return self._call_now(got[0], got[1], copy, timeout_s)
                        return self._call_guessed(got[0], got[1], copy, timeout_s, op, kwargs, in_place, keep)
                return self._submit(op, timeout_s, out_nbytes, in_place, keep, copy, False, kwargs, False).result()
            except RequestError as e:
                # the worker refused a resident input's spec (field "resident": before any step ran): the tensor was
                # replaced or dropped since this client recorded it; sent once more when it now has another spec
                ref = kwargs.get(e.tensor or "") if e.field == "resident" else None
                if type(ref) is not Resident or not self._forget_resident(ref.name, look=again):
                    raise
            again = False

    def _call_guessed(self, plan: CallPlan, arrays: list[np.ndarray], copy: bool, timeout_s: float | None,
                      op: str | Pipeline, kwargs: dict[str, Any], in_place: bool, keep: tuple[str, ...]
                      ) -> dict[str, np.ndarray]:
        """``call()``'s first call of a signature, sent without asking the worker for its outputs' sizes: in a slot
        with room for outputs as large as the inputs (the whole rest of the slot is theirs); the sizes its answer
        gives are cached for the signature. When the outputs do not fit, the worker refuses the request before
        anything runs (RequestTooLargeError, field ``outputs``): then the client asks, as it did before, and sends
        it again in a slot of the right size, within the call's ``timeout_s``."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            out = self._call_now(plan, arrays, copy, timeout_s)
        except RequestTooLargeError as e:
            if not outputs_did_not_fit(e):
                raise
            got = self._steady(op, kwargs, in_place, keep, None)
            if got is None or got[0].learn is not None:
                raise
            return self._call_now(got[0], got[1], copy, max(0.0, deadline - time.monotonic()))
        self._learned(plan, [a.nbytes for a in out.values()], self._kept)
        return out

    def _learned(self, plan: CallPlan, sizes: list[int], loans: Any) -> None:
        """A request of ``plan``, whose room for outputs was a guess, was answered with outputs of ``sizes`` bytes:
        cache them for its signature, and keep the plan, sized now, for the signature's next calls (the views of its
        inputs that ``loans`` made move to it: the same offsets)."""
        sizer_key, key = plan.learn
        out_nbytes = self._sizer.learn(sizer_key, sizes)
        if key is None:
            return
        need, fits = self._room(plan.writes, out_nbytes)
        payload, op_code, flags, outputs = plan.desc  # the same descriptor; its room is no longer a guess
        sized = replace(plan, need=need, fits=fits, learn=None, desc=(payload, op_code, flags & ~_GUESS, outputs))
        bounded_put(self._plans, key, sized)
        for loan in loans:
            made = loan._in_views.pop(id(plan), None)
            if made is not None:
                loan._in_views[id(sized)] = (sized, made[1])

    def _steady(self, op: str | Pipeline, kwargs: dict[str, Any], in_place: bool, keep: tuple[str, ...],
                out_nbytes: int | None, guess: int = 0) -> tuple[CallPlan, list[np.ndarray]] | None:
        """The plan of this call's signature (made on its first call) and its arrays in the plan's order, or None for
        a call the steady path does not serve (see :func:`steady_key` and :meth:`_plain_inputs`). ``guess``
        (``call()``: :data:`GUESS_ANY`): a signature whose outputs' sizes are not known yet, and whose inputs take at
        most this many bytes, gets a plan that guesses them (not kept; see :meth:`_call_guessed`), instead of asking
        the worker first."""
        got = steady_key(op, kwargs, in_place, keep, out_nbytes, self._specs)
        if got is None:
            return None
        key: Any = got[0]
        try:
            plan = self._plans.get(key)
        except TypeError:  # a `keep` given as a list: this call's plan is not kept
            plan, key = None, None
        if plan is None:
            plan = self._plan_of(op, kwargs, key, in_place, keep, out_nbytes, guess)
            if plan is None:
                return None
        return plan, got[1]

    def _forget_resident(self, name: str, look: bool = False) -> bool:
        """The worker refused a request over resident tensor ``name``'s spec (replaced with another shape or dtype, by
        another client or a kept output, or dropped): forget what this client recorded of it, so that the next call
        looks it up again instead of sending the same stale spec (``call()``, and a future of ``submit()``).

        With ``look`` (``call()``, in the caller's thread) it is looked up at once. Returns whether it exists now with
        another spec than the one recorded: the refused call may then be sent again."""
        old = self._specs.pop(name, None)
        if not look or old is None:
            return False
        try:
            return self._resident_spec(name) != old
        except Exception:  # noqa: BLE001 - gone, or the look-up failed: the call's own error stands
            return False

    def _plain_inputs(self, op: str | Pipeline, kwargs: dict[str, Any]
                      ) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Resident]] | None:
        """(NumPy inputs, of any strides; attributes; resident references) of a call that the steady path serves, or
        None: an input of another library, or one NumPy would first convert, goes the general way."""
        if isinstance(op, str):
            params = self._params.get(op)
            if params is None:
                entry = self.op_table.get(op)
                if entry is None:
                    return None  # the general path raises the right error
                params = self._params[op] = frozenset(entry.inputs)
            pipeline = False
        else:
            params, pipeline = frozenset(), True
        arrays: dict[str, np.ndarray] = {}
        attrs: dict[str, Any] = {}
        residents: dict[str, Resident] = {}
        for k, v in kwargs.items():
            if type(v) is np.ndarray:
                arrays[k] = v
            elif type(v) is Resident:
                residents[k] = v
            elif type(v) in PLAIN_ATTRS and not pipeline and k not in params:
                attrs[k] = v
            elif pipeline or k in params or isinstance(v, Resident) or is_array_like(v):
                return None
            else:
                attrs[k] = v
        return arrays, attrs, residents

    def _plan_of(self, op: str | Pipeline, kwargs: dict[str, Any], key: Any, in_place: bool, keep: tuple[str, ...],
                 out_nbytes: int | None, guess: int = 0) -> CallPlan | None:
        """The plan of the first call of a signature (kept under ``key`` unless that is None), or None for a call the
        steady path does not serve (see :meth:`_plain_inputs`).

        Raises:
            InvalidRequestError: an array's dtype cannot travel (field ``dtype``).
        """
        self._check()
        plain = self._plain_inputs(op, kwargs)
        if plain is None:
            return None
        arrays, attrs, residents = plain
        check_attrs(op, attrs)
        try:
            inputs = tuple((k, a.shape, dtypes.name_of_numpy(a.dtype)) for k, a in arrays.items())
        except KeyError:
            bad = next(k for k, a in arrays.items() if _cannot_travel(a.dtype))
            raise InvalidRequestError(f"array {bad!r} has dtype {arrays[bad].dtype}, which cannot travel",
                                      tensor=bad, field="dtype") from None
        refs = []
        for k, r in residents.items():  # the spec the key holds (the client's record of that tensor)
            shape, dt = self._resident_spec(r.name)
            refs.append(TensorRef(k, dtypes.name_of_numpy(dt), tuple(shape), 0, 0, r.name))
        plan, sure = self._plan_call(op, inputs, attrs, in_place, keep, out_nbytes, tuple(refs), guess, key)
        if key is not None and sure:
            bounded_put(self._plans, key, plan)
        return plan

    def _call_now(self, plan: CallPlan, arrays: list[np.ndarray], copy: bool, timeout_s: float | None
                  ) -> dict[str, np.ndarray]:
        """``call()`` of host arrays with the plan of its signature, in this thread: inputs copied into the slot, the
        descriptor bytes written, ring, wait, the response checked, outputs copied out."""
        if self._closed or _FORKS[0] != self._fork_gen:
            self._check()  # raises
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        lane = self._t.lane
        if lane is not None and lane.slept and plan.soon and not lane.busy and not self._inflight:
            lane.soon()  # the early ring: the worker wakes while the inputs are copied in (schema/lane.py)
        loan = self._kept_loan(plan)
        if loan is None:
            loan = Loan(self._client(), self._take(plan.need, deadline))
        kept = False
        try:
            # the one copy in, through views of the slot made once per plan and loan (NumPy's assignment costs less
            # than a memoryview's of the same bytes); Loan._views_for written out: one call less on this path. No
            # view of the slot is left in this frame when the loan ends below: a borrowed slot would be parked, held
            # from the worker's pool while this client sat idle (see _copy_in)
            if loan._done or loan._s.mv is None:
                loan._live()  # raises
            made = loan._in_views.get(id(plan))
            _copy_in(loan._plan_views(plan, arrays) if made is None else made[1], arrays)
            made = None
            rid = loan._publish(plan.desc)
            loan._wait(rid, deadline)
            if copy:  # copies: no view of the slot is handed out, so the next call() may use the same loan
                out = {k: v.copy() for k, v in loan._response(rid, fresh=False).items()}
                kept = True
                return out
            return loan._response(rid)
        finally:
            self._end_loan(loan, kept)

    def _kept_loan(self, plan: CallPlan) -> Loan | None:
        """The kept loan, taken, when it fits ``plan`` and is not much larger (a small request does not hold a large
        slot: it goes back then); else None. Kept loans serve requests of plans only (``call()``, and ``submit()``
        of a planned signature), which write their own descriptor bytes: the loan's own tensor list is never used."""
        try:
            loan = self._kept.pop()
        except IndexError:
            return None
        if plan.need <= loan._s.nbytes <= plan.fits:
            return loan
        loan.release()
        return None

    def _end_loan(self, loan: Loan, keep: bool) -> None:
        """A request of a plan is over: with ``keep`` (answered, its outputs copied out: no view of the slot handed
        out) its loan is kept for the next such request (its slot open, the views of its inputs and outputs made),
        unless one is kept already or the slot is borrowed; else the slot goes back (to the worker, if borrowed)."""
        if keep and not self._kept and not loan._s.borrowed and not self._closed:
            self._kept.append(loan)
            if self._closed:  # closed meanwhile by another thread: close() may have looked already
                self._drop_kept()
        else:
            loan.release()

    def _plan_call(self, op: str | Pipeline, inputs: tuple[tuple[str, tuple[int, ...], str], ...],
                   attrs: dict[str, Any], in_place: bool, keep: tuple[str, ...], out_nbytes: int | None,
                   refs: tuple[TensorRef, ...] = (), guess: int = 0, key: Any = None) -> tuple[CallPlan, bool]:
        """The first call of a signature: the outputs' size (asked of the worker), the layout, the descriptor;
        and whether to keep the plan (not when the worker refused to size it: that call fails, and the next one
        asks again, as the general path does). ``refs``: the resident tensors it names, after the inputs in the
        descriptor as the general path places them. ``guess``: outputs of a size not known yet, of inputs that take
        at most ``guess`` bytes, are given room as large as the inputs instead of asking (a plan with ``learn`` set, not kept until its answer says how large
        the outputs are, then under ``key``, the plan cache's: :meth:`_learned`)."""
        writes, tensors, cursor = plan_inputs(inputs, self.geometry.desc_nbytes)
        tensors += refs
        entry = self.op_table.get(op) if isinstance(op, str) else None
        learn = None
        if out_nbytes is None:
            alias = entry is not None and entry.alias
            specs = {n: (shape, wire) for n, shape, wire in inputs}
            names = tuple(t.name for t in refs)
            specs.update((t.name, (t.shape, t.dtype)) for t in refs)
            asked: int | None = 0
            if not (in_place or alias):
                sizer_key, asked = self._sizer.cached(op, specs, names, attrs, keep)
                if asked is None and guess and sum(n for _, n in writes) <= guess:
                    learn = (sizer_key, key)
                elif asked is None:
                    asked = self._sizer.ask(sizer_key, self.op_table, op, specs, names, attrs, keep)
            sure = asked is not None
            if asked is None:  # room as large as the inputs, but not past the largest slot (the rest of it, then)
                out_nbytes = max(0, min(sum(n for _, n in writes),
                                        self.geometry.max_slot_nbytes - self._room(writes, 0)[0]))
            else:
                out_nbytes = asked
        else:
            _check_out_nbytes(out_nbytes)
            sure = True
        need, fits = self._room(writes, out_nbytes)
        desc = self._describe(op, tensors, attrs, (_IN_PLACE if in_place else 0) | (_GUESS if learn else 0), keep)
        return CallPlan(need, writes, tensors, cursor, desc, cursor <= _SOON_MAX_NBYTES, fits, learn), sure

    def _room(self, writes: tuple[tuple[int, int], ...], out_nbytes: int) -> tuple[int, int]:
        """(need, fits) of a plan whose inputs are ``writes`` and whose outputs take ``out_nbytes`` (``CallPlan``)."""
        need = max(self.geometry.desc_nbytes + sum(align_up(n, tensor_align(n)) for _, n in writes) + out_nbytes,
                   self.geometry.desc_nbytes + 64)
        return need, max(4 * need, _KEEP_ANY_NBYTES)

    def submit(self, op: str | Pipeline, *, timeout_s: float | None = None, out_nbytes: int | None = None,
               in_place: bool = False, keep: tuple[str, ...] = (), _copy: bool = True,
               **kwargs: Any) -> CallFuture:
        """Like :meth:`call`, but return a :class:`CallFuture` at once; one slot per request in flight (a request of a
        planned signature takes the slot ``call()`` keeps, and leaves it for the next when it is answered).

        The future completes by itself when the answer arrives (a receiver thread, started by the
        first ``submit``, routes answers for the futures something watches: see ``Inflight.watch``), so
        ``concurrent.futures.wait``, ``as_completed``, ``add_done_callback``, ``done()`` and
        ``asyncio.wrap_future`` work; ``result()`` receives its answer itself; a request past its ``timeout_s``
        completes with :class:`Timeout`, one whose worker dies with :class:`WorkerGoneError`.

        Example::

            futs = [c.submit("vector_add", x=a, y=b) for a, b in pairs]
            outs = [f.result()["out"] for f in futs]
        """
        self._inflight.start_receiver()
        # a new signature whose inputs are small goes out without asking the worker first (as call() sends it); its
        # inputs are copied to send it again should its outputs outgrow the room guessed for them (the caller may
        # change its arrays once submit() returned)
        fut = self._submit(op, timeout_s, out_nbytes, in_place, keep, _copy, False, kwargs, guess=self.GUESS_COPY_MAX)
        if fut._guessed is not None:
            fut._again = (op, {k: v.copy() if type(v) is np.ndarray else v for k, v in kwargs.items()}, in_place, keep)
        return fut

    #: ``submit()`` guesses the room for a new signature's outputs (no question to the worker first) when its inputs
    #: take at most this many bytes: it keeps a copy of them to send the request again should the guess be too
    #: small. Larger inputs: it asks first (the question's round trip is small next to moving them).
    GUESS_COPY_MAX = 64 << 10

    def _submit(self, op: str | Pipeline, timeout_s: float | None, out_nbytes: int | None, in_place: bool,
                keep: tuple[str, ...], copy: bool, nowait: bool, kwargs: dict[str, Any], steady: bool = True,
                make: Callable[..., Any] = CallFuture, guess: int = 0) -> Any:
        """Copy the inputs into a slot and ring; ``nowait``: never wait (a free slot of ours, and no question to the
        worker first), else raise _NoSlot. ``steady``: a signature ``call()`` plans is sent by its plan (False: the
        caller found none). ``make``: the answer's class, called as ``CallFuture`` is (``AsyncClient``'s finishes an
        asyncio future; not with tracing, whose span ends in a done-callback). ``guess`` (``AsyncClient``'s
        :data:`GUESS_ANY`, ``submit()``'s :attr:`GUESS_COPY_MAX`: inputs of at most this many bytes; the answer sends
        the request again when its outputs did not fit): a new signature is sent without asking first, as ``call()``
        sends it (:meth:`_call_guessed`); its answer learns the sizes (``_CallReply``)."""
        if nowait and self._nowait_thread != (ident := get_ident()):  # (the thread's questions to the worker: _ask)
            self._nowait_thread = ident
            try:
                return self._submit(op, timeout_s, out_nbytes, in_place, keep, copy, True, kwargs, steady, make, guess)
            finally:
                self._nowait_thread = 0
        self._check()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        if steady and self._tracing is None:
            got = self._steady(op, kwargs, in_place, keep, out_nbytes, guess)
            if got is not None:
                return self._submit_planned(got[0], got[1], copy, nowait, deadline, make)
        arrays, attrs, residents = self._split(op, kwargs)
        sizes = [a.nbytes for a, _ in arrays.values()]
        need = self.geometry.desc_nbytes + sum(align_up(n, tensor_align(n)) for n in sizes)
        entry = self.op_table.get(op) if isinstance(op, str) else None
        alias = entry is not None and entry.alias
        if out_nbytes is None:
            asked = 0 if in_place or alias else self._out_nbytes(op, arrays, residents, attrs, keep, deadline)
            out_nbytes = sum(sizes) if asked is None else asked
        else:
            _check_out_nbytes(out_nbytes)
        need = max(need + out_nbytes, self.geometry.desc_nbytes + 64)
        if nowait:
            slot = self._take_free(need)
            if slot is None:
                raise _NoSlot(need)
        else:
            slot = self._take(need, deadline)
        me = self._client()
        loan = Loan(me, slot)
        tracing = self._tracing
        span, tail = (None, b"") if tracing is None else tracing.start(
            op if isinstance(op, str) else "pipeline", me.name)
        fut = make(me, loan, deadline, copy, None)
        try:
            _write_in(loan, arrays)
            for name, r in residents.items():
                shape, dt = self._resident_spec(r.name)
                loan.resident(name, r.name, shape, dt)
            if tracing is not None:
                fut.add_done_callback(lambda f: tracing.end(span, Future.exception(f, 0)))
            loan._post(op, attrs, in_place, keep, tail, future=fut)
        except BaseException as e:
            loan.release()
            if tracing is not None and not Future.done(fut):
                tracing.end(span, e)
            raise
        return fut

    def _submit_planned(self, plan: CallPlan, arrays: list[np.ndarray], copy: bool, nowait: bool, deadline: float,
                        make: Callable[..., Any]) -> Any:
        """``_submit`` of a signature with a plan: a slot of its own (a future holds its slot until it is done: the kept
        loan's when it fits), the inputs copied in through views of the plan's offsets, the plan's descriptor bytes
        written, ring."""
        me = self._client()
        loan = self._kept_loan(plan)
        if loan is None:
            if nowait:
                slot = self._take_free(plan.need)
                if slot is None:
                    raise _NoSlot(plan.need)
            else:
                slot = self._take(plan.need, deadline)
            loan = Loan(me, slot)
        fut = make(me, loan, deadline, copy, plan.tensors)
        if plan.learn is not None:
            fut._guessed = plan  # its answer learns the outputs' sizes, or has it sent again (AsyncClient)
        try:
            _copy_in(loan._views_for(plan, arrays), arrays)  # (no view of ours is left once it rings: _copy_in)
            loan._publish(plan.desc, b"", fut)
        except BaseException:
            loan.release()
            raise
        return fut

    def _out_nbytes(self, op: str | Pipeline, arrays: dict[str, tuple[Any, str]], residents: dict[str, Resident],
                    attrs: dict[str, Any], keep: tuple[str, ...], deadline: float) -> int | None:
        """Bytes for the outputs, from the ops' shape rules on the worker (cached per signature; see ``_sizing``);
        None when the worker refuses the plan."""
        specs: dict[str, tuple[tuple[int, ...], str]] = {n: (tuple(a.shape), wire) for n, (a, wire) in arrays.items()}
        for n, r in residents.items():
            shape, dt = self._resident_spec(r.name)
            specs[n] = (tuple(shape), dtypes.name_of_numpy(dt))
        return self._sizer.out_nbytes(self.op_table, op, specs, tuple(residents), attrs, keep)

    def _split(self, op: str | Pipeline, kwargs: dict[str, Any]
               ) -> tuple[dict[str, tuple[np.ndarray | DeviceInput, str]], dict[str, Any], dict[str, Resident]]:
        """Tensor inputs (with their wire dtype) vs resident references vs attributes.

        For an op, a keyword is a tensor when the op names it as an input or it is array-like
        (see ``_interop``); every keyword of a Pipeline is a tensor (its attributes are on its steps).
        """
        params = set(self.op_table[op].inputs) if isinstance(op, str) and op in self.op_table else None
        pipeline = isinstance(op, Pipeline)
        arrays, attrs, residents = {}, {}, {}
        for k, v in kwargs.items():
            if isinstance(v, Resident):
                residents[k] = v
            elif pipeline or (params is not None and k in params) or is_array_like(v):
                arrays[k] = as_input(k, v)
            else:
                attrs[k] = v
        attrs = plain_attrs(attrs)
        check_attrs(op, attrs)
        return arrays, attrs, residents

    def _describe(self, op: str | Pipeline, tensors: tuple[TensorRef, ...], attrs: dict[str, Any], flags: int,
                  keep: tuple[str, ...]) -> tuple[bytes, int, int, tuple[str, ...]]:
        """(descriptor bytes, op_code, flags, output names), cached: building FlatBuffers is the slow part of a call."""
        key = (op, tensors, tuple(sorted((k, type(v), v) for k, v in attrs.items())), flags, keep)
        hit = self._desc_cache.get(key)
        if hit is not None:
            return hit
        # one op's calls that differ in numeric attribute values only: the layout's template, patched (_desctemplate)
        hit = self._templates.make(op, tensors, attrs, flags, keep) if type(op) is str else \
            self._encode(op, tensors, attrs, flags, keep)
        bounded_put(self._desc_cache, key, hit)
        return hit

    def _attr_kinds(self, op: str) -> dict[str, str] | None:
        """The kinds of ``op``'s attributes (the op table's), or None for an op the worker does not have."""
        entry = self.op_table.get(op)
        return None if entry is None else {k: a.kind for k, a in entry.attrs.items()}

    def _encode(self, op: str | Pipeline, tensors: tuple[TensorRef, ...], attrs: Mapping[str, Any], flags: int,
                keep: tuple[str, ...]) -> tuple[bytes, int, int, tuple[str, ...]]:
        """:meth:`_describe`'s descriptor built by the encoder."""
        steps, outputs = resolve(self.op_table, op, [t.name for t in tensors], dict(attrs))
        desc = RequestDesc(tuple(steps), tensors, tuple(o for o in outputs if o not in keep), tuple(keep))
        payload = encode_request(desc)
        if HEADER_NBYTES + len(payload) > self.geometry.desc_nbytes:
            raise RequestTooLargeError(f"the descriptor ({len(payload)} B) does not fit the slot's descriptor area "
                                       f"({self.geometry.desc_nbytes} B): use fewer tensors or steps",
                                       field="descriptor")
        return payload, steps[0].op_code, flags | (_KEEP if keep else 0), desc.outputs


def _copy_in(views: list[np.ndarray], arrays: list[np.ndarray]) -> None:
    """Copy a request's inputs into its slot through ``views``. A function of its own, so that no view of the slot is
    left in the caller once the request rings: another thread may route its answer and give the slot back at once,
    and a view alive then parked the slot (a borrowed one stayed held from the worker's pool until this client took
    a slot again)."""
    for a, view in zip(arrays, views):
        view[...] = a


def _write_in(loan: Loan, arrays: dict[str, tuple[Any, str]]) -> None:
    """Place a request's inputs in ``loan``'s slot (see :func:`_copy_in` for why in a function of its own)."""
    for name, (a, wire) in arrays.items():
        view = loan.array(name, a.shape, wire)
        if isinstance(a, DeviceInput):
            a.copy_into(view)  # device -> slot, one copy
        else:
            np.copyto(view, a if a.dtype == view.dtype else a.view(view.dtype), casting="no")


#: ``guess`` of ``call()`` and ``AsyncClient``: a new signature's outputs are guessed whatever its inputs' size (their
#: request is sent again from the caller's arrays, which they hold until it is answered)
GUESS_ANY = sys.maxsize
_KEEP_ANY_NBYTES = 64 << 10  # a kept call() loan's slot up to this size serves any smaller call
# the early ring: a call() through an idle lane whose descriptor and inputs end within this many bytes of the slot's
# start (copied in within a few µs) wakes the worker before copying them; a larger copy would outlast the worker's poll
_SOON_MAX_NBYTES = 64 << 10


def _check_out_nbytes(out_nbytes: Any) -> None:
    """Refuse an ``out_nbytes`` that is not a byte count (0 is one: outputs written over the inputs need no room)."""
    if type(out_nbytes) is not int or out_nbytes < 0:
        raise InvalidRequestError(f"out_nbytes must be a number of bytes >= 0, got {out_nbytes!r}", field="out_nbytes")


def _cannot_travel(dt: np.dtype) -> bool:
    try:
        dtypes.name_of_numpy(dt)
    except KeyError:
        return True
    return False
