"""The client's side of a lane (:mod:`shmrpc.schema.lane`): ring the worker and wait for its DONE.

One request at a time goes through the lane (a synchronous ``Loan.send`` or ``Client.call``
while nothing else is in flight); everything else, and every control message, goes over
ZeroMQ. Waiting spins on the page's done_seq for at most ``spin_s``, then blocks in epoll on
our eventfd (edge-triggered, so never read back) and the worker's pidfd, so a worker that dies
fails the wait at once. A spinning
lane whose last answer took longer than its spin budget (a large request) first blocks until
shortly before that time has passed again (15% of it, at least 0.2 ms), then spins: it is awake
when a request of the same length is answered, without spinning through all of it.

Awake words (schema/lane.py): a ring skips the worker's doorbell while the worker says it polls
the lane (``serve --spin-us``), and a lane that will spin from its ring says until when, so the
worker's answer can skip our eventfd; a wait then never sleeps past the latest time it said
without reading done_seq after it.

Early ring (schema/lane.py): ``call()`` of small inputs through an idle lane whose last ring found the worker asleep
(:attr:`ClientLane.slept`) wakes the worker before it copies them in (:meth:`ClientLane.soon`); the worker then polls
the lane a bounded time, and the ring finds it awake. After a ring that found it polling (a client sending back to
back to a lingering worker) the next call() does not look: the awake word would most likely say the same.

Early wake (schema/lane.py): a blocking wait woken with no DONE in the page, whose taken_seq says the worker is
working on our request, polls done_seq for at most ``EARLY_SPIN_NS`` (its awake word says so) before it blocks
again: the worker woke us ahead of a quick answer, so that our wake-up overlaps its work.
"""

from __future__ import annotations

import mmap
import os
import select
import stat
import struct
import time

from shmrpc.schema import lane as L
from shmrpc.schema import messages as m
from shmrpc.schema.errors import ConnectError, RequestError, Timeout, WorkerGoneError

__all__ = ["ClientLane"]

_MARGIN_NS = L.AWAKE_MARGIN_NS
_perf_counter, _monotonic_ns = time.perf_counter, time.monotonic_ns
_EARLY_S = 2e-4  # a spinning lane that waits for a long answer starts spinning this long (or 15%) before it is due
_SLEEP_MIN_S = 1e-3  # ... after a sleep, unless that sleep would be this long or less (then it spins at once)


def _early_s(last_s: float) -> float:
    """How long before a long answer is due (``last_s`` after its ring, as the last one) a spinning lane spins."""
    return max(_EARLY_S, 0.15 * last_s)
_DONE_NBYTES = m.DONE_STRUCT.size
_CALL_LEN, _CALL_FRAME, _LEN_PACK_INTO = L.CALL_LEN, L.CALL_FRAME, L.LEN.pack_into
# the DONE's length and its frame in one read: the length at DONE_LEN, the frame at DONE_FRAME
_LEN_DONE_UNPACK_FROM = struct.Struct(
    L.LEN.format + f"{L.DONE_FRAME - L.DONE_LEN - L.LEN.size}x" + m.DONE_STRUCT.format.lstrip("<")).unpack_from
_EARLY_SPIN_NS = L.EARLY_SPIN_NS
_EARLY_SPIN_S = L.EARLY_SPIN_NS / 1e9



class ClientLane:
    """The page and the two eventfds the WELCOME handed over, checked before they are used."""

    def __init__(self, page_fd: int, doorbell_fd: int, own_fd: int, worker_uid: int, spin_s: float) -> None:
        self.doorbell_fd, self.fd, self.spin_s = doorbell_fd, own_fd, spin_s
        self.seq = 0
        self.busy = 0  # the request_id in the lane, 0 when none
        # a thread waits for that request's answer, or is about to (set under the client's in-flight lock: see
        # Inflight.ring_lane); only that thread reads it, and no other ring collects it meanwhile
        self.waiting = False
        self._rung = 0.0  # time.perf_counter() of the last ring
        self._follow = False  # the last ring found the worker polling: its wait polls too (a blocking lane)
        # the last ring wrote the worker's doorbell (it did not say it polled the lane): call() rings early only then
        self.slept = True
        self._last_s = 0.0  # ring to answer of the last request
        try:
            st = os.fstat(page_fd)
            if st.st_uid != worker_uid or stat.S_IMODE(st.st_mode) != 0o600 or st.st_size != L.LANE_NBYTES:
                raise ConnectError(f"the lane page is owned by uid {st.st_uid} with mode "
                                   f"{stat.S_IMODE(st.st_mode):04o} and {st.st_size} bytes, not by the worker's uid "
                                   f"{worker_uid}, 0600 and {L.LANE_NBYTES}: refusing it")
            self._map = mmap.mmap(page_fd, L.LANE_NBYTES)
        finally:
            os.close(page_fd)
        self.page = memoryview(self._map)
        self._call_seq, self._done_seq = L.seq_word(self._map, L.CALL_SEQ), L.seq_word(self._map, L.DONE_SEQ)
        self._awake, self._worker_awake = L.seq_word(self._map, L.CLIENT_AWAKE), L.seq_word(self._map, L.WORKER_AWAKE)
        self._taken, self._soon = L.seq_word(self._map, L.TAKEN_SEQ), L.seq_word(self._map, L.CALL_SOON)
        self._spin_ns = int(spin_s * 1e9)
        self._said_ns = 0  # the latest time our awake word said we poll until: no sleep past it unread
        # edge-triggered: every DONE the worker signals is one event, so a wake-up needs no read of the eventfd;
        # an event left by an answer found by spinning wakes the next wait once, for nothing
        self._poll = select.epoll()
        self._poll.register(own_fd, select.EPOLLIN | select.EPOLLET)

    def soon(self) -> None:
        """Tell the worker the next request comes soon (the early ring: before ``call()`` copies its inputs in), so
        that its wake-up overlaps the copies; nothing while it says it polls the lane."""
        if _monotonic_ns() >= self._worker_awake.value - _MARGIN_NS:
            self._soon.value = self.seq + 1
            # NOTE: order is important here: call_soon before the doorbell, which the worker follows by reading it
            os.eventfd_write(self.doorbell_fd, 1)

    def ring(self, frame: bytes, request_id: int, sleeper: bool = False) -> None:
        """Publish a CALL frame in the page and wake the worker unless it says it polls the lane. ``sleeper``: the
        answer is awaited by an event loop, which never polls the page: the awake word says so, and the worker writes
        our eventfd when it answers (and when it wakes us early)."""
        self.seq = seq = self.seq + 1
        spin_ns = 0 if sleeper else self._spin_ns
        if spin_ns and self._last_s > self.spin_s:
            spin_ns = self._spins_from_ring_ns()
        if sleeper:
            self._awake.value = 0
            self._follow = False
        elif spin_ns:  # the wait spins from now: no eventfd needed
            self._awake.value = said = _monotonic_ns() + spin_ns
            self._said_ns = said
            self._follow = False
        elif self._last_s <= _EARLY_SPIN_S and (now := _monotonic_ns()) < self._worker_awake.value - _MARGIN_NS:
            # the worker polls the lane (it lingers) and the last answer came quickly: the wait polls for this one
            # too, a bounded time, so neither side's wake-up is on its way (and the DONE needs no eventfd)
            self._awake.value = said = now + _EARLY_SPIN_NS
            if said > self._said_ns:
                self._said_ns = said
            self._follow = True
        else:
            self._awake.value = 0
            self._follow = False
        # (L.post, written out: one call less per request)
        page, n = self._map, len(frame)
        page[_CALL_FRAME:_CALL_FRAME + n] = frame
        _LEN_PACK_INTO(page, _CALL_LEN, n)
        # NOTE: order is important here: the seq word last, it publishes the frame.
        self._call_seq.value = seq
        self.busy = request_id
        self._rung = _perf_counter()
        # NOTE: order is important here: the clock and the worker's awake word are read after call_seq is stored
        self.slept = _monotonic_ns() >= self._worker_awake.value - _MARGIN_NS
        if self.slept:
            os.eventfd_write(self.doorbell_fd, 1)

    def _spins_from_ring_ns(self) -> int:
        """How long :meth:`wait` will spin from the ring on (ns; 0: it sleeps first). The last answer within the spin
        budget: the budget. A longer one: the budget and the early margin (``max(_EARLY_S, 15%)``), when the sleep
        before the spin would be 1 ms or less, which :meth:`wait` skips (the spin then starts at once)."""
        last = self._last_s
        if last <= self.spin_s:
            return self._spin_ns
        early = _early_s(last)
        return int((self.spin_s + early) * 1e9) if last - early <= _SLEEP_MIN_S else 0

    def answer(self) -> tuple[int, int, int, int] | None:
        """The DONE of the request in the lane once the worker wrote it, as (region, slot, request_id, status); else
        None.

        Raises:
            RequestError: the page holds no DONE for that request (the page is shared: never trust it).
        """
        if self._done_seq.value != self.seq:
            return None
        # read straight from the page, once: the worker writes done_frame only before done_seq
        n, kind, region, slot, rid, status = _LEN_DONE_UNPACK_FROM(self._map, L.DONE_LEN)
        busy, self.busy = self.busy, 0
        if n != _DONE_NBYTES or kind != m.DONE:
            raise RequestError("the lane's answer is not a DONE frame", field="lane")
        if rid != busy:
            raise RequestError(f"the lane's answer is for request {rid}, not {busy}", field="lane")
        return region, slot, rid, status

    def poll_until(self, end: float) -> bool:
        """Read done_seq until it says the request in the lane was answered, or until ``end`` (``perf_counter``);
        returns whether it was answered. No system call: a busy core while it polls."""
        seq = self.seq
        while self._done_seq.value != seq and _perf_counter() < end:
            pass
        return self._done_seq.value == seq

    def wait(self, deadline: float | None, pidfd: int | None, name: str) -> tuple[int, int, int, int]:
        """Spin up to ``spin_s``, then block until the DONE of the request in the lane; returns it as :meth:`answer`
        does. The caller holds the lane's wait (:attr:`waiting`) and lets it go when this returns or raises.

        Raises:
            Timeout: ``deadline`` (time.monotonic) passed first.
            WorkerGoneError: the worker process exited.
            RequestError: the page's answer is not the DONE of the request in the lane.
        """
        # no local of the seq word: a traceback through this frame would keep the page mapped after close()
        seq = self.seq
        if pidfd is not None and not hasattr(self, "_pidfd"):
            self._pidfd = pidfd
            self._poll.register(pidfd, select.EPOLLIN)
        if self.spin_s:
            spin_s, last = self.spin_s, self._last_s
            if last > spin_s:  # the last answer came after the spin budget: sleep through most of this one's wait
                early = _early_s(last)
                sleep_s = self._rung + last - early - _perf_counter()
                if deadline is not None:
                    sleep_s = min(sleep_s, deadline - time.monotonic())
                if sleep_s > _SLEEP_MIN_S and self._done_seq.value != seq:
                    for fd, _ in self._poll.poll(self._cap(sleep_s)):  # an answer sooner wakes it (our eventfd)
                        if fd == pidfd:
                            raise WorkerGoneError(f"worker {name!r} exited")
                spin_s += early
            self.poll_until(_perf_counter() + spin_s)
        elif self._follow:  # the ring found the worker polling: poll for the DONE as long as our awake word said
            self.poll_until(self._rung + _EARLY_SPIN_S)
        early = True
        while True:
            got = self.answer()
            if got is not None:
                self._last_s = _perf_counter() - self._rung
                return got
            if early and self._taken.value == seq:  # woken ahead of a quick answer: poll for it a bounded time
                early = False
                self._awake.value = said = _monotonic_ns() + _EARLY_SPIN_NS
                if said > self._said_ns:
                    self._said_ns = said
                self.poll_until(_perf_counter() + _EARLY_SPIN_S)
                continue
            wait_s = -1.0 if deadline is None else max(0.0, deadline - time.monotonic() + 1e-3)
            events = self._poll.poll(self._cap(wait_s))
            for fd, _ in events:
                if fd == pidfd:
                    raise WorkerGoneError(f"worker {name!r} exited")
            if not events and deadline is not None and time.monotonic() >= deadline:
                raise Timeout(f"no answer from worker {name!r} in time")

    def _cap(self, wait_s: float) -> float:
        """``wait_s`` (-1: none), cut to end just after the time our awake word said; once past it, 0: the caller
        reads done_seq once more, after that time, before it may sleep longer (the promise is then kept)."""
        if not self._said_ns:
            return wait_s
        left_s = (self._said_ns - time.monotonic_ns()) / 1e9
        if left_s <= 0:
            self._said_ns = 0
            return 0.0
        left_s += 1e-4
        return left_s if wait_s < 0 else min(wait_s, left_s)

    def close(self) -> None:
        del self._call_seq, self._done_seq, self._awake, self._worker_awake, self._taken, self._soon  # they export the mapping's buffer
        self.page.release()
        try:
            self._map.close()
        except BufferError:  # a seq word still referenced (a traceback's frame): unmapped when it goes
            pass
        self._poll.close()
        for fd in (self.doorbell_fd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.doorbell_fd = self.fd = -1
