"""AsyncClient: calls as coroutines on the running loop, with every failure path of the blocking Client."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from wire import reap_killed, slow_pipeline, stopped, wait_for_state

from shmrpc.client import (
    AsyncClient,
    BusyError,
    Client,
    ClientClosedError,
    ForkedClientError,
    InvalidRequestError,
    KernelError,
    Timeout,
    WorkerGoneError,
)

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]



def test_call_submit_and_loan(worker: WorkerProc) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=30) as c:
            out = (await c.call("scale", x=np.arange(4.0), a=2.0, b=1.0))["out"]
            np.testing.assert_array_equal(out, [1.0, 3.0, 5.0, 7.0])
            outs = await asyncio.gather(*(c.submit("vector_add", x=np.full(8, float(i)), y=np.ones(8))
                                          for i in range(1000)))  # far more than the client's slots
            for i, o in enumerate(outs):
                np.testing.assert_array_equal(o["out"], i + 1.0)
            async with c.loan(4096) as req:
                x = req.array("x", 16, "float32")
                x[:] = 2
                y = req.array("y", 16, "float32")
                y[:] = 3
                got = await req.send("vector_add")
                np.testing.assert_array_equal(got["out"], 5.0)
                del x, y, got
            await c.put("bias", np.ones(4))
            from shmrpc.client import Resident
            np.testing.assert_array_equal((await c.call("vector_add", x=np.ones(4), y=Resident("bias")))["out"], 2.0)
            assert await c.resident() == {"bias": ((4,), np.dtype(np.float64))}
            await c.drop("bias")
            assert await c.resident() == {}

    asyncio.run(main())


def test_bad_input_and_kernel_errors_name_the_field(worker: WorkerProc) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=30) as c:
            with pytest.raises(InvalidRequestError) as e:
                await c.call("no_such_op", x=np.ones(4))
            assert e.value.field
            with pytest.raises(KernelError) as k:
                await c.call("vector_add", x=np.ones(4), y=np.ones(5))
            assert k.value.op == "vector_add"
            np.testing.assert_array_equal((await c.call("echo", x=np.ones(2)))["out"], 1.0)  # still serving

    asyncio.run(main())


def test_timeout(worker: WorkerProc) -> None:
    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=30) as c:
            with pytest.raises(Timeout) as e:
                await c.call(slow_pipeline(25), x=np.ones(3_500_000), timeout_s=0.05)
            assert isinstance(e.value, TimeoutError)
            np.testing.assert_array_equal((await c.call("echo", x=np.ones(2)))["out"], 1.0)

    asyncio.run(main())


@pytest.mark.parametrize("lane", [None, "block"])  # with a lane, the request waits in it (the loop reads its eventfd)
def test_worker_gone(spawn_worker: Callable[..., WorkerProc], lane: str | None) -> None:
    w = spawn_worker()

    async def main() -> None:
        c = await AsyncClient.connect(w.name, timeout_s=60, lane=lane)
        try:
            pending = c.submit(slow_pipeline(), x=np.ones(3_500_000))
            ln = c.client._t.lane
            assert (ln is not None) == (lane is not None)
            while ln is not None and not ln.busy:  # sent from the executor (a new signature's sizes are asked first)
                await asyncio.sleep(0.001)
            await asyncio.get_running_loop().run_in_executor(
                None, wait_for_state, w.name, lambda st: st["in_flight"] >= 1, "a request in flight")
            os.kill(w.pid, signal.SIGKILL)
            with pytest.raises(WorkerGoneError):
                await asyncio.wait_for(pending, 10)  # the pidfd says so, not the request's 60 s
            with pytest.raises(WorkerGoneError):
                await c.call("echo", x=np.ones(2))
        finally:
            await c.aclose()

    asyncio.run(main())
    reap_killed(w)


def _use_in_child(c: AsyncClient, q: mp.Queue) -> None:  # type: ignore[type-arg]
    async def main() -> None:
        await c.call("echo", x=np.ones(2))

    try:
        asyncio.run(main())
        q.put("no error")
    except ForkedClientError as e:
        q.put(f"ForkedClientError: {e}")


def test_forked_child_is_told_to_reconnect(worker: WorkerProc) -> None:
    c = AsyncClient(Client(worker.name, timeout_s=10))
    try:
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_use_in_child, args=(c, q))
        p.start()
        msg = q.get(timeout=20)
        p.join(10)
        assert msg.startswith("ForkedClientError"), msg
    finally:
        c.client.close()


@pytest.mark.parametrize("lane", ["block", "spin"])
def test_an_async_client_with_a_lane_reads_its_answers_there(worker: WorkerProc, lane: str) -> None:
    # A request sent while nothing else is in flight rides the lane; the loop reads the lane's eventfd, which the ring
    # asked the worker to write, and finishes the call on its own thread. (Before 2026-12-04 nobody collected such an
    # answer: every such call timed out.) Requests in flight together go over ZeroMQ, and the blocking Client on the
    # same connection still takes the lane.
    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=5, lane=lane) as c:
            ln = c.client._t.lane
            assert ln is not None  # the worker granted one
            x = np.arange(16, dtype=np.float32)
            seq = ln.seq
            for i in range(5):  # a planned signature from the second call on
                np.testing.assert_array_equal((await c.call("scale", x=x, a=float(i), b=1.0))["out"], x * i + 1)
            np.testing.assert_array_equal((await c.call("echo", x=np.ones(3)))["out"], 1.0)  # the general path
            async with c.loan(4096) as req:
                req.array("x", 8, "float64")[:] = 2
                req.array("y", 8, "float64")[:] = 3
                np.testing.assert_array_equal((await req.send("vector_add"))["out"], 5.0)
            with pytest.raises(KernelError) as e:  # an error comes back through the lane typed, naming the field
                await c.call("vector_add", x=np.ones(3), y=np.ones(4), out_nbytes=64)
            assert e.value.tensor == "y"
            assert ln.seq - seq >= 7  # one ring each, but for the first call's sizing (asked off the loop)
            assert not ln.busy and not ln.waiting and ln.fd not in c._watched  # collected, the eventfd left alone
            outs = await asyncio.gather(*(c.call("vector_add", x=np.full(4, float(k)), y=np.ones(4)) for k in range(20)))
            for k, o in enumerate(outs):
                np.testing.assert_array_equal(o["out"], k + 1.0)
            assert not ln.busy and not ln.waiting
            # a request sent while another is in flight goes over ZeroMQ: one slow request in the lane, one beside it
            seq = ln.seq
            slow = c.submit(slow_pipeline(20), x=np.ones(3_500_000))  # ~0.1 s (sized off the loop, sent from there)
            while ln.seq == seq:
                await asyncio.sleep(0)
            beside = c.submit("echo", x=np.full(3, 5.0))
            np.testing.assert_array_equal((await beside)["out"], 5.0)
            # ... and so does another thread's blocking call (the loop holds the lane's wait: the ring leaves it)
            assert ln.busy and ln.waiting and not slow.done()
            got = await asyncio.get_running_loop().run_in_executor(None, lambda: c.client.call("echo", x=np.ones(3)))
            np.testing.assert_array_equal(got["out"], 1.0)
            np.testing.assert_array_equal(next(iter((await slow).values()))[:3], 1.0)
            assert ln.seq == seq + 1 and not ln.busy and not ln.waiting
            seq = ln.seq
            got = await asyncio.get_running_loop().run_in_executor(None, lambda: c.client.call("echo", x=x))
            np.testing.assert_array_equal(got["out"], x)
            assert ln.seq == seq + 1 and not ln.busy  # the blocking call took the lane and read its answer itself
            np.testing.assert_array_equal((await c.call("scale", x=x, a=2.0, b=0.0))["out"], 2 * x)
            assert ln.seq == seq + 2

    asyncio.run(main())


def test_a_lone_lane_request_polled_on_the_loop_is_answered_at_the_next_turn(
        worker: WorkerProc, monkeypatch: pytest.MonkeyPatch) -> None:
    # A ring that finds the worker polling the lanes (it lingers: ClientLane.slept is False) is followed by a bounded
    # poll of the page on the loop's thread: a quick answer inside submit() finishes the call at the loop's next turn
    # (no reader on the lane's eventfd, no wait in epoll), not at once: the awaiting task yields once, as it does for
    # an answer over ZeroMQ. Polls in vain back off: after n in a row, the next 2^n - 1 such rings are not polled. Whether
    # the worker lingers is its own heuristic; here every ring says it found the worker polling (when it did not, the
    # ring wrote the doorbell anyway), so that the test does not race the worker.
    from shmrpc.client import _async
    from shmrpc.client._lane import ClientLane

    ring = ClientLane.ring

    def found_polling(self: ClientLane, frame: bytes, request_id: int, sleeper: bool = False) -> None:
        ring(self, frame, request_id, sleeper)
        self.slept = False

    monkeypatch.setattr(ClientLane, "ring", found_polling)

    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=30, lane="block") as c:
            ln = c.client._t.lane
            assert ln is not None
            x = np.arange(8, dtype=np.float32)
            monkeypatch.setattr(_async, "_LANE_POLL_S", 0.5)  # far longer than the worker takes
            np.testing.assert_array_equal((await c.call("vector_add", x=x, y=x))["out"], 2 * x)  # planned

            big, slow = np.ones(60_000), slow_pipeline(20)  # the worker takes a while (in the client's own 1 MiB slot)

            async def lone(k: int, op: Any = "vector_add", stop: bool = False) -> bool:
                """Whether it was answered inside submit(); ``stop``: the worker stopped (SIGSTOP) until then, so
                that no look at the page can find the answer, however late the client looks on a loaded machine."""
                with stopped(worker.pid) if stop else contextlib.nullcontext():
                    if op == "vector_add":
                        fut, want = c.submit(op, x=x, y=np.full(8, float(k), np.float32)), x + k
                    else:
                        fut, want = c.submit(op, x=big), big
                    # in the lane and answered within the poll: no reader on the lane's eventfd
                    polled = c._lane_reply is not None and ln.fd not in c._watched
                    assert not fut.done()
                if polled:
                    await asyncio.sleep(0)
                    assert fut.done()  # at the next turn
                np.testing.assert_array_equal(next(iter((await fut).values())), want)
                assert not ln.busy and not ln.waiting and ln.fd not in c._watched
                return polled

            await lone(0, slow)  # planned (its output sizes asked first)
            seq = ln.seq
            assert all([await lone(k) for k in range(20)])
            assert ln.seq == seq + 20 and c._lane_misses == c._lane_skip == 0

            monkeypatch.setattr(_async, "_LANE_POLL_S", 0.0)  # one look at the page: the request is not there yet
            seen = []
            for _ in range(15):
                assert not await lone(0, slow, stop=True)
                seen.append((c._lane_misses, c._lane_skip))
            assert seen[0] == (1, 1) and seen[1] == (1, 0) and seen[2] == (2, 3)
            assert seen[-1] == (4, 15)  # polled at the 1st, 3rd, 7th and 15th

            monkeypatch.setattr(_async, "_LANE_POLL_S", 0.5)
            c._lane_skip = 0
            assert await lone(1) and c._lane_misses == 0  # an answer within the poll: no more backing off

            # a task calling in a loop, every answer within the poll, leaves the loop's other tasks their turns
            turns, stop = 0, False

            async def other() -> None:
                nonlocal turns
                while not stop:
                    turns += 1
                    await asyncio.sleep(0)

            beside = asyncio.ensure_future(other())
            await asyncio.sleep(0)
            first = turns
            for _ in range(30):
                np.testing.assert_array_equal((await c.call("vector_add", x=x, y=x))["out"], 2 * x)
            stop = True
            await beside
            assert turns - first >= 30 and c._lane_misses == 0

    asyncio.run(main())


def test_a_loop_lane_wait_woken_early_times_out_and_collects_the_late_answer(worker: WorkerProc) -> None:
    # The lane's eventfd written with no DONE in the page (as the worker's early wake and PULSE do): the loop reads it
    # and waits on. A request past its timeout fails with Timeout; its late answer is still read from the lane, which
    # then carries the next request.
    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=30, lane="block") as c:
            ln = c.client._t.lane
            assert ln is not None
            big = np.ones(3_500_000)
            np.testing.assert_array_equal((await c.call("echo", x=np.ones(2)))["out"], 1.0)
            slow = asyncio.ensure_future(c.call(slow_pipeline(20), x=big))
            while not ln.busy:
                await asyncio.sleep(0.001)
            seq = ln.seq
            for _ in range(3):
                os.eventfd_write(ln.fd, 1)  # a wake-up without an answer
                await asyncio.sleep(0.002)
            assert not slow.done()
            out = await asyncio.wait_for(slow, 30)
            np.testing.assert_array_equal(next(iter(out.values()))[:3], 1.0)  # (identity steps)
            assert ln.seq == seq and not ln.busy and not ln.waiting

            with pytest.raises(Timeout):
                await c.call(slow_pipeline(25), x=big, timeout_s=0.05)
            assert ln.busy and ln.waiting  # still in the lane, the loop still reading for it
            while ln.busy:  # its answer comes late and is collected: the slot goes back
                await asyncio.sleep(0.005)
            assert not ln.waiting and len(c.client._inflight) == 0
            seq = ln.seq
            np.testing.assert_array_equal((await c.call("echo", x=np.full(2, 3.0)))["out"], 3.0)
            assert ln.seq == seq + 1

    asyncio.run(main())


def test_an_answer_routed_by_another_thread_finishes_the_awaited_call(worker: WorkerProc) -> None:
    # AsyncClient's answers finish asyncio futures directly on the loop's thread. A blocking call on another thread of
    # the same Client may route them (it pumps the socket for every request while it waits): then the loop is handed
    # the outcome (call_soon_threadsafe), values and errors alike.
    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=30) as c:
            loop = asyncio.get_running_loop()
            # planned first: a new signature's sizing asks the worker, which would route answers meanwhile
            np.testing.assert_array_equal((await c.call("vector_add", x=np.ones(4), y=np.ones(4)))["out"], 2.0)
            sock_fd, wake_fd, _ = c.client._t.watch_fds
            loop.remove_reader(sock_fd)  # the loop stops routing answers for a while
            loop.remove_reader(wake_fd)
            try:
                ok = c.submit("vector_add", x=np.arange(4.0), y=np.ones(4))
                bad = c.submit("vector_add", x=np.ones(4), y=np.ones(5), out_nbytes=64)  # (sized: not asked)
                await loop.run_in_executor(None, wait_for_state, worker.name, lambda st: sum(
                    st["counters"]["requests"].get("vector_add", {}).values()) >= 2, "both answered")
                assert not ok.done() and not bad.done()  # answered, but nobody routed the answers yet
                routed_on: list[int] = []
                real = c.client._inflight._route

                def route(frames: list[bytes]) -> Any:
                    routed_on.append(threading.get_ident())
                    return real(frames)

                c.client._inflight._route = route  # type: ignore[method-assign]

                def blocking_call() -> Any:
                    return c.client.call("echo", x=np.full(3, 7.0))["out"]

                np.testing.assert_array_equal(await loop.run_in_executor(None, blocking_call), 7.0)
                del c.client._inflight._route
                assert routed_on and threading.get_ident() not in routed_on
            finally:
                loop.add_reader(sock_fd, c._pump)
                loop.add_reader(wake_fd, c._woken)
            np.testing.assert_array_equal((await asyncio.wait_for(ok, 10))["out"], np.arange(4.0) + 1)
            with pytest.raises(KernelError):
                await asyncio.wait_for(bad, 10)
            np.testing.assert_array_equal((await c.call("echo", x=np.ones(2)))["out"], 1.0)
            assert len(c.client._inflight) == 0

    asyncio.run(main())


def test_a_question_to_the_worker_before_a_request_is_asked_from_the_loop_without_waiting(worker: WorkerProc) -> None:
    # A new signature's output sizes and a resident tensor's spec come from the worker (a control round trip). Since
    # the thirty-fourth session AsyncClient sends the question from the loop and sends the request when the reply
    # comes, routed by the loop like an answer: no thread waits (before, the request went to the executor, which
    # asked and waited there), and requests of one new signature sent together ask once.
    from shmrpc.client import Resident

    async def main() -> None:
        ex = _CountingExecutor()
        async with await AsyncClient.connect(worker.name, timeout_s=30) as c:
            asyncio.get_running_loop().set_default_executor(ex)
            waited: list[int] = []
            real_pump = c.client._pump

            def pump(*args: Any) -> Any:
                waited.append(threading.get_ident())
                return real_pump(*args)

            c.client._pump = pump  # type: ignore[method-assign]
            first_id = next(c.client._ctl_id)
            x = np.arange(5.0)
            np.testing.assert_array_equal((await c.call("scale", x=x, a=3.0, b=0.0))["out"], 3 * x)  # sized
            np.testing.assert_array_equal((await c.call("vector_add", x=x, y=Resident("shared/bias7")))["out"], x + 7)
            np.testing.assert_array_equal((await c.call("echo", x=np.ones((2, 3), np.int16)))["out"], 1)
            outs = await asyncio.gather(*(c.submit("scale", x=np.full(9, float(i)), a=2.0, b=1.0) for i in range(6)))
            for i, o in enumerate(outs):  # one new signature, six requests at once: one question
                np.testing.assert_array_equal(o["out"], 2.0 * i + 1)
            asked = next(c.client._ctl_id) - first_id - 1
            # the resident list, then vector_add's sizes (that request waited for the list's reply, and a request
            # that waited asks first); neither scale asks (sent without asking since 2026-12-04, the sizes learned
            # from the answers); echo: no question
            assert asked == 2
            for _ in range(3):  # planned now: no question
                np.testing.assert_array_equal((await c.call("scale", x=x, a=3.0, b=0.0))["out"], 3 * x)
                np.testing.assert_array_equal((await c.call("vector_add", x=x, y=Resident("shared/bias7")))["out"], x + 7)
            assert next(c.client._ctl_id) == first_id + asked + 2
            assert waited == [] and ex.used == 0  # nobody waited for a reply, nothing went to the executor
            assert not c.client._asked and not c.client._asked_ids and not c.client._asking
            assert not c.client._control and not c._answer_waits and c.client._nowait_thread == 0

    with Client(worker.name, timeout_s=30) as other:
        other.put("bias7", np.full(5, 7.0), shared=True)  # shared/bias7: the async client has no record of it
        asyncio.run(main())


def test_a_question_whose_reply_is_late_times_out_and_is_forgotten(worker: WorkerProc) -> None:
    # (a resident tensor the client has no record of: its spec is a question; since 2026-12-04 a new signature's
    # output sizes are not asked first)
    from shmrpc.client import Resident

    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=30) as c:
            loop = asyncio.get_running_loop()
            sock_fd, wake_fd, _ = c.client._t.watch_fds
            loop.remove_reader(sock_fd)  # the loop stops routing: the question's reply waits in the socket
            loop.remove_reader(wake_fd)
            try:
                late = c.submit("vector_add", x=np.ones(7), y=Resident("shared/seven"), timeout_s=0.05)
                assert len(c._answer_waits) == 1 and len(c.client._asking) == 1
                with pytest.raises(Timeout) as e:
                    await asyncio.wait_for(late, 5)
                assert "a question before 'vector_add'" in str(e.value)
                assert not c._answer_waits and not c.client._asking and not c.client._asked and not c.client._asked_ids
            finally:
                loop.add_reader(sock_fd, c._pump)
                loop.add_reader(wake_fd, c._woken)
                c._pump()
            np.testing.assert_array_equal((await c.call("vector_add", x=np.ones(7), y=Resident("shared/seven")))["out"],
                                          8.0)
            assert not c.client._control  # the late reply was dropped, the second call asked again

    with Client(worker.name, timeout_s=30) as other:
        other.put("seven", np.full(7, 7.0), shared=True)
        asyncio.run(main())


def test_an_idle_async_client_leaves_the_loop_asleep(worker: WorkerProc) -> None:
    # The look for requests past their deadline runs every _EXPIRE_S only while something is in flight: an idle
    # client's loop is not woken 50 times a second. The next request arms it again, and its deadline still holds.
    from shmrpc.client import _async

    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=30) as c:
            np.testing.assert_array_equal((await c.call("echo", x=np.ones(2)))["out"], 1.0)
            await asyncio.sleep(3 * _async._EXPIRE_S)
            assert c._tick is None
            turns = 0
            real = c._expire

            def counted() -> None:
                nonlocal turns
                turns += 1
                real()

            c._expire = counted  # type: ignore[method-assign]
            await asyncio.sleep(10 * _async._EXPIRE_S)
            assert turns == 0
            with pytest.raises(Timeout):  # armed by the request; fails it in time
                await c.call(slow_pipeline(25), x=np.ones(3_500_000), timeout_s=0.05)
            assert turns >= 1
            np.testing.assert_array_equal((await c.call("echo", x=np.ones(2)))["out"], 1.0)

    asyncio.run(main())


class _CountingExecutor(ThreadPoolExecutor):
    """The loop's default executor, counting what is sent to it."""

    def __init__(self) -> None:
        super().__init__(2)
        self.used = 0

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        self.used += 1
        return super().submit(fn, *args, **kwargs)


def _sent_order(c: AsyncClient) -> list[float]:
    """Record, in order, the first element of input ``x`` of every request the client sends."""
    sent: list[float] = []
    real = c.client._submit
    depth = 0

    def submit(op: Any, timeout_s: Any, out_nbytes: Any, in_place: Any, keep: Any, copy: Any, nowait: bool,
               kwargs: dict[str, Any], *args: Any, **kw: Any) -> Any:
        nonlocal depth
        depth += 1  # (_submit calls itself once to mark its thread)
        try:
            got = real(op, timeout_s, out_nbytes, in_place, keep, copy, nowait, kwargs, *args, **kw)
        finally:
            depth -= 1
        if not depth:
            sent.append(float(kwargs["x"].flat[0]))
        return got

    c.client._submit = submit  # type: ignore[method-assign]
    return sent


@pytest.mark.parametrize("lane", [None, "block"])
def test_requests_beyond_the_free_slots_wait_on_the_loop_in_order(worker: WorkerProc, lane: str | None) -> None:
    # More requests at once than the client has slots: the rest wait on the loop, oldest first, and go out as answers
    # free slots; none goes through the executor (before, each took an executor thread, an ACQUIRE and a pump of its
    # own: a gather of 8 on a lease of 4 cost ~10x a gather of 4 per call).
    async def main() -> None:
        ex = _CountingExecutor()
        asyncio.get_running_loop().set_default_executor(ex)
        async with await AsyncClient.connect(worker.name, timeout_s=30, lane=lane) as c:
            y = np.ones(8)
            np.testing.assert_array_equal((await c.call("vector_add", x=y, y=y))["out"], 2.0)  # planned: no question
            n_own = len(c.client._slots)
            used = ex.used
            sent = _sent_order(c)
            futs = [c.submit("vector_add", x=np.full(8, float(i)), y=y) for i in range(60)]
            n_sent = len(c.client._inflight)  # the free slots, and the kept call() loan's
            assert n_own <= n_sent <= n_own + 1 and len(c._queued) == 60 - n_sent
            outs = await asyncio.gather(*futs)
            for i, o in enumerate(outs):
                np.testing.assert_array_equal(o["out"], i + 1.0)
            assert ex.used == used  # nothing sent from the executor
            assert sent == [float(i) for i in range(60)]  # in order
            assert not c._queued and len(c.client._inflight) == 0
            assert len(c.client._slots) == n_own and not any(s.borrowed for s in c.client._slots.free)

    asyncio.run(main())


def test_a_request_no_answer_frees_a_slot_for_goes_out_from_the_executor(worker: WorkerProc) -> None:
    # A request larger than every slot of the client's own waits for no answer: it goes out from the executor, which
    # borrows a slot of the worker (ACQUIRE); the small ones around it still wait on the loop, in order.
    async def main() -> None:
        ex = _CountingExecutor()
        asyncio.get_running_loop().set_default_executor(ex)
        async with await AsyncClient.connect(worker.name, timeout_s=30) as c:
            small, big = np.ones(8), np.ones(300_000)  # 2.4 MB: more than the 1M slot a client leases here
            np.testing.assert_array_equal((await c.call("vector_add", x=small, y=small))["out"], 2.0)
            np.testing.assert_array_equal((await c.call("vector_add", x=big, y=big))["out"], 2.0)  # borrowed once
            used = ex.used
            futs = [c.submit("vector_add", x=np.full(8, float(i)), y=small) for i in range(10)]
            futs.append(c.submit("vector_add", x=np.full(300_000, 5.0), y=big))
            futs += [c.submit("vector_add", x=np.full(8, float(i)), y=small) for i in range(10, 20)]
            outs = await asyncio.gather(*futs)
            for i, o in enumerate(outs[:10] + outs[11:]):
                np.testing.assert_array_equal(o["out"], i + 1.0)
            np.testing.assert_array_equal(outs[10]["out"], 6.0)
            assert ex.used == used + 1  # the large one only

    asyncio.run(main())


def test_a_waiting_request_times_out_is_cancelled_or_fails_alone(worker: WorkerProc) -> None:
    # Requests waiting for a slot keep their deadline, can be cancelled, and fail with their own error when they go
    # out; the others are answered, and no slot is lost.
    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=30) as c:
            loop = asyncio.get_running_loop()
            y = np.ones(8)
            np.testing.assert_array_equal((await c.call("vector_add", x=y, y=y))["out"], 2.0)
            n_own = len(c.client._slots)
            sock_fd, wake_fd, _ = c.client._t.watch_fds
            loop.remove_reader(sock_fd)  # the loop stops routing answers: the first requests hold every slot
            loop.remove_reader(wake_fd)
            try:
                first = []
                while not c._queued:  # until one waits: the last of these
                    first.append(c.submit("vector_add", x=np.full(8, float(len(first))), y=y))
                late = c.submit("vector_add", x=y, y=y, timeout_s=0.05)
                gone = c.submit("vector_add", x=y, y=y)
                bad = c.submit("vector_add", x=np.ones(8), y=np.ones(9), out_nbytes=64)  # (sized: not asked)
                ok = c.submit("vector_add", x=np.full(8, 41.0), y=y)
                assert len(c._queued) == 5 and len(c.client._inflight) == len(first) - 1
                with pytest.raises(BusyError) as e:  # not sent: a slot wait running out, as in Client
                    await asyncio.wait_for(late, 5)
                assert "became free" in str(e.value) and e.value.field == "nbytes"
                assert not isinstance(e.value, Timeout)
                gone.cancel()
                assert not ok.done() and not any(f.done() for f in first)
            finally:
                loop.add_reader(sock_fd, c._pump)
                loop.add_reader(wake_fd, c._woken)
                c._pump()
            for i, f in enumerate(first):
                np.testing.assert_array_equal((await asyncio.wait_for(f, 10))["out"], i + 1.0)
            with pytest.raises(KernelError):
                await asyncio.wait_for(bad, 10)
            np.testing.assert_array_equal((await asyncio.wait_for(ok, 10))["out"], 42.0)
            assert gone.cancelled() and not c._queued
            assert len(c.client._inflight) == 0 and len(c.client._slots) == n_own
            np.testing.assert_array_equal((await c.call("echo", x=np.ones(2)))["out"], 1.0)

    asyncio.run(main())


def test_requests_waiting_for_a_slot_fail_when_the_client_closes(worker: WorkerProc) -> None:
    async def main() -> None:
        c = await AsyncClient.connect(worker.name, timeout_s=30)
        loop = asyncio.get_running_loop()
        y = np.ones(8)
        np.testing.assert_array_equal((await c.call("vector_add", x=y, y=y))["out"], 2.0)
        sock_fd, wake_fd, _ = c.client._t.watch_fds
        loop.remove_reader(sock_fd)
        loop.remove_reader(wake_fd)
        first = []
        while not c._queued:
            first.append(c.submit("vector_add", x=y, y=y))
        waiting = [first.pop()] + [c.submit("vector_add", x=y, y=y) for _ in range(2)]
        await c.aclose()
        for f in waiting:
            with pytest.raises(ClientClosedError):
                await asyncio.wait_for(f, 5)
        for f in first:  # in flight when the client closed
            with pytest.raises((ClientClosedError, WorkerGoneError)):
                await asyncio.wait_for(f, 5)

    asyncio.run(main())


def test_a_client_moved_to_another_loop_with_a_request_in_the_lane(worker: WorkerProc) -> None:
    # The first loop goes away while its request rides the lane (its reader on the lane's eventfd gone with it). The
    # client under a second loop sends over ZeroMQ while the lane is busy; the next ring after the answer came collects
    # it (the old loop's future is left alone: its loop is closed) and rides the lane again.
    c = AsyncClient(Client(worker.name, timeout_s=10, lane="block"))
    ln = c.client._t.lane
    assert ln is not None

    async def first() -> asyncio.Future[Any]:
        x = np.ones(3_500_000)
        await c.call(slow_pipeline(20), x=x)  # its sizes asked once (off the loop)
        seq = ln.seq
        slow = c.submit(slow_pipeline(20), x=x)  # ~0.1 s, into the lane (sent from the executor: a borrowed slot)
        while ln.fd not in c._watched:  # the loop reads the lane's eventfd for it
            await asyncio.sleep(0.001)
        assert ln.seq == seq + 1 and ln.busy and ln.waiting and not slow.done()
        slow.add_done_callback(lambda f: None)  # a callback its loop, once closed, could not schedule
        return slow

    async def second() -> None:
        seq = ln.seq
        np.testing.assert_array_equal((await c.call("echo", x=np.full(3, 4.0)))["out"], 4.0)
        assert ln.seq == seq  # over ZeroMQ: the lane still holds the first loop's request
        await asyncio.get_running_loop().run_in_executor(None, wait_for_state, worker.name,
                                                         lambda st: st["in_flight"] == 0, "the slow request answered")
        np.testing.assert_array_equal((await c.call("echo", x=np.full(3, 6.0)))["out"], 6.0)
        assert ln.seq == seq + 1 and not ln.busy and not ln.waiting  # collected the late answer, rode the lane
        assert len(c.client._inflight) == 0 and ln.fd not in c._watched

    try:
        loop1 = asyncio.new_event_loop()
        slow = loop1.run_until_complete(first())
        loop1.close()
        asyncio.run(second())
        assert not slow.done()  # its loop is gone: left as it was
    finally:
        c.client.close()


def test_requests_waiting_for_a_slot_fail_at_once_when_the_worker_dies(spawn_worker: Callable[..., WorkerProc]) -> None:
    from shmrpc.client import Resident

    w = spawn_worker()
    with Client(w.name, timeout_s=30) as other:
        other.put("ones8", np.ones(8), shared=True)  # a resident the async client has no record of: a question

    async def main() -> None:
        c = await AsyncClient.connect(w.name, timeout_s=60)
        try:
            loop = asyncio.get_running_loop()
            y = np.ones(8)
            np.testing.assert_array_equal((await c.call("vector_add", x=y, y=y))["out"], 2.0)
            sock_fd, wake_fd, _ = c.client._t.watch_fds
            loop.remove_reader(sock_fd)  # answers are not routed: the first requests keep every slot
            loop.remove_reader(wake_fd)
            asking = c.submit("vector_add", x=y, y=Resident("shared/ones8"))  # waits for its question's reply
            first = []
            while not c._queued:
                first.append(c.submit("vector_add", x=y, y=y))
            waiting = [asking, first.pop()] + [c.submit("vector_add", x=y, y=y) for _ in range(2)]
            assert len(c._queued) == 3 and len(c._answer_waits) == 1
            os.kill(w.pid, signal.SIGKILL)
            for f in first + waiting:
                with pytest.raises(WorkerGoneError):
                    await asyncio.wait_for(f, 10)  # the pidfd says so, not the requests' 60 s
            assert not c._queued and not c._answer_waits and not c.client._asking
        finally:
            await c.aclose()

    asyncio.run(main())
    reap_killed(w)


def test_questions_of_the_loop_and_of_a_blocking_thread_at_once(worker: WorkerProc) -> None:
    # A blocking call() on another thread of the same Client pumps the socket while it waits for its own replies, so
    # it routes the replies to the loop's questions too (handed to the loop), and the loop routes the thread's:
    # every call of a new signature on either side is answered with its own outputs.
    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=30) as c:
            loop = asyncio.get_running_loop()
            x = np.arange(6.0)

            def blocking() -> list[float]:
                return [float(c.client.call("scale", x=x, a=float(i), b=0.5)["out"][1]) for i in range(1, 101)]

            thread = loop.run_in_executor(None, blocking)
            outs = []
            for k in range(10):  # ten new signatures at a time
                outs += await asyncio.gather(*(c.submit("scale", x=x, a=-float(10 * k + i), b=0.0)
                                               for i in range(1, 11)))
            for i, o in enumerate(outs, 1):
                np.testing.assert_array_equal(o["out"], -float(i) * x)
            assert await asyncio.wait_for(thread, 30) == [i + 0.5 for i in range(1, 101)]
            assert not c.client._asked and not c.client._asked_ids and not c.client._asking and not c._answer_waits

    asyncio.run(main())


def test_a_task_cancelled_while_it_takes_a_loan_gives_the_slot_back(spawn_worker: Callable[..., WorkerProc]) -> None:
    # `async with c.loan(n)` takes its slot in the executor: a task cancelled meanwhile never reaches __aexit__, and
    # the slot the executor took was lost for the client's life (its own slots gone, the pool's held while idle,
    # then BusyError with nothing in flight). Cancelled at a few different moments, 200 times: none is lost.
    from wire import worker_state

    w = spawn_worker(slots="64K:2", lease="2")

    async def main() -> None:
        async with await AsyncClient.connect(w.name, timeout_s=5) as c:
            x = np.arange(4.0)

            async def use_loan() -> float:
                async with c.loan(1024) as req:
                    req.array("x", 4, "float64")[:] = 1
                    return float((await req.send("echo"))["out"][0])

            for i in range(200):
                t = asyncio.ensure_future(use_loan())
                for _ in range(i % 4):
                    await asyncio.sleep(0)
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            own = c.client._slots
            deadline = time.monotonic() + 10  # a slot taken after its task was cancelled is given back on the loop
            while len(own.free) + len(c.client._kept) != 2 or worker_state(w.name)["counters"]["pool_slots_held"]:
                assert time.monotonic() < deadline, (own.free, c.client._kept, worker_state(w.name)["counters"])
                await asyncio.sleep(0.02)  # (the executor's take may still be under way on a loaded host)
            for _ in range(3):
                np.testing.assert_array_equal((await c.call("echo", x=x, timeout_s=5))["out"], x)
            assert await use_loan() == 1.0

    asyncio.run(main())


def test_an_idle_async_client_holds_no_pool_slot(spawn_worker: Callable[..., WorkerProc]) -> None:
    # requests too large for the client's own slots borrow the worker's pool slots, sent from the executor; an answer
    # routed by another thread while the sending thread still held a view of the slot parked it, and nothing gave
    # it back until this client took a slot again: an idle client held pool slots that others waited for in vain
    from wire import worker_state

    w = spawn_worker(slots="64K:8,4M:4", lease="2,0")

    async def main() -> None:
        async with await AsyncClient.connect(w.name, timeout_s=20) as c:
            xs = [np.full(150_000, float(i)) for i in range(8)]  # 1.2 MB each: borrowed 4M slots
            for _ in range(25):
                outs = await asyncio.gather(*(c.call("echo", x=x) for x in xs))
                for o, x in zip(outs, xs):
                    np.testing.assert_array_equal(o["out"], x)
                del outs, o
                await asyncio.sleep(0.05)  # idle: every answer came, nothing in flight
                st = worker_state(w.name)
                assert (st["in_flight"], st["counters"]["pool_slots_held"]) == (0, 0), st["counters"]

    asyncio.run(main())


def test_an_async_client_refuses_a_second_running_loop_and_follows_a_new_one(worker: WorkerProc) -> None:
    # used from another thread's event loop while its own still runs, the client moved over, and the first loop's
    # requests failed as closed or were never answered; now the second loop is refused at once and the first is
    # served; once the first loop has stopped, a new one gets the client
    c = AsyncClient(Client(worker.name, timeout_s=10))
    started, stop = threading.Event(), threading.Event()
    first: dict[str, Any] = {"ok": 0, "errors": []}

    async def keep_calling() -> None:
        i = 0
        while not stop.is_set():
            try:
                out = await c.call("scale", x=np.full(4, float(i)), a=2.0, b=0.0)
                np.testing.assert_array_equal(out["out"], 2.0 * i)
                first["ok"] += 1
            except Exception as e:  # noqa: BLE001 - every error is the test's failure, counted
                first["errors"].append(repr(e))
            started.set()  # (after its first call: the client is this loop's from then on)
            i += 1

    t = threading.Thread(target=lambda: asyncio.run(keep_calling()))
    t.start()
    try:
        try:
            assert started.wait(10)
            for _ in range(20):
                with pytest.raises(RuntimeError, match="one AsyncClient per event loop"):
                    asyncio.run(c.call("echo", x=np.ones(2)))
        finally:
            stop.set()
            t.join(30)
        assert first["errors"] == [] and first["ok"] > 0, first
        np.testing.assert_array_equal(asyncio.run(c.call("echo", x=np.ones(2)))["out"], 1.0)  # the first loop ended
    finally:
        asyncio.run(c.aclose())


def test_requests_waiting_for_a_slot_fail_at_once_when_the_client_is_closed_from_another_thread(
        worker: WorkerProc) -> None:
    # a Client closed under its AsyncClient (a shutdown hook on another thread) failed the requests waiting on the
    # loop for a slot one per look for deadlines (20 ms): 500 of them took 10 s
    import time

    async def main() -> None:
        c = AsyncClient(Client(worker.name, timeout_s=30))
        x = np.ones(1000)
        await c.call("scale", x=x, a=2.0, b=1.0)  # the signature is known
        tasks = [asyncio.ensure_future(c.call("scale", x=x * i, a=2.0, b=1.0)) for i in range(600)]
        await asyncio.sleep(0)  # sent: the lease's worth in flight, the rest waiting on the loop for a slot
        assert len(c._queued) > 100
        th = threading.Thread(target=c.client.close)
        th.start()
        th.join()
        closed_at = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
        assert time.monotonic() - closed_at < 1.0
        errors = [r for r in results if isinstance(r, BaseException)]
        assert len(errors) >= 100 and all(isinstance(e, ClientClosedError) for e in errors), {type(e) for e in errors}
        for i, r in enumerate(results):  # what went out before the close was answered right
            if not isinstance(r, BaseException):
                np.testing.assert_array_equal(r["out"], 2.0 * i + 1.0)
        await c.aclose()

    asyncio.run(main())


def test_new_signatures_behind_a_queue_ask_once_and_one_chain_of_deadline_looks_runs(worker: WorkerProc) -> None:
    # requests of new signatures waiting for a slot ask the worker for their outputs' sizes: a reply that came while
    # others waited was forgotten unread and the question asked again at the request's turn, tens of times per call
    # (1000 calls took 10-20 s and some timed out); and a question asked from inside the loop's deadline look armed
    # a second chain of looks, for good, each time
    import time

    async def main() -> None:
        c = await AsyncClient.connect(worker.name, timeout_s=20)
        sent = [0]
        send = c.client._t.send

        def counting(frame: bytes) -> None:
            if frame[:1] != b"C":  # not a doorbell: a question, mostly
                sent[0] += 1
            send(frame)

        c.client._t.send = counting  # type: ignore[method-assign]
        looks = [0]
        look = c._expire

        def counted() -> None:
            looks[0] += 1
            look()

        c._expire = counted  # type: ignore[method-assign]
        stop = asyncio.Event()

        async def keep_busy() -> None:  # a steady stream: the client is never idle, its looks go on
            while not stop.is_set():
                await c.call("echo", x=np.ones(16))

        loop = asyncio.get_running_loop()

        def chains() -> int:  # the looks armed on the loop (asyncio's own list of timers)
            return sum(1 for h in loop._scheduled if not h.cancelled() and h._callback is counted)  # type: ignore[attr-defined]

        busy = [asyncio.ensure_future(keep_busy()) for _ in range(2)]
        most = 0
        for rnd in range(20):
            sizes = [rnd * 100 + i + 1 for i in range(100)]  # a new signature per request, more than the slots
            sent[0] = 0
            outs = await asyncio.gather(*(c.call("vector_add", x=np.ones(k), y=np.full(k, 2.0)) for k in sizes))
            for k, o in zip(sizes, outs):
                assert o["out"].shape == (k,) and np.all(o["out"] == 3.0)
            assert sent[0] <= 1.2 * len(sizes) + 10, (rnd, sent[0])
            most = max(most, chains())
        assert most <= 1, most
        looks[0] = 0
        t0 = time.monotonic()
        await asyncio.sleep(1.0)
        per_s = looks[0] / (time.monotonic() - t0)
        stop.set()
        await asyncio.gather(*busy)
        await c.aclose()
        assert per_s <= 60, per_s  # one chain: a look every 20 ms at most

    asyncio.run(main())
