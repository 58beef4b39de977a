"""One Client shared by threads, and futures that complete by themselves (real worker processes)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import pytest
from wire import slow_pipeline, wait_in_flight

from shmrpc.client import CallFuture, Client, ClientClosedError, Timeout, WorkerGoneError, _inflight
from shmrpc.schema.naming import attach_path, socket_path

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]




def test_futures_complete_without_result_being_asked(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=20) as c:
        futs = [c.submit("vector_add", x=np.full(8, float(i)), y=np.ones(8)) for i in range(12)]
        done, not_done = cf.wait(futs, timeout=20)
        assert not not_done
        for i, f in enumerate(futs):
            assert f.done() and f.exception(0) is None
            np.testing.assert_array_equal(f.result(0)["out"], i + 1.0)
        seen = [f for f in cf.as_completed(c.submit("echo", x=np.arange(3.0)) for _ in range(5))]
        assert len(seen) == 5
        called = threading.Event()
        c.submit("echo", x=np.ones(2)).add_done_callback(lambda f: called.set())
        assert called.wait(20)
        assert c._inflight.snapshot()["receiving"]


def test_a_future_wakes_the_receiver_only_when_something_watches_it(worker: WorkerProc,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # submit().result() is received by its own thread without waking the receiver; a done-callback, cf.wait,
    # as_completed, asyncio.wrap_future and a look at done() each wake it to finish the future at once (the receiver's
    # own slice made so long here that only such a wake can finish a future nobody waits for)
    with Client(worker.name, timeout_s=30) as c:
        np.testing.assert_array_equal(c.submit("echo", x=np.ones(2)).result()["out"], 1.0)  # the receiver runs
        monkeypatch.setattr(_inflight, "_RECEIVER_SLICE_S", 60.0)
        deadline = time.monotonic() + 10
        while not c._inflight._receiver_aside and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.1)  # the receiver's slice of 0.05 s ran out: it sleeps in the long one now
        turns = c._inflight.snapshot()["receiver_turns"]
        for i in range(100):
            x = np.full(8, float(i))
            np.testing.assert_array_equal(c.submit("vector_add", x=x, y=np.ones(8)).result()["out"], x + 1)
        assert c._inflight.snapshot()["receiver_turns"] == turns  # never woken: each caller received its own answer

        unwatched = c.submit("echo", x=np.full(4, 2.0))
        time.sleep(0.3)  # answered long ago, but nobody leads: it waits for a look (Future.done does not look)
        assert not Future.done(unwatched)

        called = threading.Event()
        c.submit("echo", x=np.ones(2)).add_done_callback(lambda f: called.set())
        assert called.wait(10)
        assert Future.done(unwatched)  # the receiver finished every future in flight while it led
        np.testing.assert_array_equal(unwatched.result(0)["out"], 2.0)

        assert not cf.wait([c.submit("echo", x=np.ones(2)) for _ in range(3)], timeout=10).not_done
        assert len(list(cf.as_completed([c.submit("echo", x=np.ones(2)) for _ in range(3)], timeout=10))) == 3
        polled = c.submit("echo", x=np.ones(2))
        deadline = time.monotonic() + 10
        while not polled.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert Future.done(polled)

        async def wrapped() -> dict[str, np.ndarray]:
            return await asyncio.wait_for(asyncio.wrap_future(c.submit("echo", x=np.full(2, 5.0))), 10)

        np.testing.assert_array_equal(asyncio.run(wrapped())["out"], 5.0)
        assert c._inflight.snapshot()["receiver_turns"] > turns and len(c._inflight) == 0


def _in_threads(n: int, run: Callable[[int], None]) -> list[BaseException]:
    """Run ``run(k)`` in ``n`` threads at once (k = 0..n-1); what they raised."""
    errors: list[BaseException] = []

    def guarded(k: int) -> None:
        try:
            run(k)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def test_threads_share_one_client_and_each_gets_its_own_answer(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=30) as c:
        def run(k: int) -> None:
            for i in range(60):
                x = np.full(16, float(k * 1000 + i))
                out = c.call("vector_add", x=x, y=np.ones(16))["out"]
                np.testing.assert_array_equal(out, x + 1)
            with c.loan(1024) as req:
                a = req.array("x", 4, "float64")
                a[:] = k
                b = req.array("y", 4, "float64")
                b[:] = 1
                np.testing.assert_array_equal(req.send("vector_add")["out"], k + 1)
                del a, b

        errors = _in_threads(6, run)
        assert not errors, errors
        assert len(c._inflight) == 0
        assert not c._inflight.snapshot()["receiving"]  # call() alone never starts the receiver thread


def test_one_thread_waits_on_a_slow_call_while_another_is_answered(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=60) as c:
        slow = c.submit(slow_pipeline(), x=np.ones(3_500_000))
        wait_in_flight(worker.name)
        box: list[object] = []
        waiter = threading.Thread(target=lambda: box.append(slow.result()))
        waiter.start()
        for _ in range(5):  # the waiter pumps or the receiver does: this thread is never stuck behind it
            np.testing.assert_array_equal(c.call("echo", x=np.ones(3))["out"], 1.0)
        waiter.join(60)
        np.testing.assert_array_equal(box[0]["19.out"], 1.0)  # type: ignore[index]


def test_a_thread_waiting_for_its_answer_receives_it_itself_and_the_receiver_leads_again(worker: WorkerProc) -> None:
    # the receiver thread steps aside for a thread that waits (result(), call()): that thread receives its own answer,
    # so the future's callback runs on it (the answer comes long after the hand-over: 20 steps over 14 MB); a future
    # nobody waits for then still completes by itself
    with Client(worker.name, timeout_s=60) as c:
        np.testing.assert_array_equal(c.submit("echo", x=np.ones(2)).result()["out"], 1.0)  # the receiver runs
        assert c._inflight.snapshot()["receiving"]
        # with no future in flight it does not lead: a call() is received by its own thread alone
        deadline = time.monotonic() + 10
        while not c._inflight._receiver_aside and time.monotonic() < deadline:
            time.sleep(0.001)
        assert c._inflight._receiver_aside and not c._inflight._receiver_leads and c._inflight._futures == 0
        handovers = c._inflight.snapshot()["handovers"]
        np.testing.assert_array_equal(c.call("echo", x=np.ones(3))["out"], 1.0)
        assert c._inflight.snapshot()["handovers"] == handovers  # nobody had to ask it to step aside
        fut = c.submit(slow_pipeline(), x=np.ones(3_500_000))
        wait_in_flight(worker.name)
        ran_on: list[int] = []
        fut.add_done_callback(lambda f: ran_on.append(threading.get_ident()))  # watched: the receiver leads for it
        deadline = time.monotonic() + 10
        while not c._inflight._receiver_leads and time.monotonic() < deadline:
            time.sleep(0.001)
        assert c._inflight._receiver_leads
        np.testing.assert_array_equal(fut.result()["19.out"][:3], 1.0)
        assert ran_on == [threading.get_ident()]
        assert c._inflight.snapshot()["handovers"] == handovers + 1
        for via_call in (True, False):  # the same for call() and result(), then the receiver again
            slow = c.submit(slow_pipeline(), x=np.ones(3_500_000))
            wait_in_flight(worker.name)
            box: list[int] = []
            slow.add_done_callback(lambda f, box=box: box.append(threading.get_ident()))
            if via_call:
                np.testing.assert_array_equal(c.call("echo", x=np.ones(3))["out"], 1.0)
            called = threading.Event()
            c.submit("echo", x=np.ones(2)).add_done_callback(lambda f, called=called: called.set())
            assert called.wait(20)  # led by the receiver again: nobody waits for it
            assert cf.wait([slow], timeout=30).done == {slow} and box and box[0] != threading.get_ident()


def test_threads_mixing_calls_results_and_unwaited_futures_each_get_their_answers(worker: WorkerProc) -> None:
    # waiters asking the receiver to step aside, taking the lead from one another, and futures only the receiver
    # finishes, at once: every answer right, every callback run, nothing left in flight
    called: list[int] = []
    with Client(worker.name, timeout_s=30) as c:
        def run(k: int) -> None:
            for i in range(80):
                x = np.full(8, float(k * 1000 + i))
                if i % 3 == 0:
                    out = c.call("vector_add", x=x, y=np.ones(8))["out"]
                elif i % 3 == 1:
                    out = c.submit("vector_add", x=x, y=np.ones(8)).result()["out"]
                else:
                    f = c.submit("vector_add", x=x, y=np.ones(8))
                    f.add_done_callback(lambda f, i=i: called.append(i))
                    continue
                np.testing.assert_array_equal(out, x + 1)

        errors = _in_threads(5, run)
        assert not errors, errors
        deadline = time.monotonic() + 20
        while len(called) < 5 * 26 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(called) == 5 * 26
        assert len(c._inflight) == 0 and c._inflight._asks == 0


def test_an_unwaited_future_times_out_by_itself(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=60) as c:
        fut = c.submit(slow_pipeline(25), x=np.ones(3_500_000), timeout_s=0.05)
        done, _ = cf.wait([fut], timeout=30)
        assert done
        assert isinstance(fut.exception(0), Timeout)
        np.testing.assert_array_equal(c.call("echo", x=np.ones(2))["out"], 1.0)


def test_futures_fail_with_worker_gone_when_it_dies(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker()
    c = Client(w.name, timeout_s=60)
    try:
        fut = c.submit(slow_pipeline(), x=np.ones(3_500_000))
        wait_in_flight(w.name)
        os.kill(w.pid, signal.SIGKILL)
        done, _ = cf.wait([fut], timeout=30)
        assert done
        assert isinstance(fut.exception(0), WorkerGoneError)
        with pytest.raises(WorkerGoneError):
            c.call("echo", x=np.ones(4))
    finally:
        c.close()
        w.proc.wait(10)
    _remove_sockets(w.name)


def _remove_sockets(name: str) -> None:
    """A SIGKILLed worker leaves its sockets for a successor to remove; this test has none."""
    for p in (socket_path(name), attach_path(name)):
        p.unlink(missing_ok=True)


def test_close_finishes_pending_futures(worker: WorkerProc) -> None:
    c = Client(worker.name, timeout_s=60)
    fut: CallFuture = c.submit(slow_pipeline(), x=np.ones(3_500_000))
    wait_in_flight(worker.name)
    c.close()
    assert fut.done()
    assert isinstance(fut.exception(0), ClientClosedError)
