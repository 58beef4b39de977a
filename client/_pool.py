"""Pool: one Client per worker of a prefix (``shmrpc serve --devices``), calls spread by fewest in flight.

Membership::

    live ──call fails with WorkerGoneError / worker found dead──▶ down
      ▲                                                            │
      └──── a reconnect succeeds (tried at most every rejoin_s) ◀──┘
            (resident tensors put on every worker are uploaded again first)

A call goes to the live worker with the fewest requests in flight from this pool
(ties: the one used least recently). A request already sent to a worker that dies
fails with :class:`WorkerGoneError`; the pool does not resend it (the op may have
run): the caller decides. New calls go to the other workers at once.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np

from shmrpc.schema.errors import ConnectError, WorkerGoneError
from shmrpc.schema.naming import device_workers

from ._client import CallFuture, Client
from ._pipeline import Pipeline
from ._slot import Resident

__all__ = ["Pool"]


class _Member:
    __slots__ = ("name", "client", "pending", "calls", "last_used")

    def __init__(self, name: str) -> None:
        self.name = name
        self.client: Client | None = None
        self.pending = 0  # this pool's requests in flight on it
        self.calls = 0
        self.last_used = 0.0


class Pool:
    """Calls spread over the workers ``<prefix>-<device>`` (or the named ``workers``).

    Args:
        prefix: the supervisor's ``--name``; its workers are found by their sockets ``<prefix>-<N>``.
        workers: exact worker names instead of discovery.
        rejoin_s: how often a down (or newly appeared) worker is tried again, at most.
        **client_kwargs: passed to every :class:`Client` (``timeout_s``, ``lease``, ...).

    Resident tensors: ``put(name, array)`` uploads to every live worker (and again to a worker
    that rejoins); ``put(name, array, worker=W)`` to worker ``W`` only, and calls that refer to
    it with :class:`Resident` then go to ``W``.

    Raises:
        ConnectError: no worker of ``prefix`` could be reached.

    Example::

        with Pool("gpus") as pool:
            outs = [f.result() for f in [pool.submit("scale", x=x, a=2.0) for x in batch]]
    """

    def __init__(self, prefix: str | None = None, *, workers: list[str] | None = None, rejoin_s: float = 0.5,
                 **client_kwargs: Any) -> None:
        if (prefix is None) == (workers is None):
            raise ValueError("give a prefix or a list of workers")
        self.prefix, self.rejoin_s, self._kw = prefix, rejoin_s, client_kwargs
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._fixed = workers
        self._everywhere: dict[str, tuple[Any, bool]] = {}  # residents put on every worker: name -> (array, shared)
        self._placed: dict[str, str] = {}  # residents put on one worker: name -> worker
        self._next_try = 0.0
        self._closed = False
        self._refresh(force=True)
        if not self.live:
            raise ConnectError(f"no worker of {prefix or workers!r} could be reached: start them with "
                               f"`shmrpc serve --name {prefix or 'NAME'} --devices all`")

    # ------------------------------------------------------------ membership

    @property
    def live(self) -> list[str]:
        """Names of the workers calls go to now."""
        return [m.name for m in self._members.values() if m.client is not None]

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per worker: live, requests in flight from this pool, calls sent."""
        return {m.name: {"live": m.client is not None, "pending": m.pending, "calls": m.calls}
                for m in self._members.values()}

    def _names(self) -> list[str]:
        return list(self._fixed) if self._fixed is not None else device_workers(self.prefix or "")

    def _refresh(self, force: bool = False) -> None:
        """Connect to workers not connected (new or down), at most every ``rejoin_s``."""
        now = time.monotonic()
        if not force and now < self._next_try:
            return
        self._next_try = now + self.rejoin_s
        for name in self._names():
            m = self._members.setdefault(name, _Member(name))
            if m.client is not None:
                continue
            try:
                c = Client(name, **{"connect_timeout_s": 2.0, **self._kw})
            except (ConnectError, WorkerGoneError, OSError):
                continue
            try:
                for rname, (arr, shared) in self._everywhere.items():
                    c.put(rname, arr, shared=shared)
            except Exception:  # noqa: BLE001 - not ready after all: try again later
                c.close()
                continue
            m.client = c

    def _down(self, m: _Member) -> None:
        with self._lock:
            c, m.client = m.client, None
        if c is not None:
            c.close()

    def _pick(self, kwargs: dict[str, Any]) -> _Member:
        with self._lock:
            if self._closed:
                from shmrpc.schema.errors import ClientClosedError

                raise ClientClosedError("the Pool is closed")
            self._refresh()
            for m in list(self._members.values()):
                if m.client is not None and not m.client.worker_alive:
                    c, m.client = m.client, None
                    c.close()
            want = {self._placed[v.name] for v in kwargs.values() if isinstance(v, Resident) and v.name in self._placed}
            if len(want) > 1:
                raise ValueError(f"the call refers to resident tensors on different workers: {sorted(want)}")
            cands = [m for m in self._members.values() if m.client is not None and (not want or m.name in want)]
            if not cands:
                where = f"worker {next(iter(want))!r}" if want else f"any worker of {self.prefix or self._fixed!r}"
                raise WorkerGoneError(f"{where} is down; the pool retries it every {self.rejoin_s} s")
            m = min(cands, key=lambda m: (m.pending, m.last_used))
            m.pending += 1
            m.calls += 1
            m.last_used = time.monotonic()
            return m

    def _done(self, m: _Member, fut: Future) -> None:  # type: ignore[type-arg]
        with self._lock:
            m.pending -= 1
        if isinstance(fut.exception(0), WorkerGoneError):
            self._down(m)

    # ------------------------------------------------------------ calls

    def submit(self, op: str | Pipeline, **kwargs: Any) -> CallFuture:
        """:meth:`Client.submit` on the least busy live worker.

        Raises:
            WorkerGoneError: no worker is live (or the one holding a referenced resident tensor is down).
        """
        while True:
            m = self._pick(kwargs)
            c = m.client
            try:
                if c is None:
                    raise WorkerGoneError(f"worker {m.name!r} went down")
                fut = c.submit(op, **kwargs)
            except WorkerGoneError:
                with self._lock:
                    m.pending -= 1
                self._down(m)
                continue  # nothing was sent: another worker takes it
            except BaseException:
                with self._lock:
                    m.pending -= 1
                raise
            # (the base class's: the pool's count does not watch the future, so that submit().result() does not wake
            # the client's receiver thread; see Inflight.watch)
            Future.add_done_callback(fut, functools.partial(self._done, m))
            return fut

    def call(self, op: str | Pipeline, **kwargs: Any) -> dict[str, np.ndarray]:
        """:meth:`Client.call` on the least busy live worker (same arguments, returns and errors).

        It is that worker's client's own ``call()`` in this thread (its kept slot, the lane when the worker has one,
        no future and no receiver thread), not ``submit().result()``. A worker found down when the call is placed is
        passed over; a ``WorkerGoneError`` raised once the call went to a worker is the caller's, as for a request
        in flight (the op may have run), also when that worker died before the request itself went out.
        """
        while True:
            m = self._pick(kwargs)
            c = m.client
            try:
                if c is None:  # (taken down by another thread since the pick)
                    continue
                return c.call(op, **kwargs)
            except WorkerGoneError:
                self._down(m)
                raise
            finally:
                with self._lock:
                    m.pending -= 1

    def put(self, name: str, array: Any, *, worker: str | None = None, shared: bool = False) -> None:
        """Upload a resident tensor to every live worker (and to each that rejoins), or to ``worker`` only."""
        if worker is not None:
            m = self._members.get(worker)
            if m is None or m.client is None:
                raise WorkerGoneError(f"worker {worker!r} is not live in this pool")
            m.client.put(name, array, shared=shared)
            self._placed[f"shared/{name}" if shared else name] = worker
            return
        for m in list(self._members.values()):
            if m.client is not None:
                m.client.put(name, array, shared=shared)
        self._everywhere[name] = (np.array(array, copy=True), shared)

    def drop(self, name: str) -> None:
        """Free a resident tensor wherever this pool put it."""
        where = self._placed.pop(name, None)
        self._everywhere.pop(name, None)
        for m in list(self._members.values()):
            if m.client is not None and (where is None or m.name == where):
                m.client.drop(name)

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every worker's Client. Idempotent."""
        with self._lock:
            self._closed = True
            clients = [m.client for m in self._members.values() if m.client is not None]
            for m in self._members.values():
                m.client = None
        for c in clients:
            c.close()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
