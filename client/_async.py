"""AsyncClient: the Client's calls as coroutines, on the running event loop, never blocking it.

The event loop receives the answers itself: readers on the ZeroMQ socket's fd,
the connection's wake eventfd and the worker's pidfd route each frame through the
Client's in-flight table (:mod:`._inflight`) the moment it arrives, which finishes
the request's future on the loop thread (no thread hand-off); a timer every
:data:`_EXPIRE_S` fails the requests past their deadline with ``Timeout``. What
the loop does per call is bounded and short: copy the inputs into a free slot of
the client's own, ring the worker, and later read the answer. A request that finds
none of the client's slots free while one that fits is in flight waits on the loop,
in order, and goes out as soon as an answer frees one (:meth:`AsyncClient._drain`).
A request that needs the worker's reply to a question first (a new signature's output
sizes, a resident tensor's spec) sends the question from the loop and waits there for
the reply, which the loop routes like an answer (:meth:`AsyncClient._answered`).
Whatever may wait (connecting, an ACQUIRE for a slot none of the client's own can
give, closing) runs in the loop's default executor.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import numpy as np

from shmrpc.schema.errors import BusyError, ClientClosedError, RequestError, Timeout, WorkerGoneError

from ._callplan import outputs_did_not_fit
from ._calls import GUESS_ANY, _NoSlot
from ._client import Client
from ._lane import ClientLane
from ._loan import Loan, _CallReply, _Reply
from ._pipeline import Pipeline

__all__ = ["AsyncClient", "AsyncLoan"]

_EXPIRE_S = 0.02  # how often the loop looks for requests past their deadline
# a lone request through the lane, rung while the worker polls the lanes (it lingers), is polled for this long on the
# loop's thread before the loop waits for the lane's eventfd
_LANE_POLL_S = 30e-6
_perf_counter = time.perf_counter
_Waiting = tuple["asyncio.Future[Any]", float, tuple[Any, ...]]  # a request not sent yet: future, deadline, arguments
_ROUTE_BATCH = 2  # answers routed per turn of the loop: each wakes a task, so a turn stays short under load (2: lag p50 0.53 ms, p99 0.81 ms with 1 000 in flight on the GPU host, ~10 % fewer calls/s than 4; bench/results/bench-async-gpuhost-loop-ab-2026-11-30-e346be2.json)


class AsyncClient:
    """A connection to a shmrpc worker for asyncio code; same arguments and errors as :class:`Client`.

    Create it with ``await AsyncClient.connect(name, ...)`` (the handshake runs off the loop) and
    use it as an async context manager, or end it with ``await c.aclose()`` (it has no ``close()``). Every
    method that talks to the worker is a coroutine or returns an awaitable; none blocks the loop.

    Raises:
        The same errors as :class:`Client`, from the awaited call: ``Timeout`` when ``timeout_s``
        passes, ``WorkerGoneError`` when the worker dies, ``ForkedClientError`` in a forked child,
        ``InvalidRequestError`` / ``KernelError`` for a bad request.

    Example::

        async with await AsyncClient.connect("demo") as c:
            out = (await c.call("scale", x=np.arange(4.0), a=2.0, b=1.0))["out"]
            outs = await asyncio.gather(*(c.submit("vector_add", x=a, y=b) for a, b in pairs))
    """

    def __init__(self, client: Client) -> None:
        self.client = client  # the blocking Client underneath (same connection)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick: asyncio.TimerHandle | None = None
        self._watched: list[int] = []
        self._pump_soon: asyncio.Handle | None = None
        self._loop_thread = 0  # the ident of the thread running self._loop
        self.route_batch = _ROUTE_BATCH
        self._lane_reply: _LoopReply | None = None  # the loop's request in the lane, whose answer the loop reads
        self._lane_misses = 0  # the loop's polls of the lane in a row that found no answer (see _watch_lane)
        self._lane_skip = 0  # lone lane requests left to send without a poll
        # requests waiting on the loop for a slot of the client's own, in order: (future, deadline, _submit's arguments)
        self._queued: deque[_Waiting] = deque()
        self._answer_waits: dict[int, list[_Waiting]] = {}  # requests waiting for the reply to the question of this id
        self._draining = False

    def _on_loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, watching this client's fds (attached on first use, again on a new loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            if self._tick is None:  # a request follows: look for deadlines while it is in flight
                self._tick = loop.call_later(_EXPIRE_S, self._expire)
            return loop
        self.client._check()
        old = self._loop
        if old is not None and old.is_running() and not old.is_closed():
            # another thread's loop, still running: moving the client would take its requests from under it (they
            # failed as closed, or were never answered)
            raise RuntimeError("this AsyncClient serves an event loop still running in another thread: use one "
                               "AsyncClient per event loop (AsyncClient.connect in each)")
        self._detach()
        sock_fd, wake_fd, pidfd = self.client._t.watch_fds
        loop.add_reader(sock_fd, self._pump)
        loop.add_reader(wake_fd, self._woken)
        self._watched = [sock_fd, wake_fd]
        if pidfd is not None:
            loop.add_reader(pidfd, self._worker_exited)
            self._watched.append(pidfd)
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self.client._t.watched = True
        if self.client._tracing is None:  # (a traced call is sent from the executor when it must ask: it waits there)
            self.client.on_answer = self._on_answer
        self._tick = loop.call_later(_EXPIRE_S, self._expire)
        self._pump()  # anything that came before the readers did
        return loop

    def _pump(self) -> None:
        if self._pump_soon is not None:
            return  # a pump is already due this turn or the next
        self._pump_later()

    def _woken(self) -> None:
        """The wake eventfd: another thread's send saw an answer queued (``Connection.send``). Read it back (it stays
        readable until then) and pump."""
        if self._pump_soon is not None:
            self.client._t.read_wake()
            return
        self._pump_later(True)

    def _pump_later(self, woken: bool = False) -> None:
        self._pump_soon = None
        if self.client._inflight.pump_now(self.route_batch, woken) and self._loop is not None:
            # more queued: route it on the next turn, after the tasks just woken
            self._pump_soon = self._loop.call_soon(self._pump_later)

    def _watch_lane(self, lane: ClientLane, reply: _LoopReply) -> None:
        """``reply``'s request rang the lane (nothing else was in flight; the ring asked the worker to write the lane's
        eventfd when it answers): the loop reads that eventfd until the answer came. Only then: a blocking wait on
        the lane polls the same eventfd edge-triggered, and a read here could take its wake-up."""
        loop = self._loop
        if loop is None:
            return
        if threading.get_ident() != self._loop_thread:  # sent from the executor (it borrowed a slot; or traced)
            loop.call_soon_threadsafe(self._watch_lane, lane, reply)  # (the answer stays in the page meanwhile)
            return
        self._lane_reply = reply
        if not lane.slept:
            # the ring found the worker polling the lanes (it lingers): poll the page for a bounded time, so that a
            # quick answer finishes the call at the loop's next turn (no wait in epoll, no wake-up of its thread).
            # Not at once: a future done when awaited does not yield, so a task calling in a loop would hold the
            # loop for as long as the answers came within the poll. After n polls in a row in vain, the next
            # 2^n - 1 such requests are not polled (n up to 6).
            if self._lane_skip:
                self._lane_skip -= 1
            else:
                if lane.poll_until(_perf_counter() + _LANE_POLL_S):
                    self._lane_misses = 0
                    loop.call_soon(self._lane_polled, lane, reply)
                    return
                self._lane_misses = min(self._lane_misses + 1, 6)
                self._lane_skip = (1 << self._lane_misses) - 1
        if lane.fd not in self._watched:
            loop.add_reader(lane.fd, self._lane_ready)
            self._watched.append(lane.fd)

    def _lane_polled(self, lane: ClientLane, reply: _LoopReply) -> None:
        if self._lane_reply is reply:  # (not detached meanwhile)
            self._lane_done(lane, reply)

    def _lane_ready(self) -> None:
        lane, reply = self.client._t.lane, self._lane_reply
        if lane is None or reply is None or lane.busy != reply._rid:  # nothing of ours there (closed, detached)
            self._unwatch_lane(lane, False)
            return
        try:
            os.eventfd_read(lane.fd)
        except OSError:
            pass
        self._lane_done(lane, reply)

    def _lane_done(self, lane: ClientLane, reply: _LoopReply) -> None:
        """Take the answer of ``reply``'s request from the lane's page, if it came, and route it."""
        try:
            done = lane.answer()
        except RequestError as e:  # the page holds no DONE of that request (it is shared: never trusted)
            self._unwatch_lane(lane, True)
            _settle_future(reply._afut, False, e)
            return
        if done is None:
            return  # woken ahead of the answer (the early wake, a PULSE): its DONE writes the eventfd again
        self._unwatch_lane(lane, True)
        self.client._inflight.complete(*done)

    def _unwatch_lane(self, lane: ClientLane | None, ours: bool) -> None:
        """Stop reading the lane's eventfd; ``ours``: the loop's request left the lane (a later ring may use it)."""
        self._lane_reply = None
        if lane is None:
            return
        if ours:
            lane.waiting = False
        if lane.fd in self._watched:
            self._watched.remove(lane.fd)
            if self._loop is not None:
                self._loop.remove_reader(lane.fd)

    def _worker_exited(self) -> None:
        loop = self._loop
        pidfd = self.client._t.watch_fds[2]
        if loop is not None and pidfd is not None:
            loop.remove_reader(pidfd)  # readable for good: watched once
            self._watched.remove(pidfd)
        self.client._inflight.worker_exited()
        self._drain()  # (fails the requests waiting for a slot)

    def _expire(self) -> None:
        """Fail the requests past their deadline, in flight or waiting (for a slot, for the worker's reply to a
        question); look again in :data:`_EXPIRE_S` while any is (an idle client's loop is not woken: the next
        request arms the look again, :meth:`_on_loop`)."""
        self._tick = None
        inflight = self.client._inflight
        inflight.expire()
        now = time.monotonic()
        if self._queued:
            for w in [w for w in self._queued if w[1] <= now or w[0].done()]:
                self._queued.remove(w)
                _settle_future(w[0], False, self._late(w[2], True))
            self._drain()  # (a slot another thread's answer freed, which no answer of the loop's followed)
        for rid, waits in list(self._answer_waits.items()):
            for w in [w for w in waits if w[1] <= now or w[0].done()]:
                waits.remove(w)
                _settle_future(w[0], False, self._late(w[2], False))
            if not waits:  # nobody waits for that reply now
                del self._answer_waits[rid]
                self.client.forget_question(rid)
        if self._tick is None and self._loop is not None and (len(inflight) or self._queued or self._answer_waits):
            # (a request sent above may have armed the look already: one chain of looks, never two)
            self._tick = self._loop.call_later(_EXPIRE_S, self._expire)

    def _slot_comes(self, need: int) -> bool:
        """Whether a request of ours in flight holds a slot of at least ``need`` bytes (its answer frees it)."""
        return need > 0 and any(s.nbytes >= need for s in self.client._inflight.slots())

    def _late(self, args: tuple[Any, ...], slot: bool) -> Timeout | BusyError:
        op = args[0] if isinstance(args[0], str) else "the pipeline"
        if slot:  # not sent: a slot wait that runs out is BusyError, as in Client (docs/reliability.md, Backpressure)
            return BusyError(f"no slot for {op!r} became free in time", field="nbytes")
        return Timeout(f"no answer from worker {self.client.name!r} in time (a question before {op!r})")

    def _send(self, w: _Waiting) -> bool:
        """Send request ``w`` from the loop, never waiting. False: no slot of ours is free for it but an answer will
        free one (the caller keeps it waiting for a slot). True: it went out; or waits for the worker's reply to a
        question it needs first (the question sent); or went to the executor (no answer of ours frees a slot for
        it); or failed, its future holding the error."""
        afut, deadline, args = w
        left = deadline - time.monotonic()
        if afut.done() or left <= 0:  # cancelled; or past its deadline
            _settle_future(afut, False, self._late(args, True))
            return True
        c = self.client
        op, out_nbytes, in_place, keep, copy, kwargs, make = args
        try:
            c._submit(op, left, out_nbytes, in_place, keep, copy, True, kwargs, make=make)
        except _NoSlot as e:
            return self._not_sent(w, e)
        except BaseException as e:  # noqa: BLE001  (its own error; the others still go out)
            _settle_future(afut, False, e)
        return True

    def _not_sent(self, w: _Waiting, e: _NoSlot) -> bool:
        """Request ``w`` could not go out from the loop (``e`` says why): it waits for its question's reply (True);
        or for a slot an answer of ours will free (False: the caller keeps it in the queue); or goes out from the
        executor, which borrows a slot (True)."""
        if e.asked:
            self._wait_answer(e.asked, w)
            return True
        if self._slot_comes(e.need):
            return False
        afut, deadline, (op, out_nbytes, in_place, keep, copy, kwargs, make) = w
        self._send_off_loop(functools.partial(self.client._submit, op, max(0.0, deadline - time.monotonic()),
                                              out_nbytes, in_place, keep, copy, False, kwargs, make=make), afut)
        return True

    def _wait_answer(self, rid: int, w: _Waiting) -> None:
        self._answer_waits.setdefault(rid, []).append(w)
        if self._tick is None and self._loop is not None:
            self._tick = self._loop.call_later(_EXPIRE_S, self._expire)

    def _on_answer(self, rid: int) -> None:
        """The reply to the loop's question ``rid`` came (called on the thread that routed it, under the in-flight
        table's lock): the loop sends the requests that waited for it."""
        loop = self._loop
        if loop is None:
            return
        if threading.get_ident() == self._loop_thread:
            loop.call_soon(self._answered, rid)
        else:
            try:
                loop.call_soon_threadsafe(self._answered, rid)
            except RuntimeError:  # (closed meanwhile)
                pass

    def _resend(self, w: _Waiting) -> None:
        """A request sent without asking the worker first (a new signature) was refused: its outputs did not fit the
        room it gave them, and nothing ran. It goes out again, asking first, as a request waiting for a slot would."""
        if self._queued or not self._send(w):
            self._queued.append(w)
        if self._queued:
            self._drain()

    def _answered(self, rid: int) -> None:
        waits = self._answer_waits.pop(rid, [])
        for w in waits:  # the first reads the reply (and caches what it says), sent if a slot is free, else queued
            # (tried even behind others waiting for a slot: queued unread, its reply was forgotten below and the
            # question asked again when its turn came, over and over while requests waited)
            if not self._send(w):
                self._queued.append(w)
        self.client.forget_question(rid)  # read, or nobody waits for it
        if self._queued:
            self._drain()

    def _drain(self) -> None:
        """Send the requests waiting for a slot (:meth:`submit`), oldest first, while free slots of ours fit them (an
        answer just freed one). The first that still finds none stays first (:meth:`_send`)."""
        if self._draining:
            return  # (an answer routed inside a send below: the loop below goes on)
        q, c = self._queued, self.client
        if c._t.gone:  # the worker exited: no slot will come free
            self._fail_waiting(lambda: WorkerGoneError(c._t.gone))
            return
        if c._closed:  # (from another thread): none of them can go out, all fail now, not one per look
            self._fail_waiting(lambda: ClientClosedError("the Client was closed before the request was sent"))
            return
        self._draining = True
        sent = False
        try:
            while q:
                if sent and not (c._kept or c._slots.maybe_free):
                    return  # every slot taken again: the next answer sends the next one (no attempt in vain)
                if not self._send(q[0]):
                    return
                q.popleft()
                sent = True
        finally:
            self._draining = False

    def _fail_waiting(self, error: Any) -> None:
        """Fail every request waiting for a slot or for the reply to a question with ``error()`` (none was sent)."""
        waits = list(self._queued)
        self._queued.clear()
        for rid, ws in list(self._answer_waits.items()):
            waits += ws
            self.client.forget_question(rid)
        self._answer_waits.clear()
        for afut, _, _ in waits:
            if not afut.get_loop().is_closed():
                _settle_future(afut, False, error())

    def _settled(self, afut: asyncio.Future[Any], ok: bool, out: Any) -> None:
        """An answer another thread routed, on the loop's thread: finish its future, send what waits for a slot."""
        _settle_future(afut, ok, out)
        if self._queued:
            self._drain()

    def _send_off_loop(self, blocking: Any, afut: asyncio.Future[Any]) -> None:
        """Run ``blocking`` (a ``_submit`` that may wait, whose answer finishes ``afut``) in the executor; its error,
        if it raises, finishes ``afut``."""
        loop = self._loop
        if loop is None:
            _settle_future(afut, False, ClientClosedError("the AsyncClient was closed"))
            return

        def sent(f: asyncio.Future[Any]) -> None:
            if f.cancelled():
                _settle_future(afut, False, ClientClosedError("the request was not sent"))
            elif (e := f.exception()) is not None:
                _settle_future(afut, False, e)
            elif self._loop is loop and self._tick is None:  # (the look for deadlines stopped while none was in flight)
                self._tick = loop.call_later(_EXPIRE_S, self._expire)

        loop.run_in_executor(None, blocking).add_done_callback(sent)

    def _detach(self) -> None:
        if self._lane_reply is not None and self.client._t.lane is not None:
            self.client._t.lane.waiting = False  # no loop reads it now: a later ring collects a late answer
        self._lane_reply = None
        self._fail_waiting(lambda: ClientClosedError("the AsyncClient was closed or moved to another loop before the "
                                                     "request was sent"))
        self.client.on_answer = None
        loop, self._loop = self._loop, None
        for h in (self._tick, self._pump_soon):
            if h is not None:
                h.cancel()
        self._tick = self._pump_soon = None
        if loop is not None and not loop.is_closed():
            for fd in self._watched:
                loop.remove_reader(fd)
        self._watched = []

    @classmethod
    async def connect(cls, name: str, **kwargs: Any) -> AsyncClient:
        """Connect to worker ``name`` (keyword arguments as :class:`Client`) without blocking the loop."""
        loop = asyncio.get_running_loop()
        client = await loop.run_in_executor(None, functools.partial(Client, name, **kwargs))
        self = cls(client)
        self._on_loop()
        return self

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """End the lease (BYE) and unmap, off the loop; idempotent."""
        self._detach()
        await asyncio.get_running_loop().run_in_executor(None, self.client.close)

    @property
    def op_table(self) -> dict[str, Any]:
        """The worker's ops (as :attr:`Client.op_table`)."""
        return self.client.op_table

    def submit(self, op: str | Pipeline, *, timeout_s: float | None = None, out_nbytes: int | None = None,
               in_place: bool = False, keep: tuple[str, ...] = (), copy: bool = True,
               **kwargs: Any) -> asyncio.Future[dict[str, np.ndarray]]:
        """Send ``op`` now and return an awaitable of its outputs (see :meth:`Client.call` for arguments).

        The inputs are copied into a slot before this returns when one of the client's own slots is free
        and no request of this client waits for one. Otherwise the request waits on the loop, behind those,
        until an answer frees a slot that fits (at most the client's lease is in flight from the loop:
        ``Client(lease=...)`` leases more), or, when no request in flight holds a slot that fits, goes out
        from the executor, which borrows one (ACQUIRE). The first request of a new signature goes out without asking
        the worker for its output sizes, with room for outputs as large as its inputs (as :meth:`Client.call`); when
        they did not fit (refused before anything ran) it is sent again, after the question, which the loop sends (a
        request that waits for a slot asks so too). A request that waits, or is sent again, reads its inputs when it
        goes out: do not change them before it is answered.
        """
        c = self.client
        loop = self._on_loop()
        if c._tracing is not None:  # the span ends in a done-callback: a CallFuture, bridged (never in the lane)
            try:
                return self._bridge(c._submit(op, timeout_s, out_nbytes, in_place, keep, copy, True, kwargs), loop)
            except _NoSlot:
                return asyncio.ensure_future(self._later(loop, functools.partial(
                    c._submit, op, timeout_s, out_nbytes, in_place, keep, copy, False, kwargs)))
        afut = loop.create_future()
        call = (op, out_nbytes, in_place, keep, copy, kwargs)
        make = self._maker(afut, call)
        args = (*call, make)
        no_slot = None
        if not self._queued:
            try:
                c._submit(op, timeout_s, out_nbytes, in_place, keep, copy, True, kwargs, make=make, guess=GUESS_ANY)
                return afut
            except _NoSlot as e:
                no_slot = e
        else:
            c._check()  # (it waits behind those: nothing else looks at the client now)
        w = (afut, time.monotonic() + (c.timeout_s if timeout_s is None else timeout_s), args)
        if no_slot is None or not self._not_sent(w, no_slot):
            self._queued.append(w)
        return afut

    def _maker(self, afut: asyncio.Future[Any], call: tuple[Any, ...]) -> Any:
        """The ``make`` of a request of :meth:`submit` (see ``Client._submit``): its answer finishes ``afut``, and
        knows ``call`` (the request's arguments but ``make``) to send it again (``_LoopCallReply``). No cycle through
        the request's arguments: they (its input arrays) go with the request, not with the next garbage collection."""

        def make(client: Client, loan: Loan, deadline: float, copy: bool, tensors: Any) -> _LoopCallReply:
            return _LoopCallReply(client, loan, deadline, copy, tensors, afut, self, call)

        return make

    def _bridge(self, fut: Future[Any], loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any]:
        """An asyncio future that finishes with ``fut``: directly when ``fut`` finishes on the loop's thread
        (the loop routes the answers itself), through ``call_soon_threadsafe`` only from another thread.

        ``asyncio.wrap_future`` would always take the thread-safe hop: a write to the loop's self-pipe and one
        more turn of the loop per answer."""
        afut = loop.create_future()
        me = self._loop_thread

        def done(f: Future[Any]) -> None:
            if threading.get_ident() == me:
                _copy_state(afut, f)
            elif not loop.is_closed():
                loop.call_soon_threadsafe(_copy_state, afut, f)

        Future.add_done_callback(fut, done)  # (the base class's: the loop routes the answers, no receiver needs waking)
        return afut

    async def _later(self, loop: asyncio.AbstractEventLoop, blocking: Any) -> dict[str, np.ndarray]:
        """Send off the loop (``blocking`` waits for a slot; with tracing), then await the future it returns, bridged."""
        fut = await loop.run_in_executor(None, blocking)
        self._on_loop()  # (the look for deadlines may have stopped while nothing was in flight yet)
        return await self._bridge(fut, loop)

    async def call(self, op: str | Pipeline, *, timeout_s: float | None = None, out_nbytes: int | None = None,
                   in_place: bool = False, keep: tuple[str, ...] = (), copy: bool = True,
                   **kwargs: Any) -> dict[str, np.ndarray]:
        """Run ``op`` on arrays and return ``{output name: array}`` (see :meth:`Client.call`)."""
        return await self.submit(op, timeout_s=timeout_s, out_nbytes=out_nbytes, in_place=in_place, keep=keep,
                                 copy=copy, **kwargs)

    def loan(self, nbytes: int | None = None, *, timeout_s: float | None = None) -> AsyncLoan:
        """A slot for the zero-copy path, as ``async with c.loan(n) as req`` (see :meth:`Client.loan`)."""
        return AsyncLoan(self, nbytes, timeout_s)

    async def put(self, name: str, array: Any, *, shared: bool = False, timeout_s: float | None = None) -> None:
        """Upload a resident tensor (see :meth:`Client.put`), off the loop."""
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.client.put, name, array, shared=shared, timeout_s=timeout_s))

    async def drop(self, name: str, *, timeout_s: float | None = None) -> None:
        """Free a resident tensor (see :meth:`Client.drop`), off the loop."""
        await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.client.drop, name, timeout_s=timeout_s))

    async def resident(self, *, timeout_s: float | None = None) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """This client's resident tensors and the shared ones (see :meth:`Client.resident`), off the loop."""
        return await asyncio.get_running_loop().run_in_executor(
            None, functools.partial(self.client.resident, timeout_s=timeout_s))


def _release_taken(taking: asyncio.Future[Loan]) -> None:
    """The loan an ``AsyncLoan.__aenter__`` cancelled meanwhile took, given back."""
    if not taking.cancelled() and taking.exception() is None:
        taking.result().release()


def _copy_state(afut: asyncio.Future[Any], f: Future[Any]) -> None:
    """Finish ``afut`` as ``f`` finished (``f`` is done; ``afut`` may have been cancelled meanwhile)."""
    e = Future.exception(f, 0)
    _settle_future(afut, e is None, Future.result(f, 0) if e is None else e)


def _settle_future(afut: asyncio.Future[Any], ok: bool, out: Any) -> None:
    """Finish ``afut`` with ``out``, a value (``ok``) or an error, unless it was cancelled meanwhile."""
    if afut.done():
        return
    if ok:
        afut.set_result(out)
    else:
        afut.set_exception(out)


class _LoopReply(_Reply):
    """An answer the event loop finishes into an asyncio future: no concurrent Future between them (its lock,
    condition and callbacks). Finished on the loop's thread
    when the loop routes the answer (it watches the socket, and the lane's eventfd while its request rides the lane:
    ``AsyncClient._watch_lane``), through ``call_soon_threadsafe`` when another thread does. The in-flight table
    hands its finisher out once (answered, expired or failed), so it needs no lock of its own."""

    def __init__(self, client: Client, loan: Loan, deadline: float, afut: asyncio.Future[Any],
                 owner: AsyncClient) -> None:
        _Reply.__init__(self, client, loan, deadline)
        self._afut, self._owner, self._on_lane = afut, owner, owner._watch_lane
        self._aloop, self._thread = afut.get_loop(), owner._loop_thread

    def _finish(self) -> None:
        self._deliver(*self._settle())  # (the slot is free from here: the next request waiting for one takes it)

    def _deliver(self, ok: bool, out: Any) -> None:
        """Finish the asyncio future with ``out`` (a value when ``ok``, else an error), on its loop."""
        if self._aloop.is_closed():
            return  # its loop is gone (the AsyncClient moved to another): nobody awaits it
        if threading.get_ident() == self._thread:
            _settle_future(self._afut, ok, out)
            if self._owner._queued:
                self._owner._drain()
        else:
            try:
                self._aloop.call_soon_threadsafe(self._owner._settled, self._afut, ok, out)
            except RuntimeError:  # closed since the look above
                pass


class _LoopCallReply(_CallReply, _LoopReply):
    """``AsyncClient.submit``'s answer: the outputs as ``CallFuture`` gives them, into an asyncio future."""

    def __init__(self, client: Client, loan: Loan, deadline: float, copy: bool, tensors: Any,
                 afut: asyncio.Future[Any], owner: AsyncClient, call: tuple[Any, ...]) -> None:
        _LoopReply.__init__(self, client, loan, deadline, afut, owner)
        self._copy, self._tensors, self._call = copy, tensors, call

    def _finish(self) -> None:
        ok, out = self._settle()
        if not ok and self._guessed is not None and outputs_did_not_fit(out) and not self._aloop.is_closed():
            # a new signature sent without asking first, whose outputs did not fit (refused before anything ran):
            # sent again from the loop, asking first, under its deadline; at the loop's next turn (not inside the
            # routing that finished it, which may be a send of the loop's own)
            w = (self._afut, self._deadline, (*self._call, self._owner._maker(self._afut, self._call)))
            try:
                if threading.get_ident() == self._thread:
                    self._aloop.call_soon(self._owner._resend, w)
                else:
                    self._aloop.call_soon_threadsafe(self._owner._resend, w)
            except RuntimeError:  # closed since the look above
                pass
            return
        self._deliver(ok, out)


class AsyncLoan:
    """``async with client.loan(nbytes) as req``: :meth:`array` as :meth:`Loan.array`, ``await req.send(op)``."""

    def __init__(self, owner: AsyncClient, nbytes: int | None, timeout_s: float | None) -> None:
        self._owner, self._nbytes, self._timeout_s = owner, nbytes, timeout_s
        self._loan: Loan | None = None

    async def __aenter__(self) -> AsyncLoan:
        c = self._owner.client
        taking = self._owner._on_loop().run_in_executor(
            None, functools.partial(c.loan, self._nbytes, timeout_s=self._timeout_s))
        try:
            self._loan = await asyncio.shield(taking)
        except asyncio.CancelledError:
            # the executor takes the slot whatever happens to this task: given back once it has (a cancelled
            # `async with` never reaches __aexit__, and the slot was lost for the client's life)
            taking.add_done_callback(_release_taken)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._loan is not None:
            self._loan.release()

    def _live(self) -> Loan:
        if self._loan is None:
            raise ClientClosedError("use the loan inside 'async with'")
        return self._loan

    @property
    def nbytes(self) -> int:
        """The slot's size."""
        return self._live().nbytes

    def array(self, name: str, shape: tuple[int, ...] | int, dtype: Any) -> np.ndarray:
        """A writable view of a new input tensor in the slot (see :meth:`Loan.array`)."""
        return self._live().array(name, shape, dtype)

    async def send(self, op: str | Pipeline, *, timeout_s: float | None = None, in_place: bool = False,
                   keep: tuple[str, ...] = (), **attrs: Any) -> dict[str, np.ndarray]:
        """Run ``op`` on this loan's tensors; outputs are views into the slot (see :meth:`Loan.send`)."""
        loan = self._live()
        c = self._owner.client
        loop = self._owner._on_loop()
        deadline = time.monotonic() + (c.timeout_s if timeout_s is None else timeout_s)
        afut = loop.create_future()
        rid = loan._post(op, attrs, in_place, keep, future=_LoopReply(c, loan, deadline, afut, self._owner))
        await afut
        return loan._response(rid)
