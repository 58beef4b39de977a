"""The PULSE before a long launched request's DONE (server/_runs.py, PULSE_LEAD_S): over ZeroMQ a frame the client
discards, through a lane a write of the client's eventfd; the DONE after it finds the client awake. And the loop's
wait for a long launched run: polls until shortly before it is due, a spin only around then.

The worker's NumPy backend stands in for a device (kernels/_backend_numpy.py): with ``SHMRPC_NUMPY_BATCH_JOINT=1`` a
request too large for the loop thread is launched, and ``SHMRPC_NUMPY_LAUNCH_S`` says when it is done (its ``eta``),
as a device run of that length would. The client here is this process: its frames and wake-ups are stamped.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from support.procstat import cpu_s

from shmrpc.client import Client
from shmrpc.schema import messages as m
from shmrpc.server import _runs

from .conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

RUN_S = 0.1  # how long a launched request takes on the stand-in device (the loop sleeps until 15% before it: 15 ms
# is more than a timer on a loaded machine oversleeps)
N = 48 * 1024  # float32 elements per input: 576 KiB touched, over the loop thread's limit (256 KiB): launched


def _launching(seconds: float) -> dict[str, str]:
    return dict(os.environ, SHMRPC_NUMPY_BATCH_JOINT="1", SHMRPC_NUMPY_LAUNCH_S=str(seconds))


def _stamp_frames(c: Client) -> list[tuple[float, bytes]]:
    """(time, kind byte) of every frame the client routes from its socket, from now on."""
    seen: list[tuple[float, bytes]] = []
    route = c._inflight._route

    def stamped(frames: list[bytes]) -> Any:
        now = time.perf_counter()
        seen.extend((now, bytes(f[:1])) for f in frames)
        return route(frames)

    c._inflight._route = stamped  # type: ignore[method-assign]
    return seen


class _Wakes:
    """A lane's epoll object whose returns with events are stamped."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.at = inner, list[float]()

    def poll(self, *a: Any) -> Any:
        got = self.inner.poll(*a)
        if got:
            self.at.append(time.perf_counter())
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _drain(fd: int) -> int:
    """The eventfd's count, which the read resets (0: none)."""
    try:
        return os.eventfd_read(fd)
    except BlockingIOError:
        return 0


def _send_big(c: Client) -> tuple[float, float, Callable[[], None]]:
    """(sent, answered) times of one launched request, and a check of its result."""
    x, y = np.arange(N, dtype=np.float32), np.full(N, 0.5, np.float32)
    t0 = time.perf_counter()
    out = c.call("vector_add", x=x, y=y)["out"]
    t1 = time.perf_counter()
    return t0, t1, lambda: np.testing.assert_array_equal(out, x + y)


def test_a_long_launched_request_over_zeromq_is_pulsed_shortly_before_its_done(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker(env=_launching(RUN_S))
    with Client(w.name, timeout_s=30) as c:
        c.call("vector_add", x=np.ones(4, np.float32), y=np.ones(4, np.float32))  # small: on the loop thread
        assert c._inflight.pulses == 0
        frames = _stamp_frames(c)
        pulsed = 0
        for _ in range(4):
            del frames[:]
            t0, t1, check = _send_big(c)
            check()
            kinds = [k for _, k in frames]
            assert kinds.count(m.PULSE) <= 1 and kinds[-1] == m.DONE, kinds
            if m.PULSE in kinds:
                pulsed += 1
                # sent PULSE_LEAD_S before the run is due: late in the run, not at its launch
                assert frames[kinds.index(m.PULSE)][0] - t0 > RUN_S / 2, (frames[0][0] - t0, t1 - t0)
        # the loop polls 1 ms at a time until 2 ms before the run is due: a machine loaded enough to oversleep one of
        # those polls by 1.8 ms finds the run done, and sends the DONE without its pulse
        assert pulsed >= 2 and c._inflight.pulses == pulsed


def test_a_client_that_does_not_know_the_pulse_ignores_it(spawn_worker: Callable[..., WorkerProc],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # a client of the same protocol version from before the PULSE: the frame reaches its control handler, which drops
    # any frame it cannot decode (docs/protocol.md); its answers are unchanged
    monkeypatch.setattr(m, "PULSE", b"\x00")  # this process's client no longer tells the frame apart
    w = spawn_worker(env=_launching(RUN_S))
    with Client(w.name, timeout_s=30) as c:
        frames = _stamp_frames(c)
        for _ in range(4):
            _send_big(c)[2]()
        assert c._inflight.pulses == 0
        assert [k for _, k in frames].count(b"P") >= 2  # they came, and were dropped


def test_a_launched_request_shorter_than_the_pulse_minimum_gets_no_pulse(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker(env=_launching(_runs.PULSE_MIN_S / 4))
    with Client(w.name, timeout_s=30) as c:
        for _ in range(3):
            _send_big(c)[2]()
        assert c._inflight.pulses == 0


def test_a_long_launched_request_through_the_blocking_lane_wakes_its_client_before_the_done(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker(env=_launching(RUN_S))
    with Client(w.name, timeout_s=30, lane="block") as c:
        ln = c._t.lane
        assert ln is not None
        wakes = ln._poll = _Wakes(ln._poll)  # type: ignore[assignment]
        pulsed = 0
        for _ in range(4):
            del wakes.at[:]
            _drain(ln.fd)
            t0, t1, check = _send_big(c)
            check()
            assert c._inflight.pulses == 0  # nothing came over ZeroMQ
            # the writes of the client's eventfd (which it never reads: its epoll is edge-triggered): the DONE's,
            # and the pulse's before it (see the test above for a loaded machine); the first wake-up late in the run,
            # not at the launch (one wake-up may see both)
            writes = _drain(ln.fd)
            assert writes in (1, 2)
            pulsed += writes == 2
            assert wakes.at and wakes.at[0] > t0 + RUN_S / 2, ([t - t0 for t in wakes.at], t1 - t0)
        assert pulsed >= 2


def test_a_spinning_lane_client_is_answered_right_after_pulses(spawn_worker: Callable[..., WorkerProc]) -> None:
    # it sleeps through most of a long wait and spins from 15% before it is due: a pulse finds it asleep or
    # spinning, and may leave an event (its epoll is edge-triggered) that wakes its next wait once, for nothing
    w = spawn_worker(env=_launching(RUN_S))
    with Client(w.name, timeout_s=30, lane="spin") as c:
        for _ in range(3):
            _send_big(c)[2]()
        x = np.arange(16, dtype=np.float32)
        for _ in range(50):  # short requests after the long ones
            np.testing.assert_array_equal(c.call("vector_add", x=x, y=x)["out"], 2 * x)


def test_an_async_client_routes_pulses_off_its_event_loop(spawn_worker: Callable[..., WorkerProc]) -> None:
    from shmrpc.client import AsyncClient

    w = spawn_worker(env=_launching(RUN_S))
    x, y = np.arange(N, dtype=np.float32), np.full(N, 0.5, np.float32)

    async def main() -> int:
        async with await AsyncClient.connect(w.name, timeout_s=30) as c:
            for _ in range(4):
                np.testing.assert_array_equal((await c.call("vector_add", x=x, y=y))["out"], x + y)
            return int(c.client._inflight.pulses)

    assert asyncio.run(main()) >= 2  # see the ZeroMQ test above for a loaded machine


def test_the_loop_spins_only_near_when_a_long_launched_run_is_due(spawn_worker: Callable[..., WorkerProc]) -> None:
    # a run of 0.5 s: the loop wakes 75 ms before it is due (15%), polls 1 ms at a time until 2 ms before, and spins
    # from there; spinning from the wake-up would burn 75 ms of CPU per request
    run_s = 0.5
    w = spawn_worker(env=_launching(run_s))
    with Client(w.name, timeout_s=30) as c:
        _send_big(c)[2]()
        cpu0 = cpu_s(w.pid)
        for _ in range(4):
            _send_big(c)[2]()
        used = cpu_s(w.pid) - cpu0
    assert used < 4 * 0.15 * run_s / 2, used  # half of what spinning the 15% would take (0.15 s)
