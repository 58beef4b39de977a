"""How the worker's loop runs a request it validated, and answers it (docs/architecture.md).

A request runs on the loop thread (little estimated work), is parked until the end of the loop's
turn and run with the turn's other requests of its plan as one batch (:mod:`._batch`), is launched
on the device and answered by the loop once the device is done (a batch or a large request a graph
serves: ``Backend.launch_batch`` / ``Backend.launch``), or runs in the executor, which writes the
response, queues the DONE and wakes the loop through a pipe. Every path writes the response
descriptor first and the header last (:func:`write_response`), then sends the DONE through
:meth:`Runs._done_sent`, into the client's lane when the CALL came that way (:meth:`Runs._reply`).
A request of an armed slot (:mod:`._primed`) is served and answered by :meth:`Runs._serve_express`.

:class:`Runs` is that half of :class:`._loop.Worker`, which owns the state it uses.
"""

from __future__ import annotations

import collections
import logging
import os
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from shmrpc.kernels._backend_base import BoundRun, RunLaunch
from shmrpc.kernels._errors import is_op_failure
from shmrpc.schema import messages as m
from shmrpc.schema.errors import WIRE_CODES, InternalError, RequestError
from shmrpc.schema.header import HEADER, HEADER_NBYTES, Flag

from ._batch import Pending, group_by_plan
from ._dispatch import Dispatcher, Launched, Prepared, encode_error
from ._lanes import Lanes, Linger
from ._lease import Slot
from ._poll import LoopPoll
from ._primed import Express, Primed, PrimedSlots
from .metrics import Metrics

if TYPE_CHECKING:
    from ._lease import Leases
    from ._observe import Observer
    from ._sessions import Sessions
    from ._shared import SharedOwners

__all__ = ["Done", "Runs", "write_response", "SPIN_POLL_S"]

log = logging.getLogger("shmrpc.server")

SPIN_POLL_S = 5e-6  # while spinning with lanes, poll the socket and fds this often (lanes are read in between)
_LAUNCHED_SPIN_S = 2e-3  # a launched run is spun for from this long before it is due to this long after, then polled 1 ms
_LAUNCHED_EARLY_S = 5e-4  # ... after one poll until this long (or 15% of what is left, if more) before it is due
# A launched request due at least PULSE_MIN_S after its launch gets a PULSE (its lane: a write of the client's eventfd)
# PULSE_LEAD_S before it is due, so the DONE after it finds the client's threads, and ZeroMQ's on both sides, awake:
# on the GPU host a thread asleep for milliseconds woke tens of µs later than one asleep for µs, and a DONE over
# ZeroMQ wakes three in a row
# (docs/architecture.md "The PULSE"). PULSE_LEAD_S < _LAUNCHED_EARLY_S <= _LAUNCHED_SPIN_S: the loop spins by then.
PULSE_LEAD_S = 2e-4
PULSE_MIN_S = 1e-3
_BATCH_RECENT_S = 2e-3  # --batch-wait-us holds parked requests only this soon (or 20 waits) after a batched run
_OK_FLAGS = int(Flag.RESPONSE)
_ERROR_FLAGS = int(Flag.RESPONSE | Flag.ERROR)
_HEADER_PACK = HEADER.pack_into
_pack_done = m.pack_done
_DONE_PACK, _DONE = m.DONE_STRUCT.pack, m.DONE  # the express path packs its DONE without pack_done's call
_CALL_RID_GEN = struct.Struct("<II").unpack_from  # a CALL frame's request_id and generation, at offset 8
#: A request the executor answered: (identity, slot, header, status, t0, stage seconds, prep, lane).
Done = tuple[bytes, Slot, tuple[int, int, int], int, float, dict[str, float], Prepared | None, int]


class Runs:
    """Running and answering validated requests: the half of :class:`._loop.Worker` this module holds."""

    dispatch: Dispatcher
    metrics: Metrics
    _executor: ThreadPoolExecutor | None
    _done: collections.deque[Done]
    _pending: list[Pending]
    # a batch or a request on the device, what answers it once it is done, whether it is a batch (_await_launched)
    _launched: tuple[Launched | RunLaunch, Callable[[], None], bool] | None
    _max_batch: int
    _singles: bool  # a lone parked request runs as a batch of one (Backend.batches_singles)
    _batch_wait_s: float  # --batch-wait-us
    _last_batch: tuple[int, float]  # (size, time.perf_counter()) of the last batched run
    _hold_until: float  # parked requests wait for the rest of their batch until then (0: not waiting)
    _hold_for: int  # ... or until this many are parked
    _lanes: Lanes | None
    _linger: Linger  # the lanes' (schema/lane.py)
    _wake_w: int
    _stopping: bool
    _pulse: tuple[float, bytes, int] | None  # (when, identity, lane) of the launched request's PULSE still to send

    leases: Leases
    sessions: Sessions
    shared: SharedOwners
    observe: Observer
    _inflight: Any  # the in-flight gauge (metrics)
    _primed: PrimedSlots
    _views: dict[tuple[int, int], memoryview]
    _joins: bool
    _desc_nbytes: int

    if TYPE_CHECKING:
        def _send(self, identity: bytes, frame: bytes) -> None: ...

        def _on_call(self, identity: bytes, frame: bytes, stopping: bool, lane: int = 0) -> None: ...

        def stop(self) -> None: ...

    def _run_pending(self) -> None:
        """The end of a turn: run the parked batchable requests, one batch per plan (see :mod:`._batch`)."""
        pending, self._pending = self._pending, []
        groups = [pending] if len(pending) == 1 else group_by_plan(pending, self._max_batch)
        for group in groups:
            p = group[0]
            inline = p.primed.prep.inline
            if len(group) == 1:
                if not inline:
                    self._run_elsewhere(p.identity, p.slot, p.view, p.hdr, p.primed, p.t0, p.lane)
                    continue
                if not self._singles:  # a lone request: exactly the path it would take unbatched
                    self._complete(p.identity, p.slot, p.view, p.hdr, p.primed, p.t0, p.lane)
                    continue
                # else a batch of one (Backend.batches_singles): launched as the batches are, where the backend can
            else:
                self.metrics.observe_batch(p.primed.prep.op, len(group))
                self._last_batch = (len(group), time.perf_counter())
            if inline:
                plan = p.primed.prep.plan
                assert plan is not None
                # one launched run at a time: with one out (a batch launched earlier in this turn, or a large
                # request), this batch runs here and now
                h = None if self._launched is not None else \
                    self.dispatch.launch_batch(plan, [(q.primed.prep, q.primed.views) for q in group])
                if h is not None:  # on the device: the loop goes on, and answers the batch once it is done
                    self._launched = (h, lambda g=group, h=h: self._answer_batch(g, h), True)
                    continue
                for q, status, stages in self._execute_batch(group):
                    self._done_sent(q.identity, q.slot, q.hdr, status, q.t0, stages, q.primed.prep, lane=q.lane)
            else:
                assert self._executor is not None
                self._executor.submit(self._run_batch_async, group)
        if self.dispatch.fatal:
            self._drain_done()

    def _holding(self, stopping: bool) -> bool:
        """Whether the parked requests wait a little longer (``--batch-wait-us``): fewer are parked than the last
        batched run had, that run was recent (within _BATCH_RECENT_S, or 20 times the setting if longer), and the
        wait began less than the setting ago. Answered clients send again close together, one after the other; the
        first of them would otherwise run alone (or in a small batch) while the others park behind it."""
        if not self._batch_wait_s or stopping:
            self._hold_until = 0.0
            return False
        n, now = len(self._pending), time.perf_counter()
        if self._hold_until:
            if n < self._hold_for and now < self._hold_until:
                return True
            self._hold_until = 0.0
            return False
        size, at = self._last_batch
        if n >= size or now - at > max(_BATCH_RECENT_S, 20 * self._batch_wait_s):
            return False
        self._hold_until, self._hold_for = now + self._batch_wait_s, size
        return True

    def _spin(self, poller: LoopPoll, lane_rang: dict[int, int], end: float) -> dict[Any, int]:
        """Spin until ``end`` (time.perf_counter) for the next events: with lanes, their call_seq words are read on
        every pass and the poll (a system call) runs every SPIN_POLL_S; without, the poll runs on every pass.

        A lane's request found here is served here (``_on_call``, as the loop's turn would), and the spin goes on:
        the next request of a lane finds the loop spinning again as soon as the answer is out, not after a turn's
        bookkeeping and a poll. Parked requests (a batch), a launched run, an executor's answer or a stop end the
        spin at once (the loop's turn takes them), and so does ``end``: the loop turns at least every spin.

        Returns ``lane_rang`` for a lane's request (or once ``end`` passed after serving any here), the poll's
        events, or none once ``end`` passed or an executor's answer is queued (the caller polled just before: the
        first poll here comes SPIN_POLL_S later)."""
        lanes = self._lanes
        fold_few = self.metrics.fold_few
        now = time.perf_counter()
        next_poll = now + SPIN_POLL_S
        served = False
        while now < end and not self._done:
            if lanes is not None:
                if lanes.ready():
                    if self._pending or self._launched is not None or self._stopping:
                        return lane_rang
                    for lane, seq, frame in lanes.scan():
                        self._on_call(lane.identity, frame, False, seq)
                    served = True
                    if self._pending or self._launched is not None or self.dispatch.fatal:
                        return lane_rang
                    # on to the poll's turn below: it runs every SPIN_POLL_S, the lanes busy or not
                else:
                    # no request waits: the metrics of those answered are folded a few at a time (about 1 µs each), so
                    # that no turn's fold of many holds up a request rung meanwhile (metrics.TRICKLE)
                    fold_few()
                if now < next_poll:
                    now = time.perf_counter()
                    continue
                next_poll = now + SPIN_POLL_S
            events = poller.poll(0)
            if events:
                return events
            if lanes is None:
                fold_few()
            now = time.perf_counter()
        # NOTE: after a request served here, never an empty answer: the caller would sleep in its poll, and the
        # answer said this worker polls the lane for a while yet (its awake word): the turn runs, then a new spin
        return lane_rang if served else {}

    def _await_soon(self, poller: LoopPoll, lane_rang: dict[int, int], end: float) -> dict[Any, int]:
        """Read the lanes until one has a request (``lane_rang``: the loop's turn takes it) or ``end``
        (time.perf_counter) has passed ({}), polling the other fds every SPIN_POLL_S (their events, if any): the
        wait after an early ring (schema/lane.py). Unlike :meth:`_spin` it serves nothing and ends at the first
        request, so the loop's turn and its next wait are the usual ones."""
        lanes = self._lanes
        assert lanes is not None
        now = time.perf_counter()
        next_poll = now + SPIN_POLL_S
        while now < end and not self._done:
            if lanes.ready():
                return lane_rang
            if now >= next_poll:
                events = poller.poll(0)
                if events:
                    return events
                next_poll = now + SPIN_POLL_S
            now = time.perf_counter()
        return {}

    def _run_elsewhere(self, identity: bytes, s: Slot, view: memoryview, hdr: tuple[int, int, int], primed: Primed,
                       t0: float, lane: int) -> None:
        """A request too big for the loop thread: launched on the device and answered by the loop once it is done
        (``backend.launch``: a large request its chunk graph serves; one launched run at a time), else run by
        the executor."""
        if self._launched is None:
            h = self.dispatch.launch(primed.prep, primed.views)
            if h is not None:
                self._launched = (h, lambda: self._complete(identity, s, view, hdr, primed, t0, lane, h.finish), False)
                eta = h.eta
                if eta and eta - time.perf_counter() >= PULSE_MIN_S:
                    self._pulse = (eta - PULSE_LEAD_S, identity, lane)
                return
        assert self._executor is not None
        self._executor.submit(self._run_async, identity, s, view, hdr, primed, t0, lane)

    def _await_launched(self, poller: LoopPoll, lane_rang: dict[int, int], timeout_ms: int) -> dict[Any, int]:
        """The next events while a launched run is on the device, answering it as soon as it is done: a run whose
        duration is known (its ``eta``) is awaited in a poll until shortly before it is due (15% of what is left, at
        least _LAUNCHED_EARLY_S), then by polls of 1 ms until _LAUNCHED_SPIN_S before it is due; from then, and for
        the others from the start (small batches), the loop spins (lanes read, the poll every SPIN_POLL_S) until
        _LAUNCHED_SPIN_S past when it is due (or past the start), then polls 1 ms at a time; it spins, too, while the
        linger time of an answer has not passed. A request's PULSE goes
        out in the spin, PULSE_LEAD_S before it is due. No events within ``timeout_ms``: none (the loop's periodic
        work runs)."""
        assert self._launched is not None
        h, lanes = self._launched[0], self._lanes
        now = time.perf_counter()
        eta = getattr(h, "eta", 0.0)
        wake = eta - max(_LAUNCHED_EARLY_S, 0.15 * (eta - now)) if eta else now
        # NOTE: the spin is around when the run is due, not from the wake-up: spinning from 15% early would keep a
        # core busy for 15% of a long run, and ending 2 ms after the wake-up left a run of over about 13 ms to the
        # 1 ms polls at the moment it finished (before 2026-12-01)
        spin_from = eta - _LAUNCHED_SPIN_S
        end, next_poll, give_up = max(now, eta) + _LAUNCHED_SPIN_S, now, now + timeout_ms / 1000
        while now < give_up:
            if h.done():
                self._finish_launched()
                return poller.poll(0)
            pulse = self._pulse
            if pulse is not None and now >= pulse[0]:
                self._pulse = None
                self._send_pulse(pulse[1], pulse[2])
            if lanes is not None and lanes.ready():
                return lane_rang
            if now >= next_poll:
                if wake - now >= 1e-3:
                    wait_ms = int((wake - now) * 1000)
                else:
                    wait_ms = 0 if spin_from <= now < end else 1
                if wait_ms and self._linger.until_ns > time.monotonic_ns():
                    wait_ms = 0  # lingering (schema/lane.py): the lanes were told this loop reads them until then
                events = poller.poll(min(wait_ms, timeout_ms))
                if events:
                    return events
                next_poll = now + SPIN_POLL_S
            now = time.perf_counter()
        return {}

    def _send_pulse(self, identity: bytes, lane: int) -> None:
        """Tell a client that its launched request is nearly done: a PULSE frame, or a write of its lane's eventfd
        (the client wakes, finds no DONE, and waits again)."""
        if lane and self._lanes is not None:
            ln = self._lanes.by_identity.get(identity)
            if ln is not None:
                self._lanes.pulse(ln)
            return
        self._send(identity, m.PULSE)

    def _finish_launched(self) -> None:
        """Wait for the launched run (if any) and answer it."""
        launched, self._launched, self._pulse = self._launched, None, None
        if launched is None:
            return
        launched[1]()
        if self.dispatch.fatal:
            self._drain_done()

    def _answer_batch(self, group: list[Pending], h: Launched) -> None:
        results = h.finish()
        traces = self.observe.traces
        for q, r in zip(group, results):
            s = q.slot
            if type(r) is dict and not traces and s.owner is not None and not s.freeing:
                self._ok_sent(q.identity, s, q.view, q.hdr[0], q.hdr[1], q.hdr[2], q.primed.prep, q.t0, r, q.lane)
                continue
            for p, status, stages in self._respond_batch([q], [r]):  # an error, a trace, a slot gone: the full way
                self._done_sent(p.identity, s, p.hdr, status, p.t0, stages, p.primed.prep, lane=p.lane)

    def _execute_batch(self, group: list[Pending]) -> list[tuple[Pending, int, dict[str, float]]]:
        """Run one batch and write every request's response (or its own error) into its slot."""
        plan = group[0].primed.prep.plan
        assert plan is not None
        return self._respond_batch(group, self.dispatch.run_batch(plan, [(p.primed.prep, p.primed.views) for p in group]))

    def _respond_batch(self, group: list[Pending], results: list[dict[str, float] | RequestError]
                       ) -> list[tuple[Pending, int, dict[str, float]]]:
        """Write every request's response (or its own error) into its slot."""
        out: list[tuple[Pending, int, dict[str, float]]] = []
        for p, r in zip(group, results):
            stages: dict[str, float] = {}
            if isinstance(r, RequestError):
                status, payload = r.code, self._error_payload(r)
            else:
                status, stages, payload = 0, r, p.primed.prep.response
            write_response(p.view, p.hdr, payload, status)
            out.append((p, status, stages))
        return out

    def _run_batch_async(self, group: list[Pending]) -> None:
        t_start = time.perf_counter()
        done: list[tuple[Pending, int, dict[str, float]]]
        try:
            done = self._execute_batch(group)
        except BaseException as e:  # noqa: BLE001 - always answer
            log.exception("batch failed unexpectedly")
            err = self._error_payload(InternalError(f"the request failed: {type(e).__name__}: {e}",
                                                    op=group[0].primed.prep.desc.steps[0].op))
            done = []
            for p in group:
                write_response(p.view, p.hdr, err, InternalError.code)
                done.append((p, InternalError.code, {}))
        for p, status, stages in done:
            self._done.append((p.identity, p.slot, p.hdr, status, p.t0, dict(stages, queue=t_start - p.t0),
                               p.primed.prep, p.lane))
        os.write(self._wake_w, b"x")

    def _execute(self, view: memoryview, hdr: tuple[int, int, int], primed: Primed,
                 run: BoundRun | None = None) -> tuple[int, dict[str, float]]:
        """Run ``primed``'s request (``run``: another run of it, e.g. a launched one's finish) and write its response
        into the slot; returns (status, stage seconds)."""
        prep = primed.prep
        try:
            stages = self.dispatch.run_bound(prep, primed.bound if run is None else run)
            status, payload = 0, prep.response
        except BaseException as e:  # noqa: BLE001 - a bug must still be answered, or the slot would stay in flight
            if not is_op_failure(e):
                raise
            stages = {}
            status, payload = self._failure(prep, e)
        write_response(view, hdr, payload, status)
        return status, stages

    def _error_payload(self, err: RequestError) -> bytes:
        """The error response descriptor of ``err``, fitting the descriptor area (:func:`._dispatch.encode_error`:
        never raises, so every failed request is answered)."""
        return encode_error(err, self._desc_nbytes - HEADER_NBYTES)

    def _failure(self, prep: Prepared, e: BaseException) -> tuple[int, bytes]:
        """(status, error response descriptor) of a run of ``prep`` that raised ``e``."""
        if isinstance(e, RequestError):
            return e.code, self._error_payload(e)
        log.error("request failed unexpectedly", exc_info=e)
        err = InternalError(f"the request failed: {type(e).__name__}: {e}", op=prep.desc.steps[0].op)
        return err.code, self._error_payload(err)

    def _complete(self, identity: bytes, s: Slot, view: memoryview, hdr: tuple[int, int, int], primed: Primed,
                  t0: float, lane: int, run: BoundRun | None = None) -> None:
        status, stages = self._execute(view, hdr, primed, run)
        self._done_sent(identity, s, hdr, status, t0, stages, primed.prep, lane=lane)

    def _run_async(self, identity: bytes, s: Slot, view: memoryview, hdr: tuple[int, int, int], primed: Primed,
                   t0: float, lane: int) -> None:
        prep = primed.prep
        q = time.perf_counter() - t0
        try:
            status, stages = self._execute(view, hdr, primed)
        except BaseException as e:  # noqa: BLE001 - always answer
            log.exception("request failed unexpectedly")
            status, stages = InternalError.code, {}
            err = InternalError(f"the request failed: {type(e).__name__}: {e}", op=prep.desc.steps[0].op)
            write_response(view, hdr, self._error_payload(err), status)
        stages = dict(stages, queue=q)
        self._done.append((identity, s, hdr, status, t0, stages, prep, lane))
        os.write(self._wake_w, b"x")

    def _drain_done(self) -> None:
        while self._done:
            identity, s, hdr, status, t0, stages, prep, lane = self._done.popleft()
            self._done_sent(identity, s, hdr, status, t0, stages, prep, lane=lane)
        if self.dispatch.fatal and not self._stopping:
            # The GPU context is lost (a sticky CUDA error): answer what is in flight, then exit non-zero so a
            # supervisor starts a fresh process; clients see WorkerGoneError and reconnect.
            log.critical("unrecoverable backend error, stopping: %s", self.dispatch.fatal)
            self.stop()


    def _reply(self, identity: bytes, done: bytes, lane: int) -> None:
        """A DONE to the client: into its lane when the CALL came that way (``lane``: its call_seq), if it is still
        there."""
        if lane and self._lanes is not None:
            ln = self._lanes.by_identity.get(identity)
            if ln is not None:
                self._lanes.answer(ln, done, lane)
            return
        self._send(identity, done)


    def _serve_express(self, ex: Express, frame: bytes, lane: int) -> bool:
        """Serve a CALL straight from one of its slot's :class:`Express` entries; False: it is not what the entry
        holds (the next armed entry, or the full path, takes it).

        The checks are those of the full path, against values that passed them before: the sender's session
        is still the one of its token and holds the slot's lease at this generation with nothing in flight
        (``Leases.begin``), the header names this request and generation with the op code, descriptor length
        and flags validated for the entry (``check_header``), and the descriptor bytes in the slot equal the validated
        ones (``PrimedSlots.get``, compared on a private copy).
        """
        s = ex.slot
        rid, gen = _CALL_RID_GEN(frame, 8)
        if (s.generation != gen or s.owner != ex.session.id or s.in_flight or s.freeing
                or self.sessions.clients.get(ex.identity) is not ex.session):
            return False
        # the header (the doorbell's request_id, then the op code, length and flags validated for the entry and the
        # lease's generation) and the entry's validated descriptor bytes, compared on one private copy
        if ex.raw.raw != frame[8:12] + ex.expect:
            return False
        if ex.primed.prep.keep_as:
            # shared/ names: their owner may have changed since the entry was validated (its client dropped one and
            # another kept it); the full path refuses a request that keeps one it does not own
            try:
                self.sessions.claim_keeps(ex.identity, ex.session.id, ex.primed.prep.keep_as.values())
            except RequestError:
                return False
        view = ex.view
        t0 = time.perf_counter()
        s.in_flight = True
        self._primed.hits += 1
        self._inflight.value += 1
        primed = ex.primed
        op_code = primed.op_code
        prep = primed.prep
        if prep.batch and self._joins:  # parked for the end of the turn, as the full path parks it
            self._pending.append(Pending(ex.identity, s, view, (rid, op_code, gen), primed, t0, lane))
            return True
        bound = primed.bound
        try:  # Dispatcher.run_bound, written out: one call less per request
            stages = (bound() or {}) if bound is not None else {}
        except BaseException as e:  # noqa: BLE001 - answered as the full path answers it
            if not is_op_failure(e):
                raise
            hdr = (rid, op_code, gen)
            status, err_payload = self._failure(prep, self.dispatch.run_error(prep, e))
            write_response(view, hdr, err_payload, status)
            self._done_sent(ex.identity, s, hdr, status, t0, {}, prep, lane=lane)
            if self.dispatch.fatal:
                self._drain_done()
            return True
        self._ok_sent(ex.identity, s, view, rid, op_code, gen, prep, t0, stages, lane)
        return True

    def _ok_sent(self, identity: bytes, s: Slot, view: memoryview, rid: int, op_code: int, gen: int, prep: Prepared,
                 t0: float, stages: dict[str, float], lane: int) -> None:
        """The success half of :meth:`_execute` and :meth:`_done_sent` in one call: response, metrics, DONE, lease end;
        for a slot still its owner's (not freeing) and no trace to end (the express path, a launched batch's answers)."""
        payload = prep.response
        n = len(payload)
        view[HEADER_NBYTES:HEADER_NBYTES + n] = payload
        # NOTE: order is important here: the header goes last, after the descriptor it describes.
        _HEADER_PACK(view, 0, rid, op_code, n, _OK_FLAGS, gen)
        self.metrics.observe(prep.op, "ok", time.perf_counter() - t0, prep.nbytes_in, prep.nbytes_out, stages)
        self._inflight.value -= 1
        done = _DONE_PACK(_DONE, s.region, s.index, rid, 0)
        if lane:
            self._reply(identity, done, lane)
        else:
            self._send(identity, done)
        s.in_flight = False
        s.last_owner = s.owner

    def _finish(self, identity: bytes, s: Slot, view: memoryview, hdr: tuple[int, int, int], err: RequestError,
                t0: float, stages: dict[str, float], prep: Prepared | None, lane: int, label: str | None = None) -> None:
        """Answer a request refused or failed with ``err``; ``label``: its metrics status when it is not a failure
        (``GUESS_TOO_SMALL``: no failure log line either)."""
        self._primed.forget((s.region, s.index))
        write_response(view, hdr, self._error_payload(err), err.code)
        self._inflight.value += 1
        op = "pipeline" if err is self.dispatch.pipeline_refusal else self.observe.op_of(err, hdr[1])
        self._done_sent(identity, s, hdr, err.code, t0, stages, prep, op, lane, label)

    def _done_sent(self, identity: bytes, s: Slot, hdr: tuple[int, int, int], status: int, t0: float,
                   stages: dict[str, float], prep: Prepared | None, op: str = "unknown", lane: int = 0,
                   label: str | None = None) -> None:
        if prep is not None:
            op = prep.op
        if status:  # before DONE: after it the slot is the client's again
            if label is None:
                label = _status_name(status)
                c = self.sessions.clients.get(identity)
                self.observe.failed(c.pid if c else 0, op, label, self._views.get((s.region, s.index)),
                                    self._desc_nbytes)
            self.metrics.observe(op, label, time.perf_counter() - t0, 0, 0, stages)
        else:
            self.metrics.observe(op, "ok", time.perf_counter() - t0, prep.nbytes_in if prep else 0,
                                 prep.nbytes_out if prep else 0, stages)
        if prep is not None and prep.keep_as:  # what it kept goes with a session that ended meanwhile
            self.sessions.settle_keeps(identity, prep.keep_as.values(), status == 0)
        traced = self.observe.end_trace(s.region, s.index, t0) if self.observe.traces else None
        # Counted before DONE goes out, so a client that has its answer finds it in a scrape.
        self._inflight.value -= 1
        if s.owner is not None and not s.freeing:
            done = _pack_done(s.region, s.index, hdr[0], status)
            if lane:
                self._reply(identity, done, lane)
            else:
                self._send(identity, done)
        self.leases.end(s)
        if traced is not None:
            c = self.sessions.clients.get(identity)
            self.observe.record(traced, op, "ok" if status == 0 else label or _status_name(status), stages,
                                c.pid if c else 0, (s.region, s.index))
        if s.owner is None:
            self.sessions.close_idle_regions()
            self.sessions.serve_pending()


def write_response(view: memoryview, hdr: tuple[int, int, int], payload: bytes, status: int) -> None:
    """Response descriptor first, then the header (``hdr``: request_id, op_code, generation)."""
    n = len(payload)
    view[HEADER_NBYTES:HEADER_NBYTES + n] = payload
    # NOTE: order is important here: the header goes last, after the descriptor it describes.
    _HEADER_PACK(view, 0, hdr[0], hdr[1], n, _ERROR_FLAGS if status else _OK_FLAGS, hdr[2])


def _status_name(status: int) -> str:
    cls = WIRE_CODES.get(status & 0x7FFF)
    return cls.__name__ if cls else f"code{status}"
