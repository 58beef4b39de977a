"""The Client: connection, slots (own, borrowed, parked), calls, futures, resident tensors.

Slot lifecycle on the client::

    free ──take──▶ loaned (views handed out) ──send──▶ in flight ──DONE──▶ loaned
      ▲                                                                     │
      └──── no view of it left (see _slot._try_release) ◀── loan released ──┘
                   (until then the slot is "parked" and never reused)

A NumPy view of a slot is built over a per-use ctypes buffer (its ``base``); a
released loan's slot is reused only once no object refers to that buffer any more,
so a view can never silently outlive its slot: the slot stays reserved ("parked")
until the views go.

The Client composes three collaborators, each with a small interface that loans,
futures and the async client use too: the :class:`~._connection.Connection` (the
socket, under its own lock), the :class:`~._slots.SlotPool` (free and parked
slots) and the :class:`~._inflight.Inflight` table (requests in flight, and the one
receive path every waiting thread shares). The Client itself adds the slots' taking,
the control requests (ACQUIRE, MANAGE) and resident tensors; its call half (``call()``,
``submit()``, the kept loan) is :class:`~._calls.Calls`, in its own module.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shmrpc.schema import dtypes
from shmrpc.schema import messages as m
from shmrpc.schema.control import Acquire, ControlMessage, ErrorReply, Grant, Manage, Managed, MessageError, decode
from shmrpc.schema.errors import (
    BusyError,
    ClientClosedError,
    ConnectError,
    ForkedClientError,
    InvalidRequestError,
    ProtocolMismatchError,
    RequestError,
    RequestTooLargeError,
    Timeout,
    WorkerGoneError,
)
from shmrpc.schema.layout import Geometry, format_size, format_size_approx
from shmrpc.schema.optable import OpEntry, parse_op_table

from ._attach import set_dumpable
from ._callplan import CallPlan, OutputCheck
from ._calls import Calls, _NoSlot
from ._connection import Connection, control_error
from ._desctemplate import DescTemplates
from ._inflight import Inflight
from ._interop import as_input
from ._lane import ClientLane
from ._pipeline import Pipeline
from ._region import AttachedRegion
from ._sizing import OutputSizer
from ._slots import SlotPool
from ._trace import ClientTracing

__all__ = ["Client", "Loan", "CallFuture", "Resident"]  # Loan, CallFuture, Resident re-exported

from ._loan import CallFuture, Loan
from ._slot import Resident, _Slot, fork_generation, forked_since

_CALL_PACK = m.CALL_STRUCT.pack
_GRANT_GRACE_S = 0.25  # how long past the deadline an ACQUIRE's answer (BUSY at the deadline, or a GRANT) is awaited


def _no_slot(nbytes: int) -> BusyError:
    """A slot wait that ran out: the request was not sent (docs/reliability.md, Backpressure)."""
    return BusyError(f"no slot of {format_size_approx(nbytes)} became free in time", field="nbytes")


class Client(Calls):
    """A connection to a shmrpc worker, found by name.

    Args:
        name: the worker's name (``shmrpc serve --name NAME``).
        timeout_s: default patience of each call, slot wait included.
        connect_timeout_s: how long to wait for the worker's socket and its WELCOME.
        on_busy: ``"wait"`` (default): a call waits up to its timeout for a free slot;
            ``"fail"``: it raises :class:`BusyError` at once.
        linger_s: a slot borrowed beyond the lease is kept this long after use for the next call
            (default 0: given back at once, so an idle client never holds a slot others wait for).
        spin_us: wait for an answer by polling without sleeping for up to this long before blocking
            (default 0: block at once). Shortens small round trips by a scheduler wake-up at the cost of
            a busy core while waiting; pair it with the worker's ``--spin-us``.
        worker_uid: the uid the worker runs as, when it is not this process's (a worker started with
            ``--allow-uid``); its runtime directory is then ``$SHMRPC_RUNTIME_DIR`` or ``/tmp/shmrpc-<uid>``.
            The client refuses a worker whose directory, socket, kernel credentials or regions belong to
            any other uid.
        non_dumpable: make this whole process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``) before mapping
            anything, so other processes of this uid cannot read or write its regions through
            ``/proc/<pid>/mem``; it also stops core dumps and same-uid debuggers. Default ``False``.

        lease: slots of each size class (smallest first) to hold in this client's own region for its
            whole life, e.g. ``(4, 2, 1)``; the worker grants at most its ``--lease-max`` per class.
            Default ``None``: the worker's ``--lease`` (small slots only, by default); larger slots
            are borrowed from the worker's pool for each request that needs one.
        lane: ``None`` (default): every doorbell goes over ZeroMQ. ``"block"`` or ``"spin"``: ask the
            worker for a lane (a page shared with it and two eventfds, ``shmrpc.schema.lane``) that carries
            the doorbell and the answer of a call made while no other is in flight (``Loan.send``,
            ``Client.call``); the caller sleeps in poll() on an eventfd (``"block"``), or first polls the
            page without sleeping for up to ``spin_us`` µs (``"spin"``, default 200 µs: a busy core only
            while a request is pending). A worker started with ``--no-lanes`` grants none: ZeroMQ then
            carries everything, as it always carries control messages and requests in flight beside one.
        trace: OpenTelemetry spans for calls (the ``otel`` extra): ``True`` for the global tracer
            provider, or a ``TracerProvider``; off by default. A worker started with ``--otel``
            records its side of each traced call as a child span (docs/operations.md).

    Raises:
        ConnectError: no such worker (at once when its socket does not exist), it could not be verified
            (the message names the path, the owner found and the remedy), or it refused the handshake.
        ClientLimitError: the worker serves as many clients (of this uid) as it may.
        ProtocolMismatchError: worker and client are of different versions.
        ImportError: ``trace`` without OpenTelemetry installed (the message names the ``otel`` extra).

    Thread safety: every method may be called from any thread, and threads do not wait on each
    other's answers: whichever thread waits receives for all of them (docs/operations.md,
    "Threads, futures and asyncio"). A process forked from the one that made the Client must
    create its own (using this one raises :class:`ForkedClientError`).

    Example::

        with Client("demo") as c:
            out = c.call("scale", x=np.arange(4.0), a=2.0, b=1.0)["out"]
    """

    def __init__(self, name: str, *, timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 on_busy: str = "wait", linger_s: float = 0.0, spin_us: int = 0, worker_uid: int | None = None,
                 non_dumpable: bool = False, lease: tuple[int, ...] | None = None, trace: Any = False,
                 lane: str | None = None) -> None:
        if on_busy not in ("wait", "fail"):
            raise ValueError("on_busy must be 'wait' or 'fail'")
        if not 0 <= spin_us <= 1_000_000:
            raise ValueError(f"spin_us must be 0..1000000, got {spin_us}")
        if lane not in (None, "block", "spin"):
            raise ValueError(f"lane must be None, 'block' or 'spin', got {lane!r}")
        lane_spin_us = (spin_us or 200) if lane == "spin" else 0
        self.name, self.timeout_s, self.on_busy, self.linger_s = name, timeout_s, on_busy, linger_s
        self._tracing: ClientTracing | None = None
        if trace is not False and trace is not None:
            self._tracing = ClientTracing(None if trace is True else trace)
        self._pid = os.getpid()
        self._fork_gen = fork_generation()
        self._lock = threading.RLock()
        self._closed = False
        if lease is not None and any(int(n) < 0 for n in lease):
            raise ValueError("lease counts must be >= 0")
        if non_dumpable:
            set_dumpable(False)  # before any region is mapped: /proc/<our pid>/mem is never a door to it
        self._t = Connection(name, connect_timeout_s, spin_us, worker_uid,
                            None if lease is None else tuple(int(n) for n in lease), lane, lane_spin_us)
        w = self._t.welcome
        self._regions: dict[int, AttachedRegion] = {}
        fds, self._t.fds = self._t.fds, []
        try:
            self.client_id: int = w["client_id"]
            self.backend: str = w["backend"]
            self.worker_pid: int = self._t.worker_pid  # the kernel's word (the WELCOME said the same)
            self.geometry = Geometry.from_json(w["geometry"])
            try:
                self.op_table: dict[str, OpEntry] = parse_op_table(w["op_table"])
            except ValueError as e:
                raise ProtocolMismatchError(f"the worker's op table is not one this client reads: {e}") from None
            for i, r in enumerate(w["regions"]):
                geo = Geometry.from_json(r["geometry"]) if "geometry" in r else self.geometry
                fd, fds[i] = fds[i], -1
                self._regions[r["index"]] = AttachedRegion(fd, str(r["name"]), int(r["index"]), int(r["nbytes"]), geo,
                                                           self.worker_pid, self._t.worker_uid)
        except (KeyError, TypeError, ValueError) as e:
            self._abandon(fds)
            raise ConnectError(f"worker {name!r} sent a malformed WELCOME ({type(e).__name__}: {e})") from None
        except BaseException:
            self._abandon(fds)
            raise
        self._slots = SlotPool(
            self._regions, [_Slot(r, i, self._regions[r].geometry.slot_nbytes(i), g, False) for r, i, g in w["lease"]],
            self._t.send, linger_s)
        self._inflight = Inflight(self._t, self._on_control)
        self._inflight.unpark = self._slots.unpark
        self._borrow_gate = threading.BoundedSemaphore(2)  # threads waiting at the worker for a borrowed slot
        self._control: dict[int | None, ControlMessage] = {}  # replies by the id of the request they answer
        self._nowait_thread = 0  # the thread in a _submit(nowait=True), which must not wait for a control reply
        self._asking: set[int] = set()  # ids of ACQUIRE/MANAGE still waited for
        self._ctl_id = itertools.count(1)
        # an event loop's questions (AsyncClient): sent without waiting, the reply kept for the same question asked
        # again (question bytes without their id -> its id); on_answer(id) runs, on the routing thread under the
        # in-flight table's lock, when a reply to one of them comes (None: questions asked on the loop wait off it)
        self._asked: dict[bytes, int] = {}
        self._asked_ids: set[int] = set()  # their ids (looked up by the routing thread: a set's look-up is one step)
        self.on_answer: Callable[[int], None] | None = None
        self._rid = itertools.count(1)
        self._desc_cache: dict[Any, tuple[bytes, int, int, tuple[str, ...]]] = {}
        self._templates = DescTemplates(self._encode, self._attr_kinds)  # descriptors by patching numbers in
        self._plans: dict[Any, CallPlan] = {}  # call() signatures -> slot layout and descriptor (_callplan)
        # the loan of the last call() that ended well, its slot still open and its output views made (_call_now):
        # one, rarely two (threads ending calls at once); list pop/append are single steps under the GIL, so two
        # threads never get the same loan
        self._kept: list[Loan] = []
        self._params: dict[str, frozenset[str]] = {}  # op -> its input names (which keywords are tensors)
        self._out_checks: dict[Any, OutputCheck] = {}  # responses already checked, by their bytes (Loan._response)
        self._specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        self._sizer = OutputSizer(lambda msg: self._ask(msg, time.monotonic() + self.timeout_s))

    # ------------------------------------------------------------ lifecycle

    def _abandon(self, fds: list[int]) -> None:
        """Undo a connect that failed half-way: fds not mapped yet, regions mapped, the session."""
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        for reg in self._regions.values():
            reg.close()
        self._t.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the lease (BYE) and unmap. Idempotent; views still alive keep their pages mapped."""
        if self._closed or forked_since(self._fork_gen):
            self._closed = True
            return
        self._inflight.close()
        while self._drop_kept():  # (two threads ending calls at once may each have kept one)
            pass
        with self._lock:
            self._closed = self._slots.closed = True
            for fin in self._inflight._fail_all():  # futures still waiting finish with ClientClosedError
                fin()
            self._t.close(bye=True)
            for r in self._regions.values():
                r.close()
            self._regions.clear()

    def _check(self) -> None:
        if forked_since(self._fork_gen):
            raise ForkedClientError(f"this Client was created in process {self._pid}; "
                                    "a forked child must create its own Client")
        if self._closed:
            raise ClientClosedError("the Client is closed")

    @property
    def worker_alive(self) -> bool:
        """False once the worker process is known to have exited."""
        return self._t.worker_alive()

    # ------------------------------------------------------------ slots

    def _on_control(self, frame: bytes) -> None:
        try:
            msg = decode(frame)
        except MessageError:
            return
        rid = getattr(msg, "id", None)
        if rid is not None and rid not in self._asking:
            if isinstance(msg, Grant):  # a late GRANT: its ACQUIRE gave up, so the slot goes straight back
                self._t.send(m.SLOT_STRUCT.pack(m.RELEASE, msg.region, msg.slot))
            return
        self._control[rid] = msg
        if rid is not None and rid in self._asked_ids and self.on_answer is not None:
            self.on_answer(rid)

    # ---- the interface loans and futures use (they reach no other member of the client) ----

    def _next_rid(self) -> int:
        """A fresh request id."""
        return next(self._rid) & 0xFFFFFFFF

    def _ring(self, s: _Slot, rid: int, trace: bytes, future: Any) -> None:
        """Ring the worker for request ``rid``, written in ``s``: through the lane when it may carry it (a
        request whose own caller waits, or an event loop's, which then watches the lane for it (``_Reply._on_lane``);
        no receiver thread, nothing else in flight: :meth:`Inflight.ring_lane`),
        else over ZeroMQ, with a trace context tail when traced. ``future`` (if any) is finished by whichever thread
        routes the answer; the lane's waiter reads its answer in the page (:meth:`_lane_wait`)."""
        lane = self._t.lane
        finish, deadline, watched, on_lane = (None, None, False, None) if future is None else (
            future._finish, future._deadline, future._watched, future._on_lane)
        frame = _CALL_PACK(m.CALL, s.region, s.index, rid, s.generation)
        if (lane is not None and not trace and (future is None or not self._inflight.receiving)
                and self._inflight.ring_lane(lane, frame, rid, s, finish, deadline, watched, on_lane is not None)):
            if on_lane is not None:
                on_lane(lane, future)
            return
        self._inflight.add(rid, s, finish, deadline, watched)
        try:
            self._t.send(frame + trace)
        except BaseException:
            self._inflight.discard(rid)
            s.in_flight = None
            raise

    def _forget_future(self, rid: int) -> None:
        """The future of ``rid`` gave up waiting: a late DONE only frees its slot."""
        self._inflight.forget_future(rid)

    def _no_answer_error(self) -> BaseException:
        """Why a request got no answer: the worker gone (even when the client was closed since: a done-callback of
        one of its futures may close it, as ``Pool`` does, before the others are finished), the client closed, or
        time ran out."""
        if self._t.gone:
            return WorkerGoneError(self._t.gone)
        if self._closed:
            return ClientClosedError("the Client was closed before the answer came")
        return Timeout(f"no answer from worker {self.name!r} in time")

    def _give_back_slot(self, s: _Slot) -> None:
        """A loan is done with ``s`` (nothing to do after a fork or close: the slots are not ours then)."""
        if forked_since(self._fork_gen) or self._closed:
            return
        self._slots.release(s)

    def _lane_wait(self, lane: ClientLane, deadline: float) -> None:
        """Wait for the answer to the request in the lane and route it like a DONE from the socket.

        Raises:
            Timeout: ``deadline`` passed first (the request stays in the lane; a later ring collects it).
            WorkerGoneError: the worker exited (every waiter and future learns it too).
            RequestError: the page's answer is not that request's DONE.
        """
        try:
            done = lane.wait(deadline, self._t.pidfd, self.name)
        except WorkerGoneError:
            self._inflight.worker_exited()
            raise
        finally:
            lane.waiting = False  # answered, or given up on: a later ring may collect a late answer
        self._inflight.complete(*done)

    def _pump(self, deadline: float | None, until: Any) -> None:
        """Wait until ``until()`` (evaluated under the in-flight table's lock: no locks in it)."""
        self._inflight.wait(until, deadline)

    def _take(self, nbytes: int, deadline: float) -> _Slot:
        """A slot of at least ``nbytes``: own free one, else borrowed, else wait for one."""
        if nbytes > self.geometry.max_slot_nbytes:
            raise RequestTooLargeError(
                f"the request needs {nbytes} bytes ({format_size_approx(nbytes)} with its descriptor and alignment) "
                f"but the largest slot holds {self.geometry.max_slot_nbytes} "
                f"({format_size(self.geometry.max_slot_nbytes)}): start the worker with a larger class in --slots",
                field="nbytes")
        while True:
            self._check()
            hit = self._take_free(nbytes)
            if hit is not None:
                return hit
            # our own requests in flight will free fitting slots: never park at the worker while they run
            busy = [s for s in self._inflight.slots() if s.nbytes >= nbytes]
            own_busy = bool(busy)
            wait_s = max(0.0, deadline - time.monotonic()) if self.on_busy == "wait" else 0.0
            gated = False
            if wait_s > 0 and not own_busy:
                # a few threads at a time wait at the worker (it bounds the ACQUIREs waiting per client:
                # --client-max-waiters); the others look at the free list again until it is their turn
                gated = self._borrow_gate.acquire(timeout=min(0.05, wait_s))
                if not gated:
                    if time.monotonic() >= deadline:
                        raise _no_slot(nbytes)
                    continue
            try:
                s = self._acquire(nbytes, 0.0 if own_busy else wait_s, deadline)
            except BusyError:
                if not own_busy or self.on_busy == "fail":
                    raise
                # until one of those is answered (at once if one was meanwhile): not until fewer requests are in
                # flight than before, which other threads' small requests could keep from happening, or which had
                # happened before the count was taken (a wait to the deadline for a slot free long since)
                try:
                    self._pump(deadline, lambda busy=busy: any(s.in_flight is None for s in busy))
                except Timeout:
                    raise _no_slot(nbytes) from None  # this request was not sent: a slot wait ran out
                continue
            finally:
                if gated:
                    self._borrow_gate.release()
            return self._slots.adopt(s)

    def _take_free(self, nbytes: int) -> _Slot | None:
        """A free slot of ours of at least ``nbytes``, or None; the slot of the kept call() loan counts as free."""
        hit = self._slots.take_free(nbytes)
        if hit is None and self._drop_kept():
            hit = self._slots.take_free(nbytes)
        return hit

    def _drop_kept(self) -> bool:
        """Give the kept call() loan's slot back to the free list; False when none was kept."""
        try:
            loan = self._kept.pop()
        except IndexError:
            return False
        loan.release()
        return True

    def _ask(self, msg: Acquire | Manage, deadline: float) -> ControlMessage:
        """Send ``msg`` under a fresh id and return the reply that echoes it (or an ERROR with no id).

        Raises:
            The error an ERROR reply carries; Timeout (a reply arriving later is matched by id: a GRANT
            goes back with RELEASE); _NoSlot in a ``_submit(nowait=True)``, which must not wait.
        """
        if self._nowait_thread == threading.get_ident():
            if self.on_answer is None or isinstance(msg, Acquire):
                raise _NoSlot()  # (a traced event loop, or an ACQUIRE: asked again off the loop)
            return self._ask_later(msg)
        rid = next(self._ctl_id) & 0x7FFFFFFF
        self._asking.add(rid)
        self._control.pop(None, None)
        try:
            self._t.send(dataclasses.replace(msg, id=rid).encode())
            self._pump(deadline, lambda: rid in self._control or None in self._control)
        finally:
            self._asking.discard(rid)
        reply = self._control.pop(rid, None) or self._control.pop(None)
        if isinstance(reply, ErrorReply):
            raise control_error(reply)
        return reply

    def _ask_later(self, msg: Manage) -> ControlMessage:
        """``_ask`` for an event loop (``on_answer`` set), which never waits: the reply of ``msg`` if it came (the
        question was asked before); else ask it, once, and raise ``_NoSlot`` naming the id its reply will carry
        (``on_answer`` is told when it comes, and the caller asks again)."""
        key = dataclasses.replace(msg, id=0).encode()
        rid = self._asked.get(key)
        if rid is not None:
            reply = self._control.pop(rid, None)
            if reply is None:
                raise _NoSlot(asked=rid)
            self.forget_question(rid)
            if isinstance(reply, ErrorReply):
                raise control_error(reply)
            return reply
        rid = next(self._ctl_id) & 0x7FFFFFFF
        self._asking.add(rid)
        self._asked[key] = rid
        self._asked_ids.add(rid)
        try:
            self._t.send(dataclasses.replace(msg, id=rid).encode())
        except BaseException:
            self.forget_question(rid)
            raise
        raise _NoSlot(asked=rid)

    def forget_question(self, rid: int) -> None:
        """An event loop's question ``rid`` is answered and read, or nobody waits for its reply any more."""
        self._asking.discard(rid)
        self._asked_ids.discard(rid)
        self._control.pop(rid, None)
        for key, r in list(self._asked.items()):
            if r == rid:
                del self._asked[key]

    def _acquire(self, nbytes: int, wait_s: float, deadline: float) -> _Slot:
        try:  # the worker answers BUSY at the deadline; a GRANT later than the grace goes back with RELEASE
            g = self._ask(Acquire(nbytes, wait_s), deadline + _GRANT_GRACE_S)
        except Timeout:
            raise _no_slot(nbytes) from None
        if not isinstance(g, Grant):
            raise ConnectError(f"the worker answered ACQUIRE with {g.NAME}")
        return _Slot(g.region, g.slot, g.slot_nbytes, g.generation, True)

    # ------------------------------------------------------------ requests

    def loan(self, nbytes: int | None = None, *, timeout_s: float | None = None) -> Loan:
        """Reserve a slot for the zero-copy path.

        Args:
            nbytes: at least this many bytes of tensors (inputs and outputs); default: the smallest slot.
            timeout_s: how long to wait for a free slot (default: the Client's timeout_s).

        Returns:
            A :class:`Loan`; use it as a context manager so the slot goes back when the block ends.

        Raises:
            BusyError, RequestTooLargeError, WorkerGoneError, Timeout.

        Example::

            with client.loan(1 << 20) as req:
                x = req.array("x", (1024,), "float32"); x[:] = 1
                out = req.send("scale", a=2.0)["out"]
        """
        self._check()
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        need = self.geometry.desc_nbytes + (nbytes or 1)
        return Loan(self, self._take(need, deadline))

    # ------------------------------------------------------------ resident tensors

    def put(self, name: str, array: Any, *, shared: bool = False, timeout_s: float | None = None) -> None:
        """Upload ``array`` once as the worker's resident tensor ``name`` (on the GPU with CuPy).

        Requests then refer to it with :class:`Resident` instead of shipping it. Names are private to
        this client unless ``shared``, which publishes ``shared/<name>`` to every client of the worker; either
        way the tensor is this client's: only it may replace or drop it, and the worker drops it when the
        client disconnects (or dies). A tensor meant to outlive its clients needs a client that stays.

        Raises:
            ResourceError: the worker's resident limit (``--resident-limit``) or device memory would be exceeded.
            InvalidRequestError: an empty ``name`` (``field="keep"``).

        Example::

            c.put("w", weights)
            y = c.call("gemm", x=x, w=Resident("w"))["out"]
        """
        full = f"shared/{name}" if shared else name
        a, wire = as_input("x", array)  # converted once (a GPU array stays one); call() takes it as it is
        try:
            self.call(Pipeline(outputs=()).then("echo", outputs={"out": full}), x=a, keep=(full,), timeout_s=timeout_s)
        except RequestError as e:
            if e.op == "echo":  # the step a put travels as: the caller called put (the worker's metrics say so too)
                e.op = "put"
            raise
        self._specs[full] = (a.shape, dtypes.numpy_dtype(wire))

    def drop(self, name: str, *, timeout_s: float | None = None) -> None:
        """Free resident tensor ``name`` (``shared/<name>`` for a shared one).

        Raises:
            KernelError: there is no such resident tensor (``field="resident"``).
            InvalidRequestError: ``shared/<name>`` belongs to another client (``field="resident"``).
            Both name the tensor (``tensor``).
        """
        self._check()
        try:
            self._ask(Manage("drop", name), time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s))
        except RequestError as e:
            e.tensor = e.tensor or name  # (the worker's ERROR to a MANAGE has no tensor field)
            raise
        self._specs.pop(name, None)

    def resident(self, *, timeout_s: float | None = None) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """This client's resident tensors and the shared ones: ``{name: (shape, dtype)}``."""
        self._check()
        reply = self._ask(Manage("list"), time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s))
        got = reply.resident if isinstance(reply, Managed) and reply.resident is not None else {}
        out = {k: (tuple(v["shape"]), dtypes.numpy_dtype(v["dtype"])) for k, v in got.items()}
        self._specs.update(out)
        return out

    def _resident_spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        if name not in self._specs:
            self.resident()
        if name not in self._specs:
            raise InvalidRequestError(f"no resident tensor {name!r}: put() it first", tensor=name, field="resident")
        return self._specs[name]
