"""What the worker's loop receives on its ZeroMQ socket, and a CALL's way to its run (docs/architecture.md).

:meth:`Calls._drain_socket` reads the turn's messages (at most 256) and hands each to :meth:`Calls._handle`:
control messages go to the sessions, a CALL to :meth:`Calls._on_call`, which serves it from its slot's express
entry (:meth:`._runs.Runs._serve_express`) or checks it in full (lease, header, descriptor, plan: cached per slot
by :mod:`._primed`) and then runs, parks or launches it (:mod:`._runs`). A lane's CALL enters at
:meth:`Calls._on_call` too, with its call_seq. :meth:`Calls._send` is the socket's only writer.

:class:`Calls` is that half of :class:`._loop.Worker`, which owns the state it uses.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import zmq

from shmrpc.kernels._backend_base import BoundRun
from shmrpc.kernels._errors import is_op_failure
from shmrpc.schema import messages as m
from shmrpc.schema.control import ErrorReply
from shmrpc.schema.errors import (
    BusyError,
    InternalError,
    InvalidRequestError,
    RequestError,
    RequestTooLargeError,
    StaleSlotError,
)
from shmrpc.schema.header import HEADER, HEADER_NBYTES, Flag
from shmrpc.schema.messages import NO_RESPONSE
from shmrpc.schema.naming import attach_path
from shmrpc.schema.zmqraw import EVENTS, NOBLOCK, POLLIN, RAW_GET, RAW_RECV, RAW_SEND, RCVMORE, SNDMORE

from ._batch import Pending
from ._dispatch import Dispatcher, Prepared, check_header
from ._lease import Slot
from ._poll import LoopPoll
from ._primed import Express, Primed, PrimedSlots
from ._sessions import _refusal
from ._shared import SharedOwners
from .config import WorkerConfig
from .metrics import GUESS_TOO_SMALL
from .region import Region

if TYPE_CHECKING:
    from ._lease import Leases
    from ._observe import Observer
    from ._sessions import Sessions

__all__ = ["Calls"]

log = logging.getLogger("shmrpc.server")

_NOBLOCK_SNDMORE = NOBLOCK | SNDMORE
_HEADER_UNPACK = HEADER.unpack_from
_GUESS = int(Flag.GUESS)
_CALL_NBYTES = m.CALL_STRUCT.size
_TRACED_CALL_NBYTES = m.CALL_STRUCT.size + m.TRACE_STRUCT.size


class Calls:
    """Receiving on the socket and taking CALLs in: the half of :class:`._loop.Worker` this module holds."""

    config: WorkerConfig
    regions: dict[int, Region]
    dispatch: Dispatcher
    leases: Leases
    sessions: Sessions
    observe: Observer
    shared: SharedOwners
    _sock: zmq.Socket[Any] | None
    _poller: LoopPoll | None
    _express: dict[bytes, tuple[Express, ...]]
    _primed: PrimedSlots
    _views: dict[tuple[int, int], memoryview]
    _pending: list[Pending]
    _joins: bool
    _desc_nbytes: int
    _inflight: Any  # the in-flight gauge (metrics)

    if TYPE_CHECKING:
        def _serve_express(self, ex: Express, frame: bytes, lane: int) -> bool: ...

        def _reply(self, identity: bytes, done: bytes, lane: int) -> None: ...

        def _finish(self, identity: bytes, s: Slot, view: memoryview, hdr: tuple[int, int, int], err: RequestError,
                    t0: float, stages: dict[str, float], prep: Prepared | None, lane: int,
                    label: str | None = None) -> None: ...

        def _complete(self, identity: bytes, s: Slot, view: memoryview, hdr: tuple[int, int, int], primed: Primed,
                      t0: float, lane: int, run: BoundRun | None = None) -> None: ...

        def _run_elsewhere(self, identity: bytes, s: Slot, view: memoryview, hdr: tuple[int, int, int],
                           primed: Primed, t0: float, lane: int) -> None: ...

        def _drain_done(self) -> None: ...

        def _state(self) -> bytes: ...

    def _drain_socket(self, stopping: bool) -> None:
        sock, poller = self._sock, self._poller
        assert sock is not None and poller is not None
        for i in range(256):  # bounded, so completions and pidfds get their turn
            # a ROUTER message: the peer's routing id, then its frames (libzmq never delivers a routing id alone)
            if i == 0:
                # the poll said the socket's fd turned readable: almost always a message, so receive it without
                # asking zmq.EVENTS first (a system call in libzmq; a receive that finds its pipe idle processes
                # the socket's commands itself, and then says Again only when nothing is queued)
                try:
                    identity = RAW_RECV(sock, NOBLOCK)
                except zmq.Again:
                    poller.used = False  # the receive asked the socket, as zmq.EVENTS would have
                    return
            elif RAW_GET(sock, EVENTS) & POLLIN:  # cheaper than catching zmq.Again
                identity = RAW_RECV(sock, NOBLOCK)
            else:
                poller.used = False  # asked after every send and receive of the turn so far
                return
            poller.used = True
            frame = RAW_RECV(sock, NOBLOCK)
            if RAW_GET(sock, RCVMORE):  # every message is one frame: say so rather than ignore it
                n = 1
                while RAW_GET(sock, RCVMORE):
                    RAW_RECV(sock, NOBLOCK)
                    n += 1
                self._refuse(identity, "bad_message", f"a message is one frame, this one had {n}", "frames")
                continue
            try:
                self._handle(identity, frame, stopping)
            except Exception as e:  # noqa: BLE001 - nothing a peer sends may stop the loop, and every message gets an answer
                log.exception("unexpected error handling a %r message", frame[:1])
                if frame[:1] != m.CALL:
                    self._refuse(identity, "bad_message", f"the message could not be handled ({type(e).__name__})")

    def _send(self, identity: bytes, frame: bytes) -> None:
        try:
            assert self._sock is not None and self._poller is not None
            self._poller.used = True
            RAW_SEND(self._sock, identity, _NOBLOCK_SNDMORE)
            RAW_SEND(self._sock, frame, NOBLOCK)
        except (zmq.Again, zmq.ZMQError) as e:  # peer gone (ROUTER_MANDATORY) or its queue full
            log.debug("could not send to a client: %s", e)

    def _refuse(self, identity: bytes, kind: str, message: str, field: str = "") -> None:
        self._send(identity, _refusal(kind, message, field))

    def _handle(self, identity: bytes, frame: bytes, stopping: bool) -> None:
        kind = frame[:1]
        if kind == m.CALL:
            self._on_call(identity, frame, stopping)
        elif kind == m.HELLO:
            self._refuse(identity, "bad_message", f"say HELLO on the attach socket {attach_path(self.config.name)}, "
                         "not on the ZeroMQ socket", "kind")
        elif kind == m.ACQUIRE:
            self.sessions.on_acquire(identity, frame)
        elif kind == m.RELEASE:
            self.sessions.on_release(identity, frame)
        elif kind == m.BYE:
            c = self.sessions.clients.get(identity)
            if c is not None:
                self.sessions.end_client(c, "it said BYE")
        elif kind == m.MANAGE:
            self.sessions.on_manage(identity, frame)
        elif kind == m.STATUS:
            c = self.sessions.clients.get(identity)
            if self.config.allow_uids and (c is None or c.uid != os.geteuid()):  # others can reach this socket
                self._refuse(identity, "refused", "with --allow-uid, STATUS is answered only to a session of the "
                             "worker's own uid", "status")
            else:
                self._send(identity, self._state())
        else:
            self._send(identity, ErrorReply(InvalidRequestError.code, "bad_message",
                                            f"unknown message kind {kind!r}", "kind").encode())

    def _on_call(self, identity: bytes, frame: bytes, stopping: bool, lane: int = 0) -> None:
        armed = self._express.get(frame[2:8])
        if armed is not None and len(frame) == _CALL_NBYTES and not stopping:
            for ex in armed:  # the slot's requests served lately, the last one first
                if ex.identity == identity and self._serve_express(ex, frame, lane):
                    return None
        tail = b""
        if len(frame) == _TRACED_CALL_NBYTES:  # a traced call: the client's trace context follows the CALL
            frame, tail = frame[:_CALL_NBYTES], frame[_CALL_NBYTES:]
        try:
            region, index, rid, gen = m.unpack_call(frame)
        except Exception:  # noqa: BLE001 - a malformed doorbell names no slot we could answer in
            c = self.sessions.clients.get(identity)
            self.observe.refused(c.pid if c else 0, InvalidRequestError("CALL frame is malformed", field="call"))
            return self._refuse(identity, "bad_message", "CALL frame is malformed", "call")
        c = self.sessions.clients.get(identity)
        try:
            if c is None:
                raise StaleSlotError("no lease: say HELLO first", field="client")
            if stopping:
                raise BusyError("the worker is shutting down", field="call")
            s = self.leases.begin(c.id, region, index, gen)
            if tail or self.observe.traces:
                self.observe.begin(region, index, tail)
        except RequestError as e:
            self.observe.refused(c.pid if c else 0, e)
            self._reply(identity, m.pack_done(region, index, rid, NO_RESPONSE | e.code), lane)
            return None
        t0 = time.perf_counter()
        key = (region, index)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = self.regions[region].slot_view(index)
        hdr = (rid, 0, gen)  # the response header's (request_id, op_code, generation)
        try:
            h = _HEADER_UNPACK(view)  # (request_id, op_code, payload_length, flags, generation), copied out
            hdr = (rid, h[1], gen)
            check_header(h, rid, gen, self._desc_nbytes)
            # a private copy: everything below reads these bytes, never the slot's again
            payload = bytes(view[HEADER_NBYTES:HEADER_NBYTES + h[2]])
            primed = self._primed.get(key, payload, h[1], h[3], c.id)
            if primed is None:  # not bytes validated in this slot lately: decode, validate, plan
                prep = self.dispatch.prepare(payload, h[1], h[3], s.nbytes, c.id)
                views = self.dispatch.views(prep, view)
                primed = Primed(payload, h[1], h[3], c.id, prep, views, self.dispatch.bind(prep, views))
                self._primed.put(key, primed)
            prep = primed.prep
            if prep.keep_as:
                # shared/ names: only their owner may replace them (and the request is counted until it finishes)
                self.sessions.claim_keeps(identity, c.id, prep.keep_as.values())
        except RequestError as e:
            if e.field == "outputs" and type(e) is RequestTooLargeError and h[3] & _GUESS:
                # the client's guessed room was too small: it asks for the sizes and sends it again (not a failure)
                return self._finish(identity, s, view, hdr, e, t0, {}, None, lane, GUESS_TOO_SMALL)
            return self._finish(identity, s, view, hdr, e, t0, {}, None, lane)
        except BaseException as e:  # noqa: BLE001 - answered: the slot's lease began, it must not stay in flight
            if not is_op_failure(e):
                raise
            log.exception("validation failed unexpectedly")
            return self._finish(identity, s, view, hdr, InternalError(f"validation failed: {e}"), t0, {}, None, lane)
        self._inflight.value += 1
        parked = prep.batch and self._joins
        if (parked or prep.plan is None or prep.inline) and not tail and not self.observe.traces:
            # the slot's next requests may take the express path (parked, or run inline, as this one)
            self._primed.arm(Express.of(identity, c, s, view, primed, gen))
        if parked:  # run at the end of this turn, with others of its plan if any came
            self._pending.append(Pending(identity, s, view, hdr, primed, t0, lane))
        elif prep.plan is None or prep.inline:
            self._complete(identity, s, view, hdr, primed, t0, lane)
            if self.dispatch.fatal:
                self._drain_done()
        else:
            self._run_elsewhere(identity, s, view, hdr, primed, t0, lane)
        return None
