"""The requests in flight of one Client, and the one receive path every waiter shares.

Whoever waits for an answer pumps the socket for everybody (the *leader*); other
waiting threads sleep on one condition until a routed frame or a leadership
hand-off wakes them (the *followers*)::

    thread waits ──▶ lead lock free? ──yes──▶ lead: poll the socket's fd, drain, route ──▶ own answer? ──▶ return
                         │                            ▲                                    │ no  (lead released,
                         no                           └────────────────────────────────────┘      followers woken)
                         ▼
                     sleep on the condition ◀── woken by every routed batch and every leader leaving

A lone caller therefore pumps its own answer on its own thread (no hand-off, the
fast path). A background *receiver* thread (started by :meth:`Inflight.start_receiver`,
which ``Client.submit`` does) leads while futures are in flight and no other thread
leads or waits, so futures complete when their answer arrives even when nobody asks
for their result. It sleeps otherwise, and a thread that comes to wait while it leads
asks it to step aside (:meth:`Inflight.wait`): answers go to the thread that wants them.

Routing a DONE marks its slot answered; a future registered with the request is
then finished on the thread that routed it, after every lock is released.

Locks, always taken in this order: the Connection's socket lock, then the
condition's lock. Nobody waits on the condition while holding the socket lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from shmrpc.schema import messages as m
from shmrpc.schema.errors import Timeout, WorkerGoneError

from ._connection import Connection
from ._lane import ClientLane
from ._slot import _Slot

__all__ = ["Inflight"]

_RECEIVER_SLICE_S = 0.05  # how often the receiver thread looks at futures' deadlines and at close()


class _Entry:
    """One request in flight: its slot, and the callback that finishes its future (if any)."""

    __slots__ = ("slot", "finish", "deadline")

    def __init__(self, slot: _Slot, finish: Callable[[], None] | None, deadline: float | None) -> None:
        self.slot, self.finish, self.deadline = slot, finish, deadline


class Inflight:
    """Request ids in flight → slots; the leader/follower pump; the optional receiver thread.

    The small interface that loans, futures, the sync and the async clients use:
    :meth:`add`, :meth:`discard`, :meth:`wait`, :meth:`start_receiver`, :meth:`close`.
    """

    def __init__(self, conn: Connection, on_control: Callable[[bytes], None]) -> None:
        self._conn = conn
        self._on_control = on_control
        # NOTE: the hot paths take the condition's lock itself (a C-level `with`; the condition's own is a Python
        # call): the same lock, so notify and wait work under it
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._table: dict[int, _Entry] = {}
        self.unpark: Callable[[], None] | None = None  # SlotPool.unpark: run once a parked slot's request is answered
        self._lead = threading.Lock()  # held by the thread that pumps for everybody
        self._followers = 0  # threads waiting on the condition
        self.pulses = 0  # PULSE frames received (a DONE near: schema/messages.py)
        self._receiver: threading.Thread | None = None
        self._stop = False
        # the receiver thread steps aside for a thread that waits for its own answer (see wait): whether it leads now,
        # how many threads ask it to step aside, whether it waits for them to be done
        self._receiver_leads = False
        self._asks = 0
        self._receiver_aside = False
        self._futures = 0  # entries whose future is not finished yet: the receiver leads only while there are some
        self.handovers = 0  # times a waiting thread asked the receiver to step aside (for tests and debugging)
        self.receiver_turns = 0  # times the receiver took the lead (the same)

    # ------------------------------------------------------------ the table

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, rid: int) -> bool:
        return rid in self._table

    def slots(self) -> list[_Slot]:
        """The slots of the requests in flight (a snapshot)."""
        with self._cond:
            return [e.slot for e in self._table.values()]

    def add(self, rid: int, slot: _Slot, finish: Callable[[], None] | None = None,
            deadline: float | None = None, watched: bool = False) -> None:
        """Expect a DONE for ``rid`` in ``slot``; ``finish`` runs (on the routing thread) once it came. ``watched``:
        something other than its ``result()`` waits for the future already (see :meth:`watch`)."""
        with self._lock:
            self._table[rid] = _Entry(slot, finish, deadline)
            if finish is not None:
                self._one_more_future(watched)

    def ring_lane(self, lane: ClientLane, frame: bytes, rid: int, slot: _Slot,
                  finish: Callable[[], None] | None = None, deadline: float | None = None,
                  watched: bool = False, loop: bool = False) -> bool:
        """:meth:`add` and ring the CALL ``frame`` through ``lane``, only when nothing else is in flight (a lane
        carries a request only then: check and ring are one step under the table's lock); False: not added.

        A synchronous request (no ``finish``) holds the lane's wait from its ring: its caller reads the answer
        (:meth:`claim_lane` takes it for a future's). So does an event loop's (``loop``: ``AsyncClient``, which reads
        the answer when the lane's eventfd says so; the ring asks the worker to write it). A request left in the lane
        by a wait that gave up is collected first if its answer came (else the lane stays busy and this one goes over
        ZeroMQ).
        """
        fin = None
        with self._lock:
            if lane.busy:
                if lane.waiting:  # its answer is another thread's to read
                    return False
                done = lane.answer()  # (a malformed answer raises here: the caller's request was not added)
                if done is None:
                    return False
                fin = self._answered(done[2], done[3])
                if self._followers:
                    self._cond.notify_all()
            ok = not self._table
            if ok:
                lane.ring(frame, rid, loop)
                lane.waiting = finish is None or loop
                self._table[rid] = _Entry(slot, finish, deadline)  # after the ring (under the lock): off its way
                if finish is not None:
                    self._one_more_future(watched)
        if fin is not None:
            fin()
        return ok

    def _one_more_future(self, watched: bool) -> None:
        """A future joined the table (call holding the lock); one already watched wakes the receiver (:meth:`watch`)."""
        self._futures += 1
        if watched:
            self._rouse()

    def _rouse(self) -> None:
        """A future in flight is watched (call holding the lock): the receiver, asleep while no thread leads, leads now
        unless a thread that waits leads (it routes every answer while it waits; it wakes the receiver when it leaves
        with futures in flight: see wait)."""
        if self._receiver_aside and not self._asks and not self._lead.locked():
            self._cond.notify_all()

    def watch(self) -> None:
        """Something other than a future's ``result()`` waits for it (a done-callback, ``concurrent.futures.wait`` or
        ``as_completed``, a look at ``done()``): the receiver thread takes the lead now rather than at its next slice.

        A future nobody watches does not wake the receiver when it is sent: its caller usually waits for it at once
        (``submit().result()``) and then receives its answer itself, and a wake of the receiver per request cost more
        than the rest of the future (``bench/receiver_lead.py``). Unwatched, it is finished by the thread that leads
        when its answer comes, or by the receiver within :data:`_RECEIVER_SLICE_S`."""
        if self._receiver is None:
            return
        with self._lock:
            if self._futures:
                self._rouse()

    def claim_lane(self, lane: ClientLane, rid: int) -> bool:
        """Take the wait for ``rid`` in ``lane`` (a future's request that rode it) unless another thread holds it or
        the answer was collected; False: wait for it the other way (the pump)."""
        with self._lock:
            if lane.busy != rid or lane.waiting:
                return False
            lane.waiting = True
            return True

    def discard(self, rid: int) -> None:
        """Stop expecting ``rid`` (its CALL was never sent)."""
        with self._cond:
            e = self._table.pop(rid, None)
            if e is not None and e.finish is not None:
                self._futures -= 1

    def forget_future(self, rid: int) -> None:
        """The future of ``rid`` finished without its answer (timed out): a late DONE only frees the slot."""
        with self._cond:
            e = self._table.get(rid)
            if e is not None and e.finish is not None:
                e.finish = None
                self._futures -= 1

    # ------------------------------------------------------------ routing

    def _route(self, frames: list[bytes]) -> list[Callable[[], None]]:
        """Route drained frames (called holding the socket lock); returns the futures' finishers to run."""
        finishers = []
        with self._cond:
            for frame in frames:
                if frame[:1] == m.DONE:
                    _, _, rid, status = m.unpack_done(frame)
                    fin = self._answered(rid, status)
                    if fin is not None:
                        finishers.append(fin)
                elif frame == m.PULSE:  # a DONE is near: the frame's only work was waking this process
                    self.pulses += 1
                else:
                    self._on_control(frame)
            if self._followers:
                self._cond.notify_all()
        return finishers

    def _fail_all(self) -> list[Callable[[], None]]:
        """The worker is gone: every registered future finishes (with WorkerGoneError); waiters are woken."""
        with self._cond:
            finishers = [e.finish for e in self._table.values() if e.finish is not None]
            for e in self._table.values():
                e.finish = None
            self._futures = 0
            self._cond.notify_all()
        return finishers

    def _expire(self, now: float) -> list[Callable[[], None]]:
        """Futures past their deadline finish (with Timeout); their slots stay in flight until the DONE."""
        out = []
        with self._cond:
            for e in self._table.values():
                if e.finish is not None and e.deadline is not None and now >= e.deadline:
                    out.append(e.finish)
                    e.finish = None
                    self._futures -= 1
        return out

    def pump_once(self, wait_s: float) -> None:
        """Drain and route what is queued; when nothing is, wait up to ``wait_s`` for the socket or the worker.

        Raises:
            WorkerGoneError: the worker process exited (every future is finished with it first).
        """
        try:
            finishers = self._conn.drain(wait_s, self._route)
        except WorkerGoneError:
            for fin in self._fail_all():
                fin()
            raise
        for fin in finishers:
            fin()

    def complete(self, region: int, index: int, rid: int, status: int) -> None:
        """Route a DONE that came another way than the socket (a lane's page), as if it had been received."""
        with self._lock:
            fin = self._answered(rid, status)
            if self._followers:
                self._cond.notify_all()
        if fin is not None:
            fin()

    def _answered(self, rid: int, status: int) -> Callable[[], None] | None:
        """The DONE of ``rid`` came (call holding the condition's lock): its slot is free with ``status``;
        returns its future's finisher, if any."""
        e = self._table.pop(rid, None)
        if e is None:
            return None
        e.slot.status = status
        e.slot.in_flight = None
        if e.finish is not None:
            self._futures -= 1
            return e.finish
        # a slot whose loan ended while its request was in flight (a cancelled task's, say) goes back now
        return self.unpark if e.slot.parked else None

    def pump_now(self, limit: int = 1 << 30, woken: bool = False) -> bool:
        """Route up to ``limit`` queued frames, never waiting (an event loop's reader on the socket's fd calls
        this; ``woken``: its reader on the wake eventfd); returns whether more are queued (the caller calls again
        soon: the fd will not say so)."""
        finishers, more = self._conn.drain_now(self._route, limit, woken)
        for fin in finishers:
            fin()
        return more

    def worker_exited(self) -> None:
        """The worker's pidfd became readable: every future finishes with WorkerGoneError, waiters wake."""
        self._conn.exited()
        for fin in self._fail_all():
            fin()

    def expire(self) -> None:
        """Finish the futures past their deadline with Timeout (an event loop calls this periodically)."""
        for fin in self._expire(time.monotonic()):
            fin()

    # ------------------------------------------------------------ waiting

    def wait(self, until: Callable[[], bool], deadline: float | None, receiver: bool = False) -> None:
        """Return once ``until()`` is true, pumping for everybody while no other thread does.

        ``until`` is called with and without the condition's lock held: it must take no lock.

        A thread that finds the receiver thread leading asks it to step aside (``receiver``: the caller is that thread,
        whose ``until`` then turns true): it wakes the receiver, which leaves the lead on its next look, so the asking
        thread takes it and receives its own answer on its own thread. The hand-over happens while the request runs;
        without it the answer would wake the receiver, which would then wake the waiter: one thread hand-off more
        after the answer came.

        Raises:
            Timeout: ``deadline`` (time.monotonic) passed first.
            WorkerGoneError: the worker process exited.
        """
        cond, lead = self._cond, self._lead
        asked = False  # this thread counts in _asks, until it leads or returns
        try:
            while True:
                if until():
                    return
                if receiver:
                    with cond:  # the flag with the lead, so a thread that finds the lead taken sees who took it
                        got = lead.acquire(blocking=False)
                        self._receiver_leads = got
                        self.receiver_turns += got
                else:
                    got = lead.acquire(blocking=False)
                if got:  # the leader: keeps the lead until its own answer is here
                    if asked:
                        with cond:
                            self._asks -= 1
                        asked = False
                    try:
                        while not until():
                            self.pump_once(self._left(deadline))
                    finally:
                        if receiver:
                            with cond:
                                self._receiver_leads = False
                        lead.release()
                        if self._followers or (self._receiver_aside and self._futures):
                            with cond:
                                cond.notify_all()  # a follower, or the receiver for the futures in flight, may lead
                    return
                left = self._left(deadline)
                with cond:
                    self._followers += 1
                    try:
                        # checked under the lock routing notifies under: no wake-up is lost
                        if not until() and lead.locked():
                            if self._receiver_leads and not receiver:
                                if not asked:
                                    self._asks += 1
                                    self.handovers += 1
                                    asked = True
                                self._conn.wake()  # the receiver looks up from its wait and steps aside
                            cond.wait(None if left < 0 else left)
                    finally:
                        self._followers -= 1
        finally:
            if asked:
                with cond:
                    self._asks -= 1
                    if not self._asks and self._receiver_aside:
                        cond.notify_all()  # the receiver may lead again

    def _left(self, deadline: float | None) -> float:
        """Seconds to ``deadline`` (-1: none). Raises WorkerGoneError or Timeout when it is time to stop."""
        conn = self._conn
        if conn.gone:
            raise WorkerGoneError(conn.gone)
        if deadline is None:
            return -1.0
        left = deadline - time.monotonic()
        if left <= 0:
            raise Timeout(f"no answer from worker {conn.name!r} in time")
        return left

    # ------------------------------------------------------------ the receiver thread

    @property
    def receiving(self) -> bool:
        """True while the background receiver thread runs."""
        return self._receiver is not None

    def start_receiver(self) -> None:
        """Start the background receiver thread (idempotent): futures then finish without a waiter."""
        with self._cond:
            if self._receiver is not None or self._stop:
                return
            t = threading.Thread(target=self._receive, name=f"shmrpc-receiver-{self._conn.name}", daemon=True)
            self._receiver = t
        t.start()

    def _receive(self) -> None:
        cond, lead = self._cond, self._lead
        while not self._stop:
            # aside while no future is in flight (nothing to finish: a call()'s waiter receives its own answer), while
            # threads wait for their own answers (see wait) or while another thread leads: they route every answer
            if self._asks or not self._futures or lead.locked():
                # (not counted among the followers, which every routed answer wakes: the leaders that leave, the asks
                # that end and the futures that come wake it when it has a future to finish; the flag is set before
                # the lead is looked at again, and a leader looks at the flag after it let go of the lead)
                with cond:
                    self._receiver_aside = True
                    try:
                        if (self._asks or not self._futures or lead.locked()) and not self._stop:
                            cond.wait(_RECEIVER_SLICE_S)
                    finally:
                        self._receiver_aside = False
                for fin in self._expire(time.monotonic()):
                    fin()
                continue
            # a future came and nobody leads: first a moment for the thread that submitted it, which often waits for it
            # at once (submit().result()), to take the lead itself, so that it receives its own answer without asking
            # this thread to step aside (the sleep lets that thread have the GIL; it holds the lead by the time it
            # sleeps in its poll)
            time.sleep(0)
            if lead.locked():
                continue
            try:
                self.wait(lambda: self._stop or self._asks > 0 or not self._futures,
                          time.monotonic() + _RECEIVER_SLICE_S, receiver=True)
            except Timeout:
                pass
            except WorkerGoneError:
                return
            except Exception:  # noqa: BLE001 - the socket closed under us at close(): the thread ends
                if self._stop:
                    return
                raise
            for fin in self._expire(time.monotonic()):
                fin()

    def close(self) -> None:
        """Stop the receiver thread (it notices within one slice) and wait for it."""
        with self._cond:
            self._stop = True
            t = self._receiver
            self._cond.notify_all()
        if t is not None and t is not threading.current_thread():
            self._conn.wake()
            t.join(timeout=5.0)

    def snapshot(self) -> dict[str, Any]:
        """For tests and debugging: ids in flight, whether the receiver runs, how often a waiting thread asked it to
        step aside and how often it took the lead."""
        with self._cond:
            return {"in_flight": sorted(self._table), "receiving": self._receiver is not None,
                    "handovers": self.handovers, "receiver_turns": self.receiver_turns}
