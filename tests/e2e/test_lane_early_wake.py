"""The lanes' early wake and early ring (schema/lane.py). Early wake: a worker whose last answer in a lane was quick
wakes a blocking client when it takes the next request, before running it; the client, woken with taken_seq at its
request and no DONE, polls for a bounded time, then blocks again. Early ring: a client about to copy a call()'s
inputs in wakes the worker first, which then polls the lanes a bounded time, once per request. Each side on its own,
then against a real worker process."""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest
from support.eventfd import writes as _writes

from shmrpc.client import Client, _lane
from shmrpc.client._lane import ClientLane
from shmrpc.schema import lane as L
from shmrpc.schema import messages as m
from shmrpc.server._lanes import Lane, Lanes

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _ring(lane: Lane, seq: int) -> None:
    """What a client's ring puts in the page (no doorbell: the test scans by hand)."""
    L.post(lane.page, L.seq_word(lane._map, L.CALL_SEQ), L.CALL_SEQ, seq, b"c" * 16)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


@pytest.fixture
def lanes() -> Iterator[Lanes]:
    ls = Lanes()
    try:
        yield ls
    finally:
        ls.close()


def test_a_lane_answered_quickly_has_its_client_woken_when_the_next_request_is_taken(lanes: Lanes) -> None:
    lane = lanes.open(b"client-1")
    taken = L.seq_word(lane._map, L.TAKEN_SEQ)
    client_awake = L.seq_word(lane._map, L.CLIENT_AWAKE)
    try:
        _ring(lane, 1)
        assert [seq for _, seq, _ in lanes.scan()] == [1]
        assert _writes(lane.client_fd) == 0 and taken.value == 0  # no answer yet to tell how long one takes
        lane.took_ns += 1_000_000_000  # answered at once, however loaded this machine is
        lanes.answer(lane, m.pack_done(0, 0, 1, 0), 1)
        assert _writes(lane.client_fd) == 1  # the answer's own wake-up
        _ring(lane, 2)
        assert [seq for _, seq, _ in lanes.scan()] == [2]
        # the last answer came within EARLY_WAKE_NS of its take: taken_seq and a wake-up, before any answer
        assert taken.value == 2 and _writes(lane.client_fd) == 1
        lane.took_ns -= 2 * L.EARLY_WAKE_NS  # this request takes long
        lanes.answer(lane, m.pack_done(0, 0, 2, 0), 2)
        assert _writes(lane.client_fd) == 1
        _ring(lane, 3)
        lanes.scan()
        assert taken.value == 2 and _writes(lane.client_fd) == 0  # after a slow answer: no early wake
        lanes.answer(lane, m.pack_done(0, 0, 3, 0), 3)
        _writes(lane.client_fd)
        client_awake.value = time.monotonic_ns() + 10_000_000_000  # a client that polls needs neither
        _ring(lane, 4)
        lanes.scan()
        assert taken.value == 2 and _writes(lane.client_fd) == 0
    finally:
        del taken, client_awake
        lanes.drop(b"client-1")


class _FakeWorker:
    """The worker's half of a page a ClientLane maps: what a worker writes, by hand."""

    def __init__(self) -> None:
        self.page_fd = os.memfd_create("test-lane", os.MFD_CLOEXEC)
        os.fchmod(self.page_fd, 0o600)
        os.ftruncate(self.page_fd, L.LANE_NBYTES)
        import mmap
        self.map = mmap.mmap(self.page_fd, L.LANE_NBYTES)
        self.doorbell, self.own = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)

    def client(self) -> ClientLane:
        return ClientLane(os.dup(self.page_fd), os.dup(self.doorbell), os.dup(self.own), os.geteuid(), 0.0)

    def take(self, seq: int) -> None:
        L.seq_word(self.map, L.TAKEN_SEQ).value = seq
        os.eventfd_write(self.own, 1)

    def answer(self, seq: int, rid: int) -> None:
        L.post(memoryview(self.map), L.seq_word(self.map, L.DONE_SEQ), L.DONE_SEQ, seq, m.pack_done(0, 0, rid, 0))
        if time.monotonic_ns() >= L.seq_word(self.map, L.CLIENT_AWAKE).value - L.AWAKE_MARGIN_NS:
            os.eventfd_write(self.own, 1)

    def close(self) -> None:
        self.map.close()
        for fd in (self.page_fd, self.doorbell, self.own):
            os.close(fd)


@pytest.mark.parametrize("took", [True, False])
def test_a_blocking_wait_polls_a_bounded_time_only_when_its_request_was_taken(took: bool) -> None:
    # woken with no DONE: with taken_seq at its request it says it polls and polls at most EARLY_SPIN_NS, without it
    # it blocks at once; either way an answer 50 ms later (the worker wakes it: the time said has passed) is got,
    # and the wait's CPU stays far under the 50 ms it waited
    w = _FakeWorker()
    lane = w.client()
    try:
        lane.ring(b"c" * 16, 7)
        if took:
            w.take(1)
        else:
            os.eventfd_write(w.own, 1)  # a wake-up left by an earlier answer
        t = threading.Timer(0.05, w.answer, (1, 7))
        t.start()
        t0, c0 = time.monotonic(), _cpu_s()
        assert lane.wait(t0 + 10, None, "w") == (0, 0, 7, 0)
        wall, cpu = time.monotonic() - t0, _cpu_s() - c0
        t.join()
        said = L.seq_word(w.map, L.CLIENT_AWAKE).value
        assert wall >= 0.045 and cpu < 0.02, (wall, cpu)
        if took:
            assert 0 < said <= t0 * 1e9 + 0.02e9  # it said until when it polled: soon after its wake-up
        else:
            assert said == 0
    finally:
        lane.close()
        w.close()


@pytest.mark.parametrize("case", ["polls", "slow", "asleep"])
def test_a_blocking_ring_that_finds_the_worker_polling_polls_for_its_answer(case: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the follow (schema/lane.py): a blocking lane whose ring finds the worker polling, its last answer quick, says
    # it polls and polls for the DONE, which then needs no eventfd write and no wake-up; after a slow answer, or with
    # the worker asleep, the wait blocks as before. The answer comes 20 ms after the ring: the test polls up to 5 s
    # (EARLY_SPIN_NS stretched) so that a loaded machine cannot make it late
    monkeypatch.setattr(_lane, "_EARLY_SPIN_NS", 5_000_000_000)
    monkeypatch.setattr(_lane, "_EARLY_SPIN_S", 5.0)
    w = _FakeWorker()
    lane = w.client()
    real, polls = lane._poll, []

    class Counting:
        def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
            polls.append(timeout)
            return real.poll(timeout)

    try:
        if case != "asleep":
            L.seq_word(w.map, L.WORKER_AWAKE).value = time.monotonic_ns() + 10_000_000_000
        if case == "slow":
            lane._last_s = 10.0  # the last answer came 10 s after its ring (longer than the stretched poll)
        t0 = time.monotonic_ns()
        lane.ring(b"c" * 16, 7)
        said, rang = L.seq_word(w.map, L.CLIENT_AWAKE).value, _writes(w.doorbell)
        lane._poll = Counting()  # type: ignore[assignment]
        t = threading.Timer(0.02, w.answer, (1, 7))
        t.start()
        assert lane.wait(time.monotonic() + 10, None, "w") == (0, 0, 7, 0)
        t.join()
        if case == "polls":
            assert rang == 0 and t0 + 4_000_000_000 < said and polls == []
            assert _writes(w.own) == 0  # the answer skipped the write: the client said it polls
        else:
            assert said == 0 and polls and rang == (1 if case == "asleep" else 0)
    finally:
        lane._poll = real
        lane.close()
        w.close()


def test_a_client_woken_early_takes_an_answer_that_skipped_its_wake_up() -> None:
    # a worker process that keeps the awake rule (schema/lane.py) and nothing more: it answers once the woken client
    # says it polls, and writes the eventfd only when the time said is within AWAKE_MARGIN_NS. A client that said it
    # polls and did not would lose the answers that skipped the write (Timeout). (How many skip depends on how soon
    # this process runs after the client's word: on an idle machine most, on a loaded one maybe none.)
    import multiprocessing

    w = _FakeWorker()
    lane = w.client()
    ctx = multiprocessing.get_context("fork")
    skipped = ctx.Value("i", 0)

    def worker(n: int) -> None:
        for seq in range(1, n + 1):
            deadline = time.monotonic() + 5
            while L.seq_word(w.map, L.CALL_SEQ).value != seq and time.monotonic() < deadline:
                pass
            w.take(seq)
            while L.seq_word(w.map, L.CLIENT_AWAKE).value == 0 and time.monotonic() < deadline:
                pass  # until the woken client says it polls
            if time.monotonic_ns() < L.seq_word(w.map, L.CLIENT_AWAKE).value - L.AWAKE_MARGIN_NS:
                skipped.value += 1
            w.answer(seq, 100 + seq)

    n = 20
    try:
        p = ctx.Process(target=worker, args=(n,))
        p.start()
        for seq in range(1, n + 1):
            lane.ring(b"c" * 16, 100 + seq)
            assert lane.wait(time.monotonic() + 10, None, "w") == (0, 0, 100 + seq, 0)
        p.join(10)
        assert p.exitcode == 0
        print(f"{skipped.value} of {n} answers skipped the eventfd write")
    finally:
        lane.close()
        w.close()


def test_a_blocking_lane_client_is_woken_early_by_a_real_worker_and_only_for_quick_requests(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    # a worker that never lingers: its client never polls from its ring (the follow), so it is woken for each answer
    worker = spawn_worker("--lane-linger-us", "0")
    rng = np.random.default_rng(5)
    with Client(worker.name, lane="block", timeout_s=10) as c, c.loan(16 << 20) as req:
        lane = c._t.lane
        assert lane is not None
        taken = L.seq_word(lane._map, L.TAKEN_SEQ)
        try:
            x, y = req.array("x", (16,), np.float32), req.array("y", (16,), np.float32)
            early = 0
            for _ in range(300):
                a, b = rng.standard_normal(16, dtype=np.float32), rng.standard_normal(16, dtype=np.float32)
                x[...], y[...] = a, b
                np.testing.assert_array_equal(req.send("vector_add")["out"], a + b)
                early += taken.value == lane.seq
            # the worker answers a 64 B add well within EARLY_WAKE_NS, so it takes the next request early (a loaded
            # machine may make one slow now and then: the one after it is taken without an early wake)
            assert early >= 100, early
        finally:
            del taken
    with Client(worker.name, lane="block", timeout_s=10) as c, c.loan(16 << 20) as req:
        lane = c._t.lane
        assert lane is not None
        taken = L.seq_word(lane._map, L.TAKEN_SEQ)
        try:
            x, y = req.array("x", (1 << 20,), np.float32), req.array("y", (1 << 20,), np.float32)
            x[...], y[...] = 1.0, 2.0
            for _ in range(3):  # 4 MiB adds: each takes far more than EARLY_WAKE_NS
                np.testing.assert_array_equal(req.send("vector_add")["out"], 3.0)
                x[...] = 1.0
            assert taken.value == 0  # never taken early: every answer in this lane was slow
        finally:
            del taken


def test_a_lane_that_announces_its_next_request_has_the_worker_poll_for_it_once_per_request(lanes: Lanes) -> None:
    lane = lanes.open(b"client-1")
    soon = L.seq_word(lane._map, L.CALL_SOON)
    try:
        soon.value = 1  # the next call_seq: a request comes soon
        t0 = time.monotonic_ns()
        assert lanes.scan() == []
        until = lanes.soon_until_ns
        assert t0 + L.SOON_NS <= until <= time.monotonic_ns() + L.SOON_NS  # the loop reads the lanes until then
        assert L.seq_word(lane._map, L.WORKER_AWAKE).value == 0 and lanes.awake_until_ns == 0  # and promises nothing
        lanes.soon_until_ns = 0
        assert lanes.scan() == [] and lanes.soon_until_ns == 0  # once per request
        _ring(lane, 1)
        assert [seq for _, seq, _ in lanes.scan()] == [1] and lanes.soon_until_ns == 0  # 1 is no longer the next
        soon.value = 7  # not the next call_seq: nothing
        assert lanes.scan() == [] and lanes.soon_until_ns == 0
        soon.value = 2
        assert lanes.scan() == [] and lanes.soon_until_ns > until
    finally:
        del soon
        lanes.drop(b"client-1")


def test_a_client_rings_early_unless_the_worker_says_it_polls() -> None:
    w = _FakeWorker()
    lane = w.client()
    try:
        lane.ring(b"c" * 16, 5)
        _writes(w.doorbell)
        lane.soon()
        assert L.seq_word(w.map, L.CALL_SOON).value == 2 and _writes(w.doorbell) == 1
        L.seq_word(w.map, L.WORKER_AWAKE).value = time.monotonic_ns() + 10_000_000_000  # a spinning worker
        L.seq_word(w.map, L.CALL_SOON).value = 0
        lane.soon()
        assert L.seq_word(w.map, L.CALL_SOON).value == 0 and _writes(w.doorbell) == 0
    finally:
        lane.close()
        w.close()


def test_call_through_a_blocking_lane_rings_a_real_worker_early_and_an_idle_announcement_is_harmless(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    # the worker's side is the unit test above; here: call() announces every request it rings through an idle lane
    # (to a worker that does not linger: one that does says it polls, and is not announced to: test_lane_linger.py),
    # the answers are right, and announcements never followed by a request leave the worker serving
    worker = spawn_worker("--lane-linger-us", "0")
    rng = np.random.default_rng(6)
    with Client(worker.name, lane="block", timeout_s=10) as c:
        lane = c._t.lane
        assert lane is not None
        soon = L.seq_word(lane._map, L.CALL_SOON)
        try:
            announced = 0
            for _ in range(300):
                a, b = rng.standard_normal(16, dtype=np.float32), rng.standard_normal(16, dtype=np.float32)
                np.testing.assert_array_equal(c.call("vector_add", x=a, y=b)["out"], a + b)
                announced += soon.value == lane.seq
            assert announced == 300
            with c.loan(4096) as req:  # a loan's send does not announce (its few µs before the ring gain nothing)
                req.array("x", (4,), np.float32)[...] = 1
                req.array("y", (4,), np.float32)[...] = 1
                np.testing.assert_array_equal(req.send("vector_add")["out"], 2.0)
                assert soon.value == lane.seq - 1
            for _ in range(50):  # announced, never rung
                soon.value = lane.seq + 1
                os.eventfd_write(lane.doorbell_fd, 1)
                time.sleep(2 * L.SOON_NS / 1e9)
            a = np.ones(4, np.float32)
            t0 = time.monotonic()
            np.testing.assert_array_equal(c.call("vector_add", x=a, y=a)["out"], 2.0)
            assert time.monotonic() - t0 < 2.0
        finally:
            del soon
