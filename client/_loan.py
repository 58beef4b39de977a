"""The zero-copy path: a Loan of one slot, and the future of a submitted call.

A Loan writes its tensors into the slot through NumPy views, then its descriptor and
header, and rings the worker; its outputs are views into the same slot. The slot goes
back to the Client when the loan ends and no view of it is left (see :mod:`._slot`).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import numpy as np

from shmrpc.schema import dtypes
from shmrpc.schema.descriptor import TensorRef
from shmrpc.schema.errors import (
    BusyError,
    ClientClosedError,
    InvalidRequestError,
    RequestError,
    RequestTooLargeError,
    StaleSlotError,
    Timeout,
    WorkerGoneError,
    from_wire,
)
from shmrpc.schema.header import HEADER, HEADER_NBYTES, REQUEST_ID
from shmrpc.schema.layout import align_up, format_size, format_size_approx, tensor_align

from ._caches import bounded_put
from ._callplan import CallPlan, outputs_did_not_fit, read_outputs
from ._pipeline import Pipeline, check_attrs, plain_attrs
from ._slot import _FORKS, _IN_PLACE, _RESPONSE, NO_RESPONSE, _decode, _Slot

if TYPE_CHECKING:
    from ._client import Client

__all__ = ["Loan", "CallFuture"]

_HEADER_UNPACK = HEADER.unpack_from
_RID_PACK, _RID_NBYTES = REQUEST_ID.pack, REQUEST_ID.size  # a header's request_id, its first field
_PLAN_VIEWS = 16  # call() plans whose input views a loan keeps
_OLDER_OUTS = 3  # responses checked before the last one that a loan keeps the checks and views of


class Loan:
    """A slot reserved for one caller: fill tensors in place, send, read outputs in place.

    Arrays from :meth:`array` and the outputs of :meth:`send` are views into the slot;
    the slot goes back to the client when the loan ends *and* those views are gone.
    A loan may be sent several times (the inputs stay in the slot between sends).
    """

    def __init__(self, client: Client, slot: _Slot) -> None:
        self._c, self._s = client, slot
        self._tensors: list[TensorRef] = []
        self._cursor = client.geometry.desc_nbytes
        self._done = False
        self._memo: dict[Any, tuple[bytes, int, int, tuple[str, ...]]] = {}  # descriptors, by (op, attrs, ...)
        self._outputs: tuple[str, ...] = ()  # what the request in flight asked for, in order
        # (check, buffer, its views, the response's bytes after its request id (the rest of its header and its
        # descriptor) and the outputs asked of the last response checked)
        self._out_views: tuple[Any, Any, dict[str, np.ndarray], bytes, tuple[str, ...]] | None = None
        # the same of the responses checked before the last one (other plans' answers, for calls that take turns),
        # the most recent first, at most _OLDER_OUTS
        self._out_older: tuple[tuple[Any, Any, dict[str, np.ndarray], bytes, tuple[str, ...]], ...] = ()
        # call() plans' input views of this slot, by id(plan): (the plan, kept alive so that its id stays its own, and
        # a view per input, in the order of plan.writes)
        self._in_views: dict[int, tuple[CallPlan, list[np.ndarray]]] = {}

    @property
    def nbytes(self) -> int:
        """The slot's size."""
        return self._s.nbytes

    def __enter__(self) -> Loan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _live(self) -> memoryview:
        if self._done or self._s.mv is None:
            raise ClientClosedError("this loan was released")
        return self._s.mv

    def array(self, name: str, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        """A writable NumPy view of a new input tensor ``name`` inside the slot.

        ``dtype`` is a NumPy dtype or a wire dtype name; ``"bfloat16"`` gives a ``uint16`` view of the
        raw bits where ``ml_dtypes`` is not installed (an ``ml_dtypes.bfloat16`` view where it is).

        Raises:
            RequestTooLargeError: the slot has no room left for it.
            InvalidRequestError: the name is taken or the dtype cannot travel.
        """
        self._live()
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        if isinstance(dtype, str) and dtype in dtypes.DTYPE_CODES:  # a wire name: "bfloat16" works without ml_dtypes
            dname, dt = dtype, dtypes.numpy_dtype(dtype)
        else:
            dt = np.dtype(dtype)
            try:
                dname = dtypes.name_of_numpy(dt)
            except KeyError:
                raise InvalidRequestError(f"dtype {dt} cannot travel", tensor=name, field="dtype") from None
        if any(t.name == name for t in self._tensors):
            raise InvalidRequestError(f"tensor {name!r} already exists in this request", tensor=name, field="name")
        nbytes = math.prod(shape) * dt.itemsize
        off = align_up(self._cursor, tensor_align(nbytes))
        if off + nbytes > self._s.nbytes:
            raise RequestTooLargeError(f"tensor {name!r} ({format_size_approx(nbytes)}) does not fit in this "
                                       f"{format_size(self._s.nbytes)} slot: loan a larger one", tensor=name,
                                       field="nbytes")
        self._tensors.append(TensorRef(name, dname, shape, off, nbytes))
        self._memo.clear()
        self._cursor = off + nbytes
        return np.frombuffer(self._s.buf, dtype=dt, count=math.prod(shape), offset=off).reshape(shape)

    def resident(self, name: str, resident_name: str, shape: tuple[int, ...], dtype: Any) -> None:
        """Refer to the worker's resident tensor ``resident_name`` as input ``name`` (no bytes in the slot)."""
        self._live()
        self._tensors.append(TensorRef(name, dtypes.name_of_numpy(np.dtype(dtype)), tuple(shape), 0, 0,
                                       resident_name))
        self._memo.clear()

    def _post(self, op: str | Pipeline, attrs: dict[str, Any], in_place: bool, keep: tuple[str, ...],
              trace: bytes = b"", future: _Reply | None = None) -> int:
        """Write descriptor and header, ring the worker (with a trace context tail when traced); returns the
        request_id. ``future`` is finished by whichever thread routes the answer."""
        c, s = self._c, self._s
        if self._done or s.mv is None:
            self._live()  # raises
        if s.in_flight is not None:
            raise InvalidRequestError("this loan already has a request in flight (one that timed out holds the loan "
                                      "until its late answer comes)", field="slot")
        # attribute values with their types: a=1, a=1.0 and a=True are equal keys but different descriptors (a request
        # with neither attributes nor kept outputs, the usual one, has the short key)
        key = ((op, in_place) if not attrs and not keep else
               (op, tuple((k, type(v), v) for k, v in attrs.items()), in_place, tuple(keep)))
        try:
            hit = self._memo.get(key)
        except TypeError:  # an attribute value that cannot be hashed cannot travel either
            check_attrs(op, attrs)
            raise
        if hit is None:
            attrs = plain_attrs(attrs)
            check_attrs(op, attrs)
            hit = c._describe(op, tuple(self._tensors), attrs, _IN_PLACE if in_place else 0, tuple(keep))
            bounded_put(self._memo, key, hit)
        return self._publish(hit, trace, future)

    def _publish(self, desc: tuple[bytes, int, int, tuple[str, ...]], trace: bytes = b"",
                 future: _Reply | None = None) -> int:
        """Write the descriptor bytes and the header of ``desc`` (see ``Client._describe``) and ring (the caller
        checked that the loan is live)."""
        c, s = self._c, self._s
        mv: memoryview = s.mv  # type: ignore[assignment]
        payload, op_code, flags, self._outputs = desc
        rid = next(c._rid) & 0xFFFFFFFF  # (Client._next_rid, written out: one call less per request)
        mv[HEADER_NBYTES:HEADER_NBYTES + len(payload)] = payload
        # NOTE: order is important here: header after descriptor, CALL after header (the publication point).
        HEADER.pack_into(mv, 0, rid, op_code, len(payload), flags, s.generation)
        s.in_flight, s.status = rid, None
        if future is not None:
            future._rid = rid
        c._ring(s, rid, trace, future)
        return rid

    def _wait(self, rid: int, deadline: float, until: Any = None) -> None:
        """Return once the answer to ``rid`` came: from the lane's page when it was rung there, else pumping the
        socket for every waiter while no other thread does, until ``until()`` (default: the slot is answered; a
        future's own condition otherwise). Raises Timeout or WorkerGoneError."""
        c = self._c
        lane = c._t.lane
        try:
            # rung through the lane: its answer is read from the page, by the thread that holds the lane's wait (a
            # synchronous request's holds it from its ring; a future's waiter takes it)
            if lane is not None and lane.busy == rid and (until is None or c._inflight.claim_lane(lane, rid)):
                c._lane_wait(lane, deadline)
            else:
                s = self._s
                c._pump(deadline, until or (lambda: s.in_flight != rid))
        except Timeout as e:
            op = self._op_in_flight()
            raise Timeout(f"{e} (op {op!r})" if op else str(e), op=op) from None

    def _op_in_flight(self) -> str:
        """The name of the op whose request this loan's header holds (read only when one timed out)."""
        mv = self._s.mv
        if mv is None:
            return ""
        code = HEADER.unpack_from(mv, 0)[1]
        return next((n for n, e in self._c.op_table.items() if e.code == code), "")

    def _response(self, rid: int, fresh: bool = True,
                  ahead: tuple[Any, dict[str, np.ndarray]] | None = None) -> dict[str, np.ndarray]:
        """The outputs of the answered request ``rid``, checked: fresh views of the slot, or with ``fresh`` False
        the loan's own views (for a caller that only copies them out and hands none of them on). ``ahead``: the
        loan's last response checked and fresh views of it, made while the request ran (used if this response
        is that one again)."""
        s, mv = self._s, self._live()
        status = s.status
        if status and status & NO_RESPONSE:
            err = from_wire(status & 0x7FFF, "the worker refused the doorbell without touching the slot"
                            + (" (the worker is shutting down, or the slot holds a request in flight)"
                               if status & 0x7FFF == BusyError.code else ""), field="slot")
            if isinstance(err, StaleSlotError):
                self._done = True  # the slot is no longer ours: never write to it again
            raise err
        # the check of a response is a function of its bytes, the outputs asked for and the slot's size: a
        # response byte-identical to one checked before needs no second look (the key compares them all)
        made = self._out_views
        buf = s.buf
        if made is not None and made[1] is buf and self._outputs == made[4]:
            tail = made[3]
            # this loan's last response again, for this request: its header (the request id, then the op code, length,
            # flags and generation) and its descriptor, compared on one private copy (a ctypes array's slice)
            if buf[:_RID_NBYTES + len(tail)] == _RID_PACK(rid) + tail:
                if not fresh:
                    return made[2]
                if ahead is not None and ahead[0] is made:
                    return ahead[1]
                return {name: a.view() for name, a in made[2].items()}
        if self._out_older:
            again = self._older_again(rid, fresh)
            if again is not None:
                return again
        h_rid, _, h_len, h_flags, _ = _HEADER_UNPACK(mv)  # a plain tuple: no Header built per response
        if not h_flags & _RESPONSE or h_rid != rid or h_len > len(mv) - HEADER_NBYTES:
            made = ahead = buf = None  # (see below: no view of the slot in this frame when it raises)
            raise RequestError("the worker's response header is malformed", field="header")
        payload = buf[HEADER_NBYTES:HEADER_NBYTES + h_len]
        key = (payload, self._outputs, len(mv))
        checks = self._c._out_checks
        check = checks.get(key)
        if check is None:
            resp = _decode(payload)
            if resp.status:
                # NOTE: no view of the slot in this frame when it raises: a traceback kept by the caller would keep
                # the slot from going back when the loan ends (send's own frame lets go of its views the same way)
                made = ahead = buf = None
                raise from_wire(resp.status, resp.message, op=resp.op, step=resp.step, tensor=resp.tensor,
                                field=resp.field)
            check = read_outputs(resp, self._outputs, len(mv))
            bounded_put(checks, key, check)
        if made is None or made[0] is not check or made[1] is not buf:
            # the views of one check over one buffer are always the same: made once, handed out as fresh views
            views = {name: np.frombuffer(buf, dtype=dt, count=count, offset=off).reshape(shape)
                     for name, dt, count, off, shape in check.outputs}
        else:
            views = made[2]
        if made is not None and made[1] is buf:
            self._out_older = (made, *self._out_older)[:_OLDER_OUTS]
        self._out_views = (check, buf, views, buf[_RID_NBYTES:HEADER_NBYTES + h_len], self._outputs)
        return {name: a.view() for name, a in views.items()} if fresh else views

    def _older_again(self, rid: int, fresh: bool) -> dict[str, np.ndarray] | None:
        """:meth:`_response`'s answer when the slot holds, for ``rid``, a response checked before the last one (calls
        that take turns between plans), compared as the last one is; it becomes the last one. None: none of them."""
        buf, older = self._s.buf, self._out_older
        for i, o in enumerate(older):
            if o[1] is buf and self._outputs == o[4] and buf[:_RID_NBYTES + len(o[3])] == _RID_PACK(rid) + o[3]:
                rest = older[:i] + older[i + 1:]
                made = self._out_views
                self._out_views, self._out_older = o, ((made, *rest) if made is not None else rest)
                return {name: a.view() for name, a in o[2].items()} if fresh else o[2]
        return None

    def send(self, op: str | Pipeline, *, timeout_s: float | None = None, in_place: bool = False,
             keep: tuple[str, ...] = (), **attrs: Any) -> dict[str, np.ndarray]:
        """Run ``op`` on the tensors of this loan; outputs are views into the slot.

        Raises:
            InvalidRequestError, KernelError, Timeout, WorkerGoneError (see :meth:`Client.call`).
        """
        c = self._c
        if c._closed or _FORKS[0] != c._fork_gen:
            c._check()  # raises
        rid = self._post(op, attrs, in_place, keep)
        # NOTE: the worker has the request from here: what the answer's way needs is made now, off the round trip
        # (the deadline; fresh views for an answer like the last one, which is the usual answer of a loan sent again)
        deadline = time.monotonic() + (c.timeout_s if timeout_s is None else timeout_s)
        made = self._out_views
        ahead = None if made is None else (made, {name: a.view() for name, a in made[2].items()})
        made = None
        try:
            self._wait(rid, deadline)
            return self._response(rid, ahead=ahead)
        finally:
            ahead = None  # views of the slot: never kept by a traceback through this frame (see _response)

    def _views_for(self, plan: CallPlan, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Views of this live loan's slot at ``plan``'s inputs (made on the plan's first request on this loan).

        Raises:
            ClientClosedError: the loan was released."""
        if self._done or self._s.mv is None:
            self._live()  # raises
        made = self._in_views.get(id(plan))
        return self._plan_views(plan, arrays) if made is None else made[1]

    def _plan_views(self, plan: CallPlan, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Views of this slot at ``plan``'s inputs, shaped and typed as ``arrays`` (the first call of that plan on this
        loan), kept for the next calls (at most ``_PLAN_VIEWS`` plans)."""
        buf = self._s.buf
        views = [np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=off).reshape(a.shape)
                 for a, (off, _) in zip(arrays, plan.writes)]
        if len(self._in_views) >= _PLAN_VIEWS:
            self._in_views.clear()
        self._in_views[id(plan)] = (plan, views)
        return views

    def release(self) -> None:
        """Give the slot back (it stays reserved while views of it are alive). Idempotent."""
        if self._done and self._s.mv is None:
            return
        self._done = True
        self._out_views, self._out_older = None, ()  # they hold the slot's buffer: free once the caller's views are gone
        self._in_views.clear()
        self._c._give_back_slot(self._s)


class _Waiters(list):  # type: ignore[type-arg]
    """A future's list of waiters, to which ``concurrent.futures.wait`` and ``as_completed`` add theirs: a waiter
    added watches the future (:meth:`Inflight.watch`). It holds the in-flight table's method, not the future."""

    __slots__ = ("_watch",)

    def __init__(self, watch: Any) -> None:
        super().__init__()
        self._watch = watch

    def append(self, waiter: Any) -> None:
        super().append(waiter)
        self._watch()


class _Reply:
    """What a request's answer becomes, once the thread that routes it calls :meth:`_finish`: the base of the futures
    (:class:`_Answer`) and of the event loop's answers (``AsyncClient``'s, which finish an asyncio future)."""

    # None: a request whose caller waits for it (result()), which reads its answer in the lane when it rode it; an
    # event loop's: called as on_lane(lane, reply) once the request rang the lane, to watch the lane for its answer
    _on_lane: Any = None

    def __init__(self, client: Client, loan: Loan, deadline: float) -> None:
        self._c, self._loan, self._deadline = client, loan, deadline
        self._rid = -1  # set by Loan._post before the doorbell
        self._watched = False

    def _no_answer(self) -> BaseException:
        err = self._c._no_answer_error()
        if isinstance(err, Timeout):  # named by the op its slot's header holds, as a blocking call's Timeout is
            op = self._loan._op_in_flight()
            if op:
                return Timeout(f"{err} (op {op!r})", op=op)
        return err

    def _outcome(self) -> Any:
        """The value once the answer came (override); raise its error."""
        return None

    def _done_with_slot(self, answered: bool) -> None:
        """The request is over (``answered``: its outputs were read without an error)."""

    def _settle(self) -> tuple[bool, Any]:
        """Read the answer in the slot, or why none came, and end the request's hold on the slot: ``(True, value)`` or
        ``(False, error)``."""
        try:
            if self._loan._s.in_flight == self._rid:
                raise self._no_answer()
            out = self._outcome()
        except BaseException as e:  # noqa: BLE001
            self._done_with_slot(False)
            return False, e
        self._done_with_slot(True)
        return True, out


class _CallReply(_Reply):
    """The answer of a call (``submit()``, ``AsyncClient.call``): its outputs, copied out of the slot unless asked not
    to; a request of a plan answered and copied out leaves its loan for the next one."""

    _copy = True
    _tensors: tuple[TensorRef, ...] | None = None  # the request's tensors when a plan sent them (else the loan's own)
    _guessed: CallPlan | None = None  # the plan that sent it, when its room for outputs was a guess (Client._learned)

    def _outcome(self) -> Any:
        try:
            # copied out: the loan's own views will do (no view of the slot is handed out)
            out = self._loan._response(self._rid, fresh=not self._copy)
        except RequestError as e:
            if e.field == "resident":  # a stale record of a resident tensor: looked up again next time
                tensors = self._loan._tensors if self._tensors is None else self._tensors
                self._c._forget_resident(next((t.resident for t in tensors if t.name == e.tensor and t.resident), ""))
            raise
        if self._guessed is not None:
            self._c._learned(self._guessed, [v.nbytes for v in out.values()], (self._loan,))
        return {k: v.copy() for k, v in out.items()} if self._copy else out

    def _done_with_slot(self, answered: bool) -> None:
        # a request of a plan (tensors given) answered and copied out may leave its loan for the next one
        self._c._end_loan(self._loan, answered and self._copy and self._tensors is not None)


class _Answer(_Reply, Future):  # type: ignore[type-arg]
    """A future finished by the thread that routes its request's answer (see :mod:`._inflight`).

    Watched (a done-callback, ``concurrent.futures.wait`` / ``as_completed``, ``done()``), it wakes the client's
    receiver thread, if one runs, to finish it when its answer comes; unwatched, its ``result()`` receives the answer
    in the caller's thread (:meth:`Inflight.watch`)."""

    def __init__(self, client: Client, loan: Loan, deadline: float) -> None:
        Future.__init__(self)
        _Reply.__init__(self, client, loan, deadline)
        self._finishing = threading.Lock()
        self._waiters = _Waiters(client._inflight.watch)
        self.set_running_or_notify_cancel()

    def _watch(self) -> None:
        if not self._watched:
            self._watched = True
            self._c._inflight.watch()

    def done(self) -> bool:
        """Whether it finished (a look that finds it not finished watches it: see the class)."""
        if Future.done(self):
            return True
        self._watch()
        return False

    def add_done_callback(self, fn: Any) -> None:
        """``fn(future)`` once it finished (on the thread that finishes it; at once when it has): watches it."""
        Future.add_done_callback(self, fn)
        self._watch()

    #: (op, inputs, in_place, keep) of a request ``Client.submit`` sent with a guessed room for its outputs (its
    #: inputs copies): sent again, asking first, when the outputs did not fit (:meth:`_send_again`)
    _again: tuple[Any, ...] | None = None
    _resent = False  # sent again: it finishes with that request (its slot here is no longer its)

    def _finish(self) -> None:
        """Complete this future from the answer in the slot, or with why none came; idempotent, any thread."""
        with self._finishing:
            if Future.done(self) or self._resent:
                return
            ok, out = self._settle()
            if ok:
                self.set_result(out)
                return
            if self._again is None or not outputs_did_not_fit(out):
                self.set_exception(out)
                return
            self._resent = True
        # refused before anything ran: sent again from a thread of its own, since this may be the receiver thread,
        # which routes the answer to the question the client asks first
        threading.Thread(target=self._send_again, name="shmrpc-send-again", daemon=True).start()

    def _send_again(self) -> None:
        """Send this future's request again, asking the worker for its outputs' sizes first; finish with its answer."""
        assert self._again is not None
        op, inputs, in_place, keep = self._again
        try:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise self._no_answer()
            again = self._c._submit(op, left, None, in_place, keep, self._copy, False, inputs)  # type: ignore[attr-defined]
        except BaseException as e:  # noqa: BLE001 - this future's error
            self.set_exception(e)
            return
        again.add_done_callback(self._adopt)

    def _adopt(self, again: Future[Any]) -> None:
        e = Future.exception(again, 0)
        if e is None:
            self.set_result(Future.result(again, 0))
        else:
            self.set_exception(e)

    def _await(self, timeout: float | None) -> None:
        """Wait (pumping when nobody else does) until the answer came or the patience ran out, then finish."""
        if Future.done(self):
            return
        if not self._resent:
            self._await_answer(timeout)
        if self._resent and not Future.done(self):
            left = self._deadline - time.monotonic() if timeout is None else timeout
            try:
                Future.exception(self, max(0.0, left))  # the request sent again finishes it (_adopt)
            except FutureTimeout:
                raise self._no_answer() from None

    def _await_answer(self, timeout: float | None) -> None:
        deadline = self._deadline if timeout is None else min(self._deadline, time.monotonic() + timeout)
        c, s, rid = self._c, self._loan._s, self._rid
        c._check()
        try:
            self._loan._wait(rid, deadline, lambda: Future.done(self) or s.in_flight != rid)
        except Timeout:
            if deadline < self._deadline:
                raise  # only the caller's shorter wait ran out; the request still runs
            c._forget_future(rid)
        except WorkerGoneError:
            pass  # finished below with it
        self._finish()


class CallFuture(_CallReply, _Answer):
    """The result of :meth:`Client.submit`.

    It completes by itself when the worker's answer arrives (so ``concurrent.futures.wait``,
    ``as_completed``, ``add_done_callback`` and ``asyncio.wrap_future`` work); ``result(timeout)``
    waits for it.
    """

    def __init__(self, client: Client, loan: Loan, deadline: float, copy: bool,
                 tensors: tuple[TensorRef, ...] | None = None) -> None:
        super().__init__(client, loan, deadline)
        self._copy = copy
        self._tensors = tensors

    def result(self, timeout: float | None = None) -> Any:
        """The outputs ``{name: array}``; raises the request's error. ``timeout`` defaults to the call's."""
        self._await(timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The request's error, or None."""
        self._await(timeout)
        return super().exception(timeout=0)
