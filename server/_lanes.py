"""The worker's side of the lanes (:mod:`shmrpc.schema.lane`): pages, eventfds, the scan and the answer.

One eventfd (the doorbell) is shared by every lane and polled by the loop with the
ZeroMQ socket, so the loop waits on all lanes at once. When it fires, or while the
loop spins, :meth:`Lanes.scan` reads each lane's call_seq; a changed one yields a
private copy of the CALL frame, which the loop handles exactly like a CALL from
ZeroMQ. The DONE of such a request goes back into the lane (:meth:`Lanes.answer`).

Early wake (schema/lane.py): a lane whose last request was answered within ``EARLY_WAKE_NS`` of its take has
its client woken by the scan that takes the next one, before the request runs: the client's wake-up then
overlaps the request's work. ``taken_seq`` tells the client the answer is near (it polls a bounded time).

Early ring (schema/lane.py): a lane whose ``call_soon`` is its next call_seq, with no new request yet, makes the
scan set :attr:`Lanes.soon_until_ns`: the loop then reads the lanes until a request is there or that time has
passed, once per call_seq of that lane.

Linger (schema/lane.py): a lane whose client came back soon after its last answer (:class:`Linger`, asked by the scan
that takes its request) has the answer to that request followed by ``Linger.until_ns``: the loop reads for requests
until then before it sleeps.

Awake words (schema/lane.py): an answer skips the client's eventfd while the client says it
polls; a worker that spins (``--spin-us``) or lingers writes, with each answer, until when it will poll
that lane, and :attr:`Lanes.awake_until_ns` keeps the latest such time: the loop's poll
(``_poll.LoopPoll``) never sleeps past it without reading every lane again after it.
"""

from __future__ import annotations

import mmap
import os
import time
from typing import Any

from shmrpc.schema import lane as L

_monotonic_ns = time.monotonic_ns
_MARGIN_NS, _EARLY_WAKE_NS, _SOON_NS = L.AWAKE_MARGIN_NS, L.EARLY_WAKE_NS, L.SOON_NS
_DONE_LEN, _DONE_FRAME, _LEN_PACK_INTO = L.DONE_LEN, L.DONE_FRAME, L.LEN.pack_into

__all__ = ["Lane", "Lanes", "Linger"]


def _wake(lane: Lane, now: int) -> None:
    """Write the client's eventfd, unless its awake word says it polls the page past ``now`` (CLOCK_MONOTONIC ns)."""
    if now >= lane._client_awake.value - _MARGIN_NS:
        _write(lane)


def _write(lane: Lane) -> None:
    """Write the client's eventfd."""
    try:
        os.eventfd_write(lane.client_fd, 1)
    except OSError:  # the counter is full (a client that never reads it): it is awake anyway
        pass


def linger_ns(linger_us: int) -> int:
    """The worker's linger in ns for ``--lane-linger-us``: none where this process may use one CPU only (its
    affinity: ``--cpus``, ``taskset``, a cpuset; not the host's count), where the client it waits for could not run
    meanwhile."""
    return linger_us * 1000 if len(os.sched_getaffinity(0)) > 1 else 0


class Linger:
    """The worker's linger (schema/lane.py): whether a lane's client came back soon after its last answer, and the
    latest time an answer said the loop reads the lanes until (``until_ns``, CLOCK_MONOTONIC ns; 0: none pending).

    A lane's state is five attributes of its :class:`Lane`: ``answered_ns`` (its last answer), ``back`` (its client
    came back soon: linger after this request), ``lingered`` (the loop lingered after its last answer), ``vain`` (how
    many lingers in a row its next request came after) and ``skip`` (requests left that get no chance to linger after
    them, after lingers in vain).
    """

    VAIN_MAX = 6  # after n lingers in vain in a row, the next 2**n - 1 requests get no chance (at most 63)

    __slots__ = ("ns", "until_ns")

    def __init__(self, ns: int) -> None:
        self.ns = ns  # the linger time (--lane-linger-us); 0: never
        self.until_ns = 0

    def took(self, c: Any, now: int) -> None:
        """``c``'s request is taken at ``now``: was it soon after its last answer? Within the linger time if the loop
        lingered after that answer (then it read for requests when this one came); within twice that if it slept
        (the take counts its own wake-up). A linger in vain (the request came after it) gives the next requests no
        chance, one after the first in a row, 3 after the second, up to 63: a client whose requests come a little
        later than the linger costs a linger in vain now and then, a client held up once loses one request's."""
        gap = now - c.answered_ns
        if c.lingered:
            c.back = back = gap <= self.ns
            if back:
                c.vain = 0
            else:
                c.vain = n = min(c.vain + 1, self.VAIN_MAX)
                c.skip = (1 << n) - 1
        elif c.skip:
            c.skip -= 1
            c.back = False
        else:
            c.back = gap <= 2 * self.ns

    def answered(self, c: Any, now: int) -> bool:
        """``c``'s request was answered at ``now``; True when the loop lingers after it (``until_ns`` then covers
        it)."""
        c.answered_ns = now
        c.lingered = lingers = c.back and self.ns > 0
        if lingers and now + self.ns > self.until_ns:
            # NOTE: the loop reads this before it sleeps: whatever it does next, it reads for requests until then
            self.until_ns = now + self.ns
        return lingers


class Lane:
    """One client's lane: its page (our own mapping) and its eventfd."""

    def __init__(self, identity: bytes, doorbell_fd: int) -> None:
        self.identity = identity
        self._memfd = os.memfd_create("shmrpc-lane", os.MFD_CLOEXEC)
        try:
            os.fchmod(self._memfd, 0o600)
            os.ftruncate(self._memfd, L.LANE_NBYTES)
            self._map = mmap.mmap(self._memfd, L.LANE_NBYTES)
            self.page = memoryview(self._map)
            self._call_seq, self._done_seq = L.seq_word(self._map, L.CALL_SEQ), L.seq_word(self._map, L.DONE_SEQ)
            self._client_awake, self._awake = L.seq_word(self._map, L.CLIENT_AWAKE), L.seq_word(self._map, L.WORKER_AWAKE)
            self._taken, self._soon = L.seq_word(self._map, L.TAKEN_SEQ), L.seq_word(self._map, L.CALL_SOON)
            self.client_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except BaseException:
            os.close(self._memfd)
            raise
        self._doorbell_fd = doorbell_fd
        self.seen = 0  # the last call_seq taken
        self.took_ns = 0  # CLOCK_MONOTONIC ns of its take
        # the linger's state of this lane (Linger): its last answer, came back soon, lingered after it, in vain, skip
        self.answered_ns, self.back, self.lingered, self.vain, self.skip = 0, False, False, 0, 0
        self.quick = False  # the last request was answered within EARLY_WAKE_NS of its take: wake the client early
        self.soon_for = -1  # the last call_seq after which an early ring was honoured (once per call_seq)

    def fds(self) -> list[int]:
        """The fds handed to the client with the WELCOME: page, doorbell, the client's eventfd (ours stay open)."""
        return [self._memfd, self._doorbell_fd, self.client_fd]

    def handed_over(self) -> None:
        """The client has its copies: close the page's fd (the mapping stays)."""
        if self._memfd >= 0:
            os.close(self._memfd)
            self._memfd = -1

    def close(self) -> None:
        self.handed_over()
        del self._call_seq, self._done_seq, self._client_awake, self._awake, self._taken, self._soon  # they export the mapping's buffer
        self.page.release()
        try:
            self._map.close()
        except BufferError:  # a seq word still referenced (a traceback's frame): unmapped when it goes
            pass
        if self.client_fd >= 0:
            os.close(self.client_fd)
            self.client_fd = -1


class Lanes:
    """Every lane of the worker, by session token, and the doorbell they share."""

    def __init__(self, spin_ns: int = 0, linger: Linger | None = None) -> None:
        self.doorbell_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self.by_identity: dict[bytes, Lane] = {}
        self._all: tuple[Lane, ...] = ()  # by_identity's lanes, for the scans
        self.spin_ns = spin_ns  # the loop spins this long after a turn (--spin-us): answers say so; 0: they do not
        self.linger = Linger(0) if linger is None else linger  # the worker's: its loop reads until_ns
        self.awake_until_ns = 0  # the latest time an answer said this worker polls until (0: none pending)
        self.soon_until_ns = 0  # an early ring was taken: the loop reads the lanes until a request or then (0: none)

    def answer(self, lane: Lane, done_frame: bytes, seq: int) -> None:
        """Write the DONE of ``lane``'s request rung with ``seq`` into its page, then wake the client unless it says
        it polls; a spinning worker (``spin_ns``), or one that lingers after this lane's answer (:class:`Linger`), also
        says until when it polls the lane, and keeps :attr:`awake_until_ns`."""
        now = _monotonic_ns()
        hold_ns = self.spin_ns
        linger = self.linger
        if linger.answered(lane, now) and linger.ns > hold_ns:
            hold_ns = linger.ns
        if hold_ns:
            # NOTE: order is important here: the awake word before the DONE, so that a client that sees the DONE sees
            # it too and rings again without the doorbell (the loop polls from here on: it blocks nowhere before)
            lane._awake.value = until = now + hold_ns
            if until > self.awake_until_ns:
                self.awake_until_ns = until
        # (L.post, written out: one call less per answer)
        page, n = lane._map, len(done_frame)
        page[_DONE_FRAME:_DONE_FRAME + n] = done_frame
        _LEN_PACK_INTO(page, _DONE_LEN, n)
        # NOTE: order is important here: the seq word last, it publishes the frame.
        lane._done_seq.value = seq
        # NOTE: order is important here: the clock and the client's awake word are read after done_seq is stored
        now = _monotonic_ns()
        if now >= lane._client_awake.value - _MARGIN_NS:  # (as _wake tests)
            _write(lane)
        lane.quick = now - lane.took_ns <= _EARLY_WAKE_NS

    @staticmethod
    def pulse(lane: Lane) -> None:
        """Wake the client of ``lane`` ahead of its answer (no DONE in the page yet: it waits again), unless it says
        it polls."""
        _wake(lane, _monotonic_ns())

    def open(self, identity: bytes) -> Lane:
        lane = self.by_identity[identity] = Lane(identity, self.doorbell_fd)
        self._all = tuple(self.by_identity.values())
        return lane

    def drop(self, identity: bytes) -> None:
        lane = self.by_identity.pop(identity, None)
        if lane is not None:
            self._all = tuple(self.by_identity.values())
            lane.close()

    def ready(self) -> bool:
        """Whether a lane's call_seq changed since its last take: a request to scan for, found without a system
        call (the spinning loop reads this between its polls; the doorbell eventfd is cleared by the next poll
        that sees it, and every request posted after a scan rings it again, so none is missed)."""
        for lane in self._all:
            if lane._call_seq.value != lane.seen:
                return True
        return False

    def clear_doorbell(self) -> None:
        try:
            os.eventfd_read(self.doorbell_fd)
        except BlockingIOError:
            pass

    def scan(self) -> list[tuple[Lane, int, bytes]]:
        """Each lane with a new request: the lane, its call_seq and a private copy of its CALL frame (a frame too
        long is dropped: never read, never answered). A lane whose last answer was quick says it took the request
        (``taken_seq``) and wakes its client now, unless the client polls (the early wake, schema/lane.py); whether
        its client came back soon after its last answer is noted for the linger (:meth:`Linger.took`)."""
        got = []
        linger = self.linger if self.linger.ns else None
        for lane in self._all:
            seq = lane._call_seq.value
            if seq == lane.seen:
                if lane._soon.value == seq + 1 and lane.soon_for != seq:  # an early ring: the request comes soon
                    lane.soon_for = seq
                    self.soon_until_ns = _monotonic_ns() + _SOON_NS
            else:
                frame = L.read_frame(lane._map, L.CALL_SEQ)
                # a call_seq changed meanwhile: the client is ringing again right now, and this lane is read again
                # (its eventfd write, or the spinning loop's next ready(), since seen is left as it was)
                if lane._call_seq.value == seq:
                    lane.seen = seq
                    if frame is not None:
                        lane.took_ns = now = _monotonic_ns()
                        if linger is not None:
                            linger.took(lane, now)
                        if lane.quick and now >= lane._client_awake.value - _MARGIN_NS:  # (as _wake tests)
                            # NOTE: order is important here: taken_seq before the wake-up, which the client follows
                            # by reading it; a client that polls (its awake word) needs neither
                            lane._taken.value = seq
                            _write(lane)
                        got.append((lane, seq, frame))
        return got

    def close(self) -> None:
        for identity in list(self.by_identity):
            self.drop(identity)
        if self.doorbell_fd >= 0:
            os.close(self.doorbell_fd)
            self.doorbell_fd = -1

    def __len__(self) -> int:
        return len(self.by_identity)
