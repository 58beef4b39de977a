"""AsyncClient: calls as coroutines on the running loop, with every failure path of the blocking Client."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pytest
from wire import slow_pipeline, wait_for_state

from shmrpc.client import (
    AsyncClient,
    Client,
    ForkedClientError,
    InvalidRequestError,
    KernelError,
    Timeout,
    WorkerGoneError,
)
from shmrpc.schema.naming import attach_path, socket_path

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
            await c.drop("bias")

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


def test_worker_gone(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker()

    async def main() -> None:
        c = await AsyncClient.connect(w.name, timeout_s=60)
        try:
            pending = c.submit(slow_pipeline(), x=np.ones(3_500_000))
            await asyncio.get_running_loop().run_in_executor(
                None, wait_for_state, w.name, lambda st: st["in_flight"] >= 1, "a request in flight")
            os.kill(w.pid, signal.SIGKILL)
            with pytest.raises(WorkerGoneError):
                await asyncio.wait_for(pending, 30)
            with pytest.raises(WorkerGoneError):
                await c.call("echo", x=np.ones(2))
        finally:
            await c.aclose()

    asyncio.run(main())
    w.proc.wait(10)
    for p in (socket_path(w.name), attach_path(w.name)):  # a SIGKILLed worker leaves its sockets
        p.unlink(missing_ok=True)


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
