"""The lanes' awake words (schema/lane.py): an eventfd write skipped while the other side says it polls, and no
answer lost for it, against a real worker process (and the client's side of the promise on its own)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pytest
from support.eventfd import writes as _writes

from shmrpc.client import Client, _lane
from shmrpc.client._lane import ClientLane
from shmrpc.schema import lane as L
from shmrpc.schema import messages as m

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@pytest.mark.parametrize("gap_s", [0.0, 0.0005])
def test_a_polling_client_is_answered_without_its_eventfd_and_a_blocking_one_with_it(
        spawn_worker: Callable[..., WorkerProc], gap_s: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # the follow's window stretched from 150 µs to 50 ms (this process's clients only): on a loaded machine an answer
    # may come later than 150 µs after its ring, and the client would then block and be woken as designed
    monkeypatch.setattr(_lane, "_EARLY_SPIN_NS", 50_000_000)
    monkeypatch.setattr(_lane, "_EARLY_SPIN_S", 0.05)
    polling = spawn_worker("--spin-us", "50000")  # the worker polls the lanes 50 ms after each turn
    asleep = spawn_worker("--lane-linger-us", "0", name=polling.name + "-asleep")  # it never polls the lanes
    rng = np.random.default_rng(3)
    for w, mode, spin_us in ((polling, "spin", 50_000), (polling, "block", 0), (asleep, "block", 0)):
        with Client(w.name, lane=mode, spin_us=spin_us, timeout_s=10) as c, c.loan(4096) as req:
            lane = c._t.lane
            assert lane is not None
            x, y = req.array("x", (16,), np.float32), req.array("y", (16,), np.float32)
            req.send("vector_add")
            _writes(lane.fd)
            n, slow = 200, []
            for _ in range(n):
                a, b = rng.standard_normal(16, dtype=np.float32), rng.standard_normal(16, dtype=np.float32)
                x[...], y[...] = a, b
                time.sleep(gap_s)
                t0 = time.monotonic()
                np.testing.assert_array_equal(req.send("vector_add")["out"], a + b)
                slow.append(time.monotonic() - t0)
            got = _writes(lane.fd)
            if mode == "spin":  # it said it polls 50 ms: the worker skipped (nearly) every write
                assert got < n // 2, got
            elif w is polling:  # a blocking lane whose ring finds the worker polling polls too, after quick answers
                # (the follow, schema/lane.py): the answers skip the write, as a spinning lane's do
                assert got < n // 2, got
            else:  # it sleeps on its eventfd: every request wrote it once or twice (an early wake, then its answer
                # unless the client said it polls by then: tests/e2e/test_lane_early_wake.py)
                assert n <= got <= 2 * n, got
            assert max(slow) < 2.0  # no answer waited for a lost wake-up


def test_a_client_wait_stops_at_the_time_it_said_then_reads_once_more() -> None:
    # the client's side of the promise on its own: a wait that would sleep past the time its awake word said is
    # cut to end just after it, then it is 0 once (done_seq is read after that time), then the wait is whole
    page = os.memfd_create("test-lane", os.MFD_CLOEXEC)
    os.fchmod(page, 0o600)
    os.ftruncate(page, L.LANE_NBYTES)
    doorbell, own = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)
    lane = ClientLane(page, doorbell, own, os.geteuid(), 0.01)
    try:
        lane.ring(b"c" * 16, 1)  # the wait will spin from here: it says so for 10 ms
        said = L.seq_word(lane._map, L.CLIENT_AWAKE).value
        assert said > time.monotonic_ns() and lane._said_ns == said
        assert 0 < lane._cap(5.0) < 0.0102 and lane._cap(-1.0) < 0.0102
        time.sleep(0.011)
        assert lane._cap(5.0) == 0.0  # past it: one more read of done_seq before any sleep
        assert lane._cap(5.0) == 5.0 and lane._cap(-1.0) == -1.0
        assert _writes(doorbell) == 1  # no worker says it polls: the ring wrote the doorbell
        L.seq_word(lane._map, L.WORKER_AWAKE).value = time.monotonic_ns() + 10_000_000_000
        lane._last_s = 1.0  # an answer that took longer than the spin budget: the next wait sleeps first
        lane.ring(b"c" * 16, 2)
        assert L.seq_word(lane._map, L.CLIENT_AWAKE).value == 0  # so it says nothing
        assert _writes(doorbell) == 0  # the worker polls: no doorbell
    finally:
        lane.close()  # closes the page's mapping and both eventfds


def test_a_spinning_lane_after_an_answer_over_its_budget_says_how_long_its_wait_will_spin() -> None:
    # a wait after a last answer over the spin budget sleeps first unless that sleep would be 1 ms or less; skipping it,
    # the wait spins for the budget and the early margin from the start, and the ring says so (the worker's answer then
    # needs no eventfd write); a wait that will sleep first says nothing
    page = os.memfd_create("test-lane", os.MFD_CLOEXEC)
    os.fchmod(page, 0o600)
    os.ftruncate(page, L.LANE_NBYTES)
    doorbell, own = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)
    lane = ClientLane(page, doorbell, own, os.geteuid(), 2e-4)
    try:
        for seq, (last, spins_ns) in enumerate([(1.5e-4, 200_000), (2.5e-4, 400_000), (1.15e-3, 400_000), (1.5e-3, 0)], 1):
            lane._last_s = last
            before = time.monotonic_ns()
            lane.ring(b"c" * 16, seq)
            said = L.seq_word(lane._map, L.CLIENT_AWAKE).value
            if spins_ns:
                assert before + spins_ns <= said <= time.monotonic_ns() + spins_ns and lane._said_ns == said, (last, said)
            else:
                assert said == 0, last
    finally:
        lane.close()


@pytest.mark.parametrize("last_s", [1.5e-4, 2.5e-4, 1.15e-3])
def test_a_spinning_wait_finds_an_answer_posted_just_inside_the_time_its_ring_said_without_sleeping(
        monkeypatch: pytest.MonkeyPatch, last_s: float) -> None:
    # the promise kept by the wait itself: a worker that reads the awake word skips the eventfd write, so an answer
    # posted 10 µs before the time the ring said must be found by the spin, never by a sleep (a fake clock of 1 µs per
    # read; done_seq hides the DONE until then; the epoll fails the test if the wait blocks in it)
    clock = [1000.0]

    def fake_perf_counter() -> float:
        clock[0] += 1e-6
        return clock[0]

    monkeypatch.setattr(_lane, "_perf_counter", fake_perf_counter)
    page = os.memfd_create("test-lane", os.MFD_CLOEXEC)
    os.fchmod(page, 0o600)
    os.ftruncate(page, L.LANE_NBYTES)
    doorbell, own = os.eventfd(0, os.EFD_NONBLOCK), os.eventfd(0, os.EFD_NONBLOCK)
    lane = ClientLane(page, doorbell, own, os.geteuid(), 2e-4)
    real_poll = lane._poll
    try:
        lane._last_s = last_s
        spin_ns = lane._spins_from_ring_ns()  # what the ring says: its clock then, plus this
        mono = time.monotonic_ns()
        lane.ring(b"c" * 16, 7)
        awake = L.seq_word(lane._map, L.CLIENT_AWAKE).value
        assert mono + spin_ns <= awake <= time.monotonic_ns() + spin_ns
        # (the window from the spin the ring said, not from the clock around it: a preemption between the two
        # readings would stretch it past the spin on the test's fake clock)
        window_s = spin_ns / 1e9
        assert window_s > 1.5e-4
        done = L.seq_word(lane._map, L.DONE_SEQ)
        L.post(lane.page, done, L.DONE_SEQ, lane.seq, m.DONE_STRUCT.pack(m.DONE, 1, 2, 7, 0))
        due = lane._rung + window_s - 1e-5

        class HiddenUntilDue:
            @property
            def value(self) -> int:
                return lane.seq if clock[0] >= due else 0

        class NoSleep:
            def poll(self, timeout: float = -1) -> list[tuple[int, int]]:
                raise AssertionError(f"the wait slept (timeout {timeout}) before the time its ring said")

        lane._done_seq, lane._poll = HiddenUntilDue(), NoSleep()  # type: ignore[assignment]
        del done
        assert lane.wait(None, None, "test") == (1, 2, 7, 0)
        assert clock[0] >= due
    finally:
        lane._poll = real_poll
        lane.close()


def test_a_client_that_writes_garbage_awake_words_costs_only_itself(worker: WorkerProc) -> None:
    # the page is the client's to write: a worker_awake far in the future makes its own rings skip the doorbell of a
    # worker that does not spin (its calls then time out), and nobody else's request waits for it
    from shmrpc.client import Timeout

    with Client(worker.name, lane="block", timeout_s=10) as hostile, Client(worker.name, lane="block") as other:
        lane = hostile._t.lane
        assert lane is not None
        L.seq_word(lane._map, L.WORKER_AWAKE).value = (1 << 64) - 1
        L.seq_word(lane._map, L.CLIENT_AWAKE).value = (1 << 64) - 1
        with pytest.raises(Timeout):
            hostile.call("vector_add", x=np.ones(2), y=np.ones(2), timeout_s=0.5)
        for _ in range(50):
            t0 = time.monotonic()
            np.testing.assert_array_equal(other.call("vector_add", x=np.ones(3), y=np.ones(3))["out"], 2.0)
            assert time.monotonic() - t0 < 2.0
