"""``call()``'s first call of a signature: sent without asking the worker for its outputs' sizes when they fit.

A new signature (new shapes, or a new attribute value) used to cost a question to the worker (a plan query, a ZeroMQ
round trip, the worker planning it) before the request; now ``call()`` sends the request in a slot with room for
outputs as large as its inputs, learns the sizes from the answer, and asks only when the worker refused the outputs
for want of room (before anything ran). Separate worker and client processes, the real region and socket.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from support.metrics import samples

from shmrpc.client import AsyncClient, Client, KernelError, Pipeline, RequestTooLargeError

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _count_questions(c: Client) -> list[Any]:
    """The plan queries ``c`` sends from now on (each recorded, then asked as before)."""
    asked: list[Any] = []
    ask = c._sizer._ask

    def counting(msg: Any) -> Any:
        asked.append(msg)
        return ask(msg)

    c._sizer._ask = counting
    return asked


def _answered(w: WorkerProc, op: str, status: str) -> int:
    return int(samples(w.ready_line).get(f'shmrpc_requests_total{{op="{op}",status="{status}"}}', 0))


def test_new_signatures_whose_outputs_fit_ask_nothing_and_learn_their_sizes(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    worker = spawn_worker("--metrics-port", "0")
    rng = np.random.default_rng(41)
    with Client(worker.name, timeout_s=10) as c:
        asked = _count_questions(c)
        x = rng.standard_normal(16).astype(np.float32)
        for i in range(20):  # a new attribute value every call: a new signature every call
            a = float(i) + 0.5
            np.testing.assert_allclose(c.call("scale", x=x, a=a, b=1.0)["out"], a * x + 1, rtol=1e-6)
        for n in (3, 100, 5000):  # new shapes
            v = rng.standard_normal(n)
            w = rng.standard_normal(n)
            np.testing.assert_array_equal(c.call("vector_add", x=v, y=w)["out"], v + w)
        p = Pipeline().then("scale", a=3.0).then("vector_add", inputs={"x": "0.out", "y": "y"})
        np.testing.assert_allclose(c.call(p, x=x, y=x)["1.out"], 4 * x, rtol=1e-6)
        assert asked == []
        # each signature's plan is kept, sized by what its answer said: the same bytes the question would have given
        plans = [p for k, p in c._plans.items() if k[0] == "vector_add"]
        assert len(plans) == 3 and all(p.learn is None for p in plans)
        learned = dict(c._sizer._cache)
        c._sizer._cache.clear()
        for i in (0, 19):
            c.call("scale", x=x, a=float(i) + 0.5, b=1.0, out_nbytes=None)  # (a kept plan: no question either)
        assert asked == []
        key = c._sizer.key("scale", {"x": ((16,), "float32")}, (), {"a": 0.5, "b": 1.0}, ())
        assert c._sizer.out_nbytes(c.op_table, "scale", {"x": ((16,), "float32")}, (), {"a": 0.5, "b": 1.0}, ()) \
            == learned[key]
        assert len(asked) == 1  # that one was asked: the answer equals what the call learned
        # the second call of a signature takes the kept plan and the kept loan
        before = len(c._plans)
        np.testing.assert_allclose(c.call("scale", x=x, a=19.5, b=1.0)["out"], 19.5 * x + 1, rtol=1e-6)
        assert len(c._plans) == before and len(asked) == 1
    assert _answered(worker, "scale", "RequestTooLargeError") == 0


def test_outputs_larger_than_the_guess_are_refused_once_then_asked_and_sent_again(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    worker = spawn_worker("--metrics-port", "0", "--log-level", "INFO")  # (a failed request's line is INFO)
    rng = np.random.default_rng(42)
    x = rng.standard_normal((256, 1)).astype(np.float32)
    w = rng.standard_normal((1, 256)).astype(np.float32)  # 2 KiB of inputs, 256 KiB of output: not in a 64 KiB slot
    with Client(worker.name, timeout_s=10) as c:
        asked = _count_questions(c)
        np.testing.assert_allclose(c.call("gemm", x=x, w=w)["out"], x @ w, rtol=1e-5)
        assert len(asked) == 1
        # the guess (the header's GUESS flag), refused before anything ran: counted apart from failures
        assert _answered(worker, "gemm", "guess_too_small") == 1
        assert _answered(worker, "gemm", "RequestTooLargeError") == 0
        assert _answered(worker, "gemm", "ok") == 1
        np.testing.assert_allclose(c.call("gemm", x=2 * x, w=w)["out"], 2 * x @ w, rtol=1e-5)
        assert len(asked) == 1 and _answered(worker, "gemm", "guess_too_small") == 1
        # the same room given by the caller (out_nbytes=, no GUESS flag) is a failure, counted and logged as one
        with pytest.raises(RequestTooLargeError) as e:
            c.call("gemm", x=x, w=w, out_nbytes=x.nbytes + w.nbytes)
        assert e.value.field == "outputs"
        assert _answered(worker, "gemm", "RequestTooLargeError") == 1
        assert _answered(worker, "gemm", "guess_too_small") == 1
        # a request too large for every slot is still refused as such (by the client, which knows the slots)
        big = np.ones((4096, 1), np.float32)
        with pytest.raises(RequestTooLargeError):
            c.call("gemm", x=big, w=np.ones((1, 8192), np.float32))
        np.testing.assert_allclose(c.call("gemm", x=x, w=w)["out"], x @ w, rtol=1e-5)  # and the client goes on
    assert worker.stop() == 0
    failed = [ln for ln in worker.stderr.splitlines() if "request failed" in ln]
    assert len(failed) == 1 and "RequestTooLargeError" in failed[0] and "field outputs" in failed[0], failed


def test_a_refused_first_call_gets_the_workers_error_and_asks_nothing(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        asked = _count_questions(c)
        with pytest.raises(KernelError) as e:
            c.call("vector_add", x=np.ones(4, np.float32), y=np.ones(5, np.float32))
        assert e.value.field == "shape" and e.value.op == "vector_add"
        assert asked == [] and not any(k[0] == "vector_add" for k in c._plans)
        x = np.arange(4, dtype=np.float32)
        np.testing.assert_array_equal(c.call("vector_add", x=x, y=x)["out"], 2 * x)
        assert asked == []


def test_submit_sends_small_new_signatures_without_asking_and_again_when_they_did_not_fit(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    # submit() guesses like call() for small inputs: futures watched (as_completed: the receiver thread finishes
    # them) and unwatched (result() in this thread), some whose outputs fit and some not (refused once, asked, sent
    # again from a thread of their own); each gets its own right answer although the caller changed its arrays
    # after submit() returned (what is sent again is a copy); large inputs ask first, as before
    from concurrent.futures import as_completed

    worker = spawn_worker("--metrics-port", "0")
    rng = np.random.default_rng(44)
    with Client(worker.name, timeout_s=10) as c:
        asked = _count_questions(c)
        x = np.arange(8, dtype=np.float32)
        np.testing.assert_array_equal(c.submit("scale", x=x, a=2.0, b=0.0).result()["out"], 2 * x)
        assert asked == []
        buf = rng.standard_normal((256, 1)).astype(np.float32)
        w = rng.standard_normal((1, 256)).astype(np.float32)  # 256 KiB of output from 2 KiB of inputs
        want = buf @ w
        fut = c.submit("gemm", x=buf, w=w)
        buf[:] = 0  # the caller's buffer, reused once submit() returned
        np.testing.assert_allclose(fut.result()["out"], want, rtol=1e-5)
        assert len(asked) == 1 and _answered(worker, "gemm", "guess_too_small") == 1
        futs, wants = {}, {}
        for n in range(1, 9):  # new signatures, watched: outputs that fit (vector_add) and not (gemm)
            v = rng.standard_normal((4 * n, 1)).astype(np.float32)
            u = rng.standard_normal((1, 64 * n)).astype(np.float32)
            futs[c.submit("gemm", x=v, w=u)] = ("gemm", n)
            wants[("gemm", n)] = v @ u
            futs[c.submit("vector_add", x=v, y=v)] = ("add", n)
            wants[("add", n)] = 2 * v
        for f in as_completed(futs, timeout=30):
            np.testing.assert_allclose(f.result()["out"], wants[futs[f]], rtol=1e-5)
        assert _answered(worker, "vector_add", "guess_too_small") == 0
        before = len(asked)
        big = np.ones(1 << 15, np.float32)  # 128 KiB of inputs: asked first
        np.testing.assert_array_equal(c.submit("vector_add", x=big, y=big).result()["out"], 2.0)
        assert len(asked) == before + 1
        assert _answered(worker, "vector_add", "guess_too_small") == 0
    assert worker.stop() == 0


def test_async_client_sends_new_signatures_without_asking_and_again_when_they_did_not_fit(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    # AsyncClient's loop sends a refused first request again (asking first), so it guesses as call() does; a gather
    # of new signatures, some whose outputs fit and some not, each gets its own right answer
    worker = spawn_worker("--metrics-port", "0")
    rng = np.random.default_rng(43)
    x = rng.standard_normal(16).astype(np.float32)
    tall = rng.standard_normal((256, 1)).astype(np.float32)
    wide = rng.standard_normal((1, 256)).astype(np.float32)

    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=10) as ac:
            c = ac.client
            asked = _count_questions(c)
            for i in range(5):
                np.testing.assert_allclose((await ac.call("scale", x=x, a=float(i) + 0.5, b=0.0))["out"],
                                           (i + 0.5) * x, rtol=1e-6)
            assert asked == []
            plans = [p for k, p in c._plans.items() if k[0] == "scale"]
            assert len(plans) == 5 and all(p.learn is None for p in plans)
            np.testing.assert_allclose((await ac.call("gemm", x=tall, w=wide))["out"], tall @ wide, rtol=1e-5)
            # refused once, asked, sent again (the loop's request reads the reply through a second ask: one question)
            assert len({repr(q) for q in asked}) == 1
            outs = await asyncio.gather(
                ac.call("gemm", x=2 * tall, w=wide),  # (known now: no question, no refusal)
                ac.call("gemm", x=tall[:128], w=wide),  # new, 128 KiB out: refused, asked, sent again
                *(ac.call("scale", x=x, a=float(i) + 0.25, b=1.0) for i in range(3)))
            np.testing.assert_allclose(outs[0]["out"], 2 * tall @ wide, rtol=1e-5)
            np.testing.assert_allclose(outs[1]["out"], tall[:128] @ wide, rtol=1e-5)
            for i, o in enumerate(outs[2:]):
                np.testing.assert_allclose(o["out"], (i + 0.25) * x + 1, rtol=1e-6)
            assert len({repr(q) for q in asked}) == 2

    asyncio.run(main())
    assert _answered(worker, "gemm", "guess_too_small") == 2  # the two refused guesses, not counted as failures
    assert _answered(worker, "gemm", "RequestTooLargeError") == 0
    assert _answered(worker, "gemm", "ok") == 3


def test_an_async_request_leaves_no_cycle_holding_its_inputs(worker: WorkerProc) -> None:
    # the answer of an AsyncClient request knows the request's arguments (to send it again when a guess did not fit);
    # they must not sit in a reference cycle, which would keep the input arrays until a garbage collection
    async def main() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=10) as ac:
            await ac.call("scale", x=np.ones(8), a=1.0, b=0.0)
            gc.collect()
            gc.disable()
            try:
                for a in (1.0, 2.5):  # a planned signature, then a new one (sent without asking)
                    x = np.arange(8.0)
                    ref = weakref.ref(x)
                    np.testing.assert_array_equal((await ac.call("scale", x=x, a=a, b=0.0))["out"], a * x)
                    del x
                    assert ref() is None
            finally:
                gc.enable()

    asyncio.run(main())


@pytest.mark.parametrize("lane", [None, "block"])
def test_a_refused_guess_through_a_lane_or_handing_out_views_is_sent_again(worker: WorkerProc, lane: str | None) -> None:
    rng = np.random.default_rng(44)
    x = rng.standard_normal((128, 1)).astype(np.float32)
    w = rng.standard_normal((1, 256)).astype(np.float32)  # 128 KiB of output: not in a 64 KiB slot
    with Client(worker.name, timeout_s=10, lane=lane) as c:
        asked = _count_questions(c)
        out = c.call("gemm", x=x, w=w, copy=False)["out"]  # views of the slot
        np.testing.assert_allclose(out, x @ w, rtol=1e-5)
        del out
        assert len(asked) == 1
        v = rng.standard_normal(64).astype(np.float32)
        got = c.call("scale", x=v, a=3.0, b=0.0, copy=False)["out"]  # a guess that fits, answered as views
        np.testing.assert_allclose(got, 3 * v, rtol=1e-6)
        del got
        assert len(asked) == 1 and any(k[0] == "scale" for k in c._plans)
        np.testing.assert_allclose(c.call("scale", x=v, a=3.0, b=0.0)["out"], 3 * v, rtol=1e-6)


def test_a_guess_larger_than_every_slot_is_cut_to_the_largest(spawn_worker: Callable[..., WorkerProc]) -> None:
    # 2 x 1.2 MB of inputs and room as large again would not fit a 4 MiB slot, but the output (1.2 MB) does: the
    # guess is the rest of the largest slot, and the call is served without a question
    worker = spawn_worker(slots="64K:8,1M:4,4M:2", lease="2,1,0")
    a = np.random.default_rng(44).standard_normal(300_000).astype(np.float32)
    with Client(worker.name, timeout_s=10) as c:
        asked = _count_questions(c)
        np.testing.assert_array_equal(c.call("vector_add", x=a, y=a)["out"], a + a)
        assert asked == []
        # an output that does not fit the rest of the largest slot: refused once, asked, and still too large
        w = np.ones((1, 1200), np.float32)
        with pytest.raises(RequestTooLargeError):
            c.call("gemm", x=np.ones((1200, 1), np.float32), w=w)  # 5.76 MB out
        np.testing.assert_array_equal(c.call("vector_add", x=a, y=a)["out"], a + a)
