"""``shmrpc bench async`` and ``shmrpc bench threads``: the client's concurrency, measured.

* ``async``: :class:`~shmrpc.client.AsyncClient` next to ``zmq.asyncio`` (DEALER to
  the zmq peer's ROUTER echo): one await at a time (round trip percentiles),
  then ``--in-flight`` requests at once (calls/s) while a ticker task measures the
  event loop's lag (how late a 1 ms sleep wakes); the blocking ``Client.call`` is
  the reference line. ``--lanes``: both again through a blocking lane.
* ``threads``: N threads calling through one shared ``Client`` vs N threads with a
  ``Client`` each (calls/s over ``--duration-s``), and the ratio.

Both start their own worker (``--name`` uses a running one) and print a table; the
JSON document has the date, command, machine facts and every point.
"""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from contextlib import ExitStack
from typing import Any

import numpy as np

from ._shm import WorkerProcess, plan_slots
from ._transport import TransportUnavailable

__all__ = ["run_async", "run_threads", "async_table", "threads_table"]

_ID = struct.Struct("<I")


def _percentiles_us(samples_s: list[float]) -> dict[str, float]:
    a = np.asarray(samples_s) * 1e6
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max())}


async def _ticker(stop: asyncio.Event, lags: list[float], period_s: float = 0.001) -> None:
    """How late a ``period_s`` sleep wakes: the loop's lag while the load runs."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(period_s)
        lags.append(max(0.0, time.perf_counter() - t0 - period_s))


async def _loaded(call: Any, in_flight: int, total: int) -> dict[str, Any]:
    """``in_flight`` tasks each awaiting one call after another until ``total`` calls are done (so
    ``in_flight`` requests stay in flight), timed from when all of them have started; the ticker runs meanwhile.
    The calls counted are those answered after that start (those in flight at it included): with ``total`` below
    ``in_flight``, ``total`` (it counted ``in_flight`` calls that were never made).

    Raises:
        ValueError: ``in_flight`` or ``total`` is below 1 (no task would start the clock: it waited forever).
    """
    if in_flight < 1 or total < 1:
        raise ValueError(f"in_flight and total must be >= 1, got {in_flight} and {total}")
    in_flight = min(in_flight, total)  # the tasks beyond would have no call to make
    stop, lags = asyncio.Event(), []  # type: ignore[var-annotated]
    left = [total]
    answered = [0]
    started = asyncio.Event()
    running = [0]

    async def worker() -> None:
        running[0] += 1
        if running[0] == in_flight:
            started.set()
        while left[0] > 0:
            left[0] -= 1
            await call()
            answered[0] += 1

    tasks = [asyncio.ensure_future(worker()) for _ in range(in_flight)]
    await started.wait()
    tick = asyncio.ensure_future(_ticker(stop, lags))
    t0 = time.perf_counter()
    answered0 = answered[0]
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    stop.set()
    await tick
    calls = total - answered0
    return {"calls": calls, "elapsed_s": elapsed, "calls_per_s": calls / elapsed,
            "loop_lag_us": _percentiles_us(lags or [0.0]), "in_flight": in_flight}


async def _shmrpc_async(name: str, nbytes: int, iters: int, in_flight: int, total: int,
                        route_batch: int = 0, lane: str | None = None) -> dict[str, Any]:
    from shmrpc.client import AsyncClient

    x = np.zeros(nbytes, np.uint8)
    async with await AsyncClient.connect(name, timeout_s=120.0, connect_timeout_s=20.0, lane=lane) as c:
        if route_batch:
            c.route_batch = route_batch
        for _ in range(50):
            await c.call("echo", x=x)
        rtts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            await c.call("echo", x=x)
            rtts.append(time.perf_counter() - t0)

        async def call() -> None:
            await c.call("echo", x=x)

        loaded = await _loaded(call, in_flight, total)
    return {"transport": "shmrpc-async" + ("-lane" if lane else ""), "nbytes": nbytes, "rtt_us": _percentiles_us(rtts),
            **loaded}


async def _zmq_async(address: str, nbytes: int, iters: int, in_flight: int, total: int) -> dict[str, Any]:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{address}")
    body = bytes(max(0, nbytes - _ID.size))
    waiting: dict[int, asyncio.Future[bytes]] = {}
    loop = asyncio.get_running_loop()

    async def reader() -> None:
        while True:
            frame = await sock.recv()
            fut = waiting.pop(_ID.unpack_from(frame)[0], None)
            if fut is not None and not fut.done():
                fut.set_result(frame)

    next_id = iter(range(1, 1 << 31))

    async def call() -> bytes:
        rid = next(next_id)
        fut: asyncio.Future[bytes] = loop.create_future()
        waiting[rid] = fut
        await sock.send(_ID.pack(rid) + body)
        return await fut

    task = asyncio.ensure_future(reader())
    try:
        for _ in range(50):
            await call()
        rtts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            await call()
            rtts.append(time.perf_counter() - t0)

        loaded = await _loaded(call, in_flight, total)
    finally:
        task.cancel()
        sock.close()
        ctx.term()
    return {"transport": "zmq.asyncio", "nbytes": nbytes, "rtt_us": _percentiles_us(rtts), **loaded}


def _blocking(name: str, nbytes: int, iters: int, lane: str | None = None) -> dict[str, Any]:
    from shmrpc.client import Client

    x = np.zeros(nbytes, np.uint8)
    with Client(name, timeout_s=120.0, connect_timeout_s=20.0, lane=lane) as c:
        for _ in range(50):
            c.call("echo", x=x)
        rtts = []
        for _ in range(iters):
            t0 = time.perf_counter()
            c.call("echo", x=x)
            rtts.append(time.perf_counter() - t0)
    return {"transport": "shmrpc-call" + ("-lane" if lane else ""), "nbytes": nbytes, "rtt_us": _percentiles_us(rtts)}


def run_async(sizes: list[int], iters: int, in_flight: int, total: int, name: str | None = None,
              backend: str = "numpy", peers: bool = True, lanes: bool = False) -> dict[str, Any]:
    """The ``async`` mode's document (results: one row per transport and size). ``lanes``: also the blocking
    ``Client.call`` and ``AsyncClient`` through a blocking lane (``shmrpc-call-lane``, ``shmrpc-async-lane``: a lone
    await rides the lane, requests in flight together go over ZeroMQ)."""
    from ._peers import start_peer_server

    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    with ExitStack() as stack:
        worker_facts: dict[str, Any] = {"name": name, "started_by_bench": False}
        if name is None:
            plan = plan_slots(sizes, min(in_flight, 1024), 1)
            w = stack.enter_context(WorkerProcess(plan, backend))
            w.wait_ready()
            name = w.name
            worker_facts = {"name": name, "started_by_bench": True, "slots": plan.slots, "lease": plan.lease}
        zmq_address = None
        if peers:
            try:
                zmq_address = stack.enter_context(start_peer_server("zmq")).address
            except TransportUnavailable as e:
                skipped["zmq.asyncio"] = str(e)
        for n in sizes:
            rows.append(_blocking(name, n, iters))
            rows.append(asyncio.run(_shmrpc_async(name, n, iters, in_flight, total)))
            if lanes:
                rows.append(_blocking(name, n, iters, "block"))
                rows.append(asyncio.run(_shmrpc_async(name, n, iters, in_flight, total, lane="block")))
            if zmq_address is not None:
                rows.append(asyncio.run(_zmq_async(zmq_address, n, iters, in_flight, total)))
    return {"mode": "async", "worker": worker_facts, "skipped": skipped, "results": rows,
            "config": {"sizes": sizes, "iters": iters, "in_flight": in_flight, "total": total, "lanes": lanes}}


def _hammer(clients: list[Any], n_threads: int, duration_s: float, x: np.ndarray) -> float:
    """Calls/s of ``n_threads`` threads, thread i calling through ``clients[i % len(clients)]``."""
    start, stop = threading.Barrier(n_threads + 1), threading.Event()
    counts = [0] * n_threads

    def run(i: int) -> None:
        c = clients[i % len(clients)]
        try:
            start.wait()
        except threading.BrokenBarrierError:  # interrupted before the start
            return
        k = 0
        while not stop.is_set():
            c.call("echo", x=x)
            k += 1
        counts[i] = k

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    try:
        start.wait()
        t0 = time.perf_counter()
        time.sleep(duration_s)
    finally:  # interrupted too: the threads stop calling before their clients and the worker are closed
        start.abort()
        stop.set()
        for t in threads:
            t.join()
    return sum(counts) / (time.perf_counter() - t0)


def run_threads(threads: list[int], nbytes: int, duration_s: float, name: str | None = None,
                backend: str = "numpy") -> dict[str, Any]:
    """The ``threads`` mode's document: one shared Client vs a Client per thread, per thread count."""
    from shmrpc.client import Client

    rows = []
    x = np.zeros(nbytes, np.uint8)
    with ExitStack() as stack:
        worker_facts: dict[str, Any] = {"name": name, "started_by_bench": False}
        if name is None:
            plan = plan_slots([nbytes], 8, max(threads) + 1)
            w = stack.enter_context(WorkerProcess(plan, backend))
            w.wait_ready()
            name = w.name
            worker_facts = {"name": name, "started_by_bench": True, "slots": plan.slots, "lease": plan.lease}
        for n in threads:
            with Client(name, timeout_s=120.0, connect_timeout_s=20.0) as shared:
                _hammer([shared], 1, 0.2, x)  # warm
                one = _hammer([shared], n, duration_s, x)
            own = [stack.enter_context(Client(name, timeout_s=120.0, connect_timeout_s=20.0)) for _ in range(n)]
            _hammer(own, n, 0.2, x)
            each = _hammer(own, n, duration_s, x)
            for c in own:
                c.close()
            rows.append({"threads": n, "nbytes": nbytes, "shared_client_calls_per_s": one,
                         "client_per_thread_calls_per_s": each, "ratio": one / each})
    return {"mode": "threads", "worker": worker_facts, "results": rows,
            "config": {"threads": threads, "nbytes": nbytes, "duration_s": duration_s}}


def async_table(doc: dict[str, Any]) -> str:
    """The async mode's table."""
    w = max([6, *(len(str(r["nbytes"])) for r in doc["results"])])
    head = (f"{'size':>{w}}  {'transport':<17} {'rtt p50 µs':>11} {'rtt p99 µs':>11} {'calls/s':>10} "
            f"{'in flight':>9} {'loop lag p99 µs':>16} {'lag max µs':>11}")
    lines = [head, "-" * len(head)]
    def num(v: Any, width: int, digits: int) -> str:  # "-" for a figure the row has no phase for
        return f"{v:>{width}.{digits}f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"

    for r in doc["results"]:
        lag = r.get("loop_lag_us", {})
        lines.append(f"{r['nbytes']:>{w}}  {r['transport']:<17} {r['rtt_us']['p50']:>11.1f} {r['rtt_us']['p99']:>11.1f} "
                     f"{num(r.get('calls_per_s'), 10, 0)} {r.get('in_flight', '-'):>9} "
                     f"{num(lag.get('p99'), 16, 1)} {num(lag.get('max'), 11, 1)}")
    return "\n".join(lines)


def threads_table(doc: dict[str, Any]) -> str:
    """The threads mode's table."""
    w = max([6, *(len(str(r["nbytes"])) for r in doc["results"])])
    head = f"{'threads':>7} {'size':>{w}} {'one shared Client':>18} {'a Client each':>14} {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for r in doc["results"]:
        lines.append(f"{r['threads']:>7} {r['nbytes']:>{w}} {r['shared_client_calls_per_s']:>16.0f}/s "
                     f"{r['client_per_thread_calls_per_s']:>12.0f}/s {r['ratio']:>6.2f}")
    return "\n".join(lines)
