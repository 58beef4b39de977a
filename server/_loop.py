"""The worker: one ZeroMQ ROUTER loop over the region, the leases, the dispatcher and the backend.

The loop thread owns the sockets and all bookkeeping. Handshakes arrive on the
attach socket (:mod:`._attach`); every later message on the ROUTER, from a DEALER
whose routing id is the session token the WELCOME gave it. Requests of little
estimated work (FLOPs and bytes from the plan, :mod:`shmrpc.kernels._cost`) run on
the loop thread itself (a thread hop costs more than the op); all others run in an
executor, which writes outputs and the response into the slot, queues the DONE
and wakes the loop through a pipe. How messages are received and a CALL is checked:
:mod:`._calls`; how requests run and are answered: :mod:`._runs`. The loop also
watches each client's pidfd, so a client that dies has its lease ended at once.

Life of a CALL on the loop thread::

    CALL(region, slot, rid, gen)
      -> leases.begin (owner, generation, not already in flight)   else DONE(0x8000|code), slot untouched
      -> header copied out and checked                              else error response in the slot
      -> descriptor copied out, parsed, validated, planned, costed (cached)  over --request-memory-limit: error
      -> run inline (little estimated work) or in the executor -> outputs written
         (a batchable plan: parked until the end of the loop's turn, then run in one batch with the turn's other
         requests of that plan, inline or as one executor task: see _batch.py; a lone one runs as above)
      -> response descriptor, then header           # NOTE: order is important here
      -> DONE(region, slot, rid, status)            # the publication point back to the client
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import resource
import select
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from shmrpc import kernels
from shmrpc.kernels import Backend
from shmrpc.kernels._backend_base import RunLaunch
from shmrpc.schema import messages as m
from shmrpc.schema.control import ErrorReply, State
from shmrpc.schema.errors import InternalError, InvalidRequestError
from shmrpc.schema.layout import format_size_approx
from shmrpc.schema.messages import NO_RESPONSE
from shmrpc.schema.naming import attach_path, endpoint, runtime_dir, socket_path
from shmrpc.schema.zmqraw import POLLIN

from . import checks
from ._attach import AttachListener, set_dumpable
from ._batch import Pending
from ._calls import Calls
from ._dispatch import Dispatcher, Launched
from ._lanes import Lanes, Linger, linger_ns
from ._lease import Leases, Slot
from ._observe import Observer
from ._poll import LoopPoll
from ._primed import PrimedSlots
from ._runs import Done, Runs
from ._sessions import Sessions
from ._shared import SharedOwners
from ._waiters import Waiters
from .config import WorkerConfig
from .lockfile import WorkerAlreadyRunning, WorkerLock
from .metrics import Metrics
from .region import Region
from .rundir import admit_to_socket, ensure_runtime_dir, remove_socket

__all__ = ["Worker", "NO_RESPONSE"]

log = logging.getLogger("shmrpc.server")

_RCVHWM = 256  # messages queued per peer before libzmq stops reading from it (with MAXMSGSIZE: 16 MiB)


def raise_fd_limit() -> None:
    """The soft RLIMIT_NOFILE up to the hard one (at most 2^20): each client costs the worker a few fds, and a HELLO
    is refused when fewer than ``FD_HEADROOM`` are left (``_sessions.fds_short``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else min(hard, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.debug("could not raise RLIMIT_NOFILE from %d to %d: %s", soft, want, e)


#: STATE is one packet on the attach socket, whose send buffer the kernel may cap near 200 KiB (net.core.wmem_max)
_STATE_MAX_NBYTES = 128 << 10


def _readable(fd: int) -> bool:
    """Whether ``fd`` has input now (a pidfd: its process exited)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


class Worker(Calls, Runs):
    """A shmrpc worker. Use :meth:`start`, then :meth:`serve_forever` (or as a context manager)."""

    def __init__(self, config: WorkerConfig, tracer_provider: Any = None) -> None:
        self.config = config
        self.regions: dict[int, Region] = {}  # index -> region; 0 is the pool
        self.backend: Backend = None  # type: ignore[assignment]  # set by start()
        self._lock: WorkerLock | None = None
        self._files_lost: str | None = None  # why the worker is not ready since its lock file was removed
        self._watch_fd = -1  # inotify on the lock file (WorkerLock.watch), until the loop takes it
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._attach: AttachListener | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._done: collections.deque[Done] = collections.deque()  # what the executor answered, for the loop
        self._pending: list[Pending] = []  # batchable requests of this turn of the loop (see _batch.py)
        # a batch or a request on the device, what answers it once it is done, whether it is a batch (_await_launched)
        self._launched: tuple[Launched | RunLaunch, Callable[[], None], bool] | None = None
        self._pulse: tuple[float, bytes, int] | None = None  # the launched request's PULSE still to send (_runs.py)
        self._max_batch = config.max_batch
        self._batch_wait_s = config.batch_wait_us / 1e6  # --batch-wait-us (Runs._holding)
        self._last_batch, self._hold_until, self._hold_for = (0, 0.0), 0.0, 0
        self._joins = False  # park batchable requests for one joint run (--max-batch > 1 and a backend that joins)
        self._singles = False  # ... and run a lone one as a batch of one (a backend that batches singles)
        self._lanes: Lanes | None = None
        self._linger = Linger(0)  # the lanes' (schema/lane.py)
        self._wake_r, self._wake_w = -1, -1
        self._poller: LoopPoll | None = None  # serve_forever's wait
        self._views: dict[tuple[int, int], memoryview] = {}  # (region, slot) -> the slot's bytes, made once
        self._primed = PrimedSlots()  # (region, slot) -> the last requests validated there, with their views
        self._express = self._primed.express  # CALL frame bytes [2:8] -> a slot armed for the express path
        self.shared = SharedOwners()
        self.sessions: Sessions  # the control plane, made by start() once the backend and leases exist
        # NOTE: a plain flag, not a threading.Event: stop() runs as a signal handler in the main thread, between two
        # bytecodes, and an Event's set() there would wait forever on a lock the interrupted code held
        self._stopping = False
        self._started = 0.0
        self.metrics = Metrics()
        self._inflight = self.metrics.inflight  # a plain number the loop bumps per request
        self._desc_nbytes = config.geometry.desc_nbytes
        self.observe = Observer(config, self.metrics, log, tracer_provider)
        self.ready = threading.Event()
        self._loop_tick = 0.0  # monotonic time of the loop's last periodic check, for /healthz

    # ------------------------------------------------------------ start / stop

    def start(self) -> None:
        """Startup checks, lock, region, backend, socket. Raises StartupError with a remedy."""
        cfg = self.config
        nbytes = cfg.geometry.region_nbytes
        if not cfg.dumpable:
            # /proc/<worker>/fd and /proc/<worker>/mem (every client's region) shut to other non-root processes
            set_dumpable(False)
        raise_fd_limit()
        # the pool and one client's own region: a worker whose first client's region cannot be made or locked would
        # say ready and refuse every client
        first = cfg.first_client_nbytes()
        what = checks.WITH_FIRST_CLIENT if first else ""
        checks.check_memory(nbytes + first, what_for=what)
        if cfg.mlock:
            checks.check_memlock(nbytes + first, what_for=what)
        checks.check_socket_paths(cfg.name, runtime_dir())
        ensure_runtime_dir(shared=bool(cfg.allow_uids))
        self._lock = WorkerLock.acquire(cfg.name, shared=bool(cfg.allow_uids))
        self._watch_fd = self._lock.watch()  # the lock file removed (a tmp cleaner): seen by the loop at once
        try:
            for cleaned in self._lock.cleaned:
                log.warning("removed %s left by a worker that died", cleaned)
            self._started = time.time()
            self.regions[0] = Region.create(cfg.name, cfg.geometry, index=0, mlock=cfg.mlock)
            self.backend = kernels.select_backend(cfg.backend, resident_limit_bytes=cfg.resident_limit_bytes)
            if cfg.register_host:
                self.backend.register_host(self.regions[0].address, self.regions[0].nbytes)
            self.backend.warmup()
            self._joins = self._max_batch > 1 and self.backend.joins_batches
            self._singles = self._joins and self.backend.batches_singles
            # Fault injection for tests only (never a real GPU reset): the next request fails as if CUDA had.
            self.backend.inject_fault = cfg.inject_fault
            self.leases = Leases([self.regions[0].geometry], cfg.lease, self._zero,
                                 max_borrowed_slots=cfg.client_max_slots, max_borrowed_bytes=cfg.client_max_bytes)
            self._waiters = Waiters(self.leases.sizes, cfg.client_max_waiters)
            self._linger = Linger(linger_ns(cfg.lane_linger_us))
            self._lanes = Lanes(cfg.spin_us * 1000, self._linger) if cfg.lanes else None
            self.sessions = Sessions(cfg, regions=self.regions, views=self._views, backend=self.backend,
                                     leases=self.leases, waiters=self._waiters, metrics=self.metrics,
                                     shared=self.shared, send=self._send, started=self._started,
                                     primed=self._primed, lanes=self._lanes)
            self.dispatch = Dispatcher(self.backend, cfg.geometry.desc_nbytes,
                                       memory_limit_nbytes=cfg.request_memory_limit_bytes,
                                       inline_max_flops=cfg.inline_max_flops, inline_max_nbytes=cfg.inline_max_nbytes)
            self._executor = ThreadPoolExecutor(cfg.threads, thread_name_prefix="shmrpc-op")
            self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            self._ctx = zmq.Context(io_threads=cfg.io_threads)
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # A peer sending more than any control message is disconnected by libzmq before it buffers the
            # message; with the receive high-water mark this bounds what one connection can make us hold.
            self._sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_MESSAGE_NBYTES)
            self._sock.setsockopt(zmq.RCVHWM, _RCVHWM)
            remove_socket(cfg.name)
            # the attach socket first: whoever sees NAME.sock can say HELLO (connections wait in its backlog)
            sessions = self.sessions
            self._attach = AttachListener(attach_path(cfg.name), shared=bool(cfg.allow_uids), admit=cfg.allow_uids,
                                          on_refused=lambda peer, why: sessions.refused(peer, "identity", why))
            old = os.umask(0o077)
            try:
                self._sock.bind(endpoint(cfg.name))
            except zmq.ZMQError as e:  # no space or inodes left under the runtime directory, a read-only file system
                path = socket_path(cfg.name)
                raise checks.StartupError(f"cannot create the socket {path}: {zmq.strerror(e.errno or 0)}; free space in (or fix) "
                                   f"{path.parent}, or point SHMRPC_RUNTIME_DIR elsewhere") from None
            finally:
                os.umask(old)
            self._poller = LoopPoll(self._sock)
            # --allow-uid: those uids (an ACL each) and no other may connect; every connection to the ZeroMQ socket
            # takes the worker a file descriptor, and libzmq aborts the process when it runs out of them
            if cfg.allow_uids and not (admit_to_socket(socket_path(cfg.name), cfg.allow_uids) and self._attach.acl):
                log.warning("the file system under %s keeps no ACLs: the worker's sockets are open to every uid "
                            "(0666); the worker refuses uids it does not admit, but their connections to %s each "
                            "take it a file descriptor until it has none left", socket_path(cfg.name).parent,
                            socket_path(cfg.name).name,
                            extra={"event": "sockets_open_to_all"})
            self.observe.start(self.backend, self.health)
        except BaseException:
            self.close()
            raise
        log.info(
            "worker %s ready: backend=%s region=%s (%s, slots %s) socket=%s",
            cfg.name, self.backend.name, self.regions[0].name, format_size_approx(self.regions[0].nbytes),
            cfg.geometry.spec(), socket_path(cfg.name),
            extra={"event": "worker_ready", "worker": cfg.name, "backend": self.backend.name},
        )
        self._loop_tick = time.monotonic()
        self.ready.set()

    def _state(self) -> bytes:
        """STATE for ``shmrpc status``: the sessions' state and the readiness ``/healthz`` reports (``health``: "ok"
        or why not, e.g. "stopping" while it drains)."""
        state = self.sessions.state()
        ready, why = self.health()
        state["health"] = "ok" if ready else why
        frame = State.from_json(state).encode()
        if len(frame) > _STATE_MAX_NBYTES:  # one packet: the clients' slot lists give way to their counts
            for c in state["clients"]:
                c["in_flight"] = sum(1 for s in c["slots"] if s[4])
                c["slots"] = len(c["slots"])
            state["truncated"] = True
            frame = State.from_json(state).encode()
        return frame

    def _take_lock_again(self) -> str | None:
        """Our lock file was removed (a tmp cleaner, say): take the name's lock again, so that no second worker of
        the name starts, and make the sockets that went with it again (connected clients keep their connections).
        Returns None when all is back, else why the worker is not ready (``/healthz``)."""
        cfg, old = self.config, self._lock
        assert old is not None and self._attach is not None and self._sock is not None
        remedy = "keep SHMRPC_RUNTIME_DIR out of tmp cleaners' reach (/run/shmrpc, as the systemd unit sets)"
        try:
            new = WorkerLock.acquire(cfg.name, shared=bool(cfg.allow_uids), clean=False)
        except (WorkerAlreadyRunning, checks.StartupError) as e:
            why = (f"its lock file {old.path} was removed and the name taken again ({e}); new clients cannot reach "
                   "this worker")
            log.error("worker %s: %s: stop it, and %s", cfg.name, why, remedy,
                      extra={"event": "runtime_files_removed", "worker": cfg.name})
            return f"{why}: stop it"
        new.set_regions(old.regions)
        self._lock = new
        old.release()  # (the removed file's fd: nothing at the path is unlinked)
        made = []
        try:
            if self._attach.gone():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._attach.path)  # (not another worker's: we hold the name's lock)
                self._attach.rebind()
                made.append(str(self._attach.path))
            path = socket_path(cfg.name)
            if not path.exists():
                old_mask = os.umask(0o077)
                try:
                    self._sock.bind(endpoint(cfg.name))  # a second listener: the first one's connections stay
                finally:
                    os.umask(old_mask)
                if cfg.allow_uids:
                    admit_to_socket(path, cfg.allow_uids)  # (as at start; its WARNING was said then)
                made.append(str(path))
        except (OSError, zmq.ZMQError, checks.StartupError) as e:
            why = f"its lock file {old.path} was removed: taken again, but its sockets could not be made again ({e})"
            log.error("worker %s: %s: restart it, and %s", cfg.name, why, remedy,
                      extra={"event": "runtime_files_removed", "worker": cfg.name})
            return f"{why}: restart it"
        log.error("worker %s: its lock file %s was removed: taken again, so no second worker of the name starts%s; %s",
                  cfg.name, old.path, f", and {', '.join(made)} made again" if made else "", remedy,
                  extra={"event": "runtime_files_removed", "worker": cfg.name})
        return None

    def _files_removed(self, poller: LoopPoll, attach: AttachListener, attach_fd: int) -> int:
        """The loop's part of :meth:`_take_lock_again`: the attach socket's new fd polled in place of the old one.
        Returns the new lock file's inotify fd (polled), or -1."""
        self._files_lost = self._take_lock_again()
        if attach.fileno() != attach_fd and not attach.paused_until:
            poller.unregister(attach_fd)
            poller.register(attach.fileno())
        watch_fd = self._lock.watch() if self._files_lost is None and self._lock is not None else -1
        if watch_fd >= 0:
            poller.register(watch_fd)
        return watch_fd

    def health(self) -> tuple[bool, str]:
        """Readiness for ``/healthz``: started, serving, loop turning, backend sound. Returns (ready, reason)."""
        if not self.ready.is_set():
            return False, "starting"
        if self._files_lost is not None:
            return False, self._files_lost
        if self._stopping:
            return False, "stopping"
        if self.dispatch.fatal:
            return False, f"backend failed: {self.dispatch.fatal}"
        if time.monotonic() - self._loop_tick > max(10.0, 20 * self.config.heartbeat_s):
            return False, "the event loop has not turned recently"
        return True, ""

    def stop(self) -> None:
        """Ask the loop to drain and exit (thread- and signal-safe: it sets a flag and writes the wake pipe)."""
        self._stopping = True
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass

    def close(self) -> None:
        """Release everything: socket, executor, backend, regions, lock. Idempotent."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._attach is not None:
            self._attach.close()
            self._attach = None
        if self._lanes is not None:
            self._lanes.close()
            self._lanes = None
        self._poller = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._files_lost is None:  # (else the files at those paths may be another worker's)
            remove_socket(self.config.name)
        sessions: Sessions | None = self.__dict__.get("sessions")  # None when start() failed early
        if sessions is not None:
            sessions.close()
        if self.backend is not None:
            try:
                self.backend.unregister_host()
                self.backend.close()
            finally:
                self.backend = None
        self._primed.clear()
        self._views.clear()
        for r in self.regions.values():
            r.close()
        self.regions.clear()
        for fd in (self._wake_r, self._wake_w, self._watch_fd):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = self._watch_fd = -1
        self.observe.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Worker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT/SIGHUP: stop accepting, answer what is in flight, clean up, exit 0. (SIGHUP has no other
        meaning here, no reload: its default action killed the worker with requests in flight and left its lock
        file and sockets behind, when its terminal closed or an operator sent it out of habit.)"""
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: self.stop())

    # ------------------------------------------------------------ the loop

    def serve_forever(self) -> None:
        """Serve until :meth:`stop`; then answer in-flight requests and return."""
        assert self._sock is not None and self._attach is not None
        sock, attach = self._sock, self._attach
        poller = self._poller
        assert poller is not None
        wake_r, attach_fd = self._wake_r, attach.fileno()
        poller.register(wake_r)
        poller.register(attach_fd)
        watch_fd, self._watch_fd = self._watch_fd, -1  # (this loop closes it)
        if watch_fd >= 0:
            poller.register(watch_fd)
        lanes = self._lanes
        doorbell = lanes.doorbell_fd if lanes is not None else -1
        if lanes is not None:
            poller.watch_lanes(lanes)
        lane_rang = {doorbell: POLLIN}  # the events of a turn whose lane request the spin found
        polled: set[int] = set()  # pidfds of clients and attach connections waiting for their HELLO
        pidfds: set[int] = set()
        waiting: set[int] = set()
        next_check = time.monotonic() + self.config.heartbeat_s
        self._loop_tick = time.monotonic()
        spin_s = self.config.spin_us / 1e6
        announced = False
        while True:
            stopping = self._stopping
            if stopping and not announced:
                announced = True
                log.info("worker %s stopping: answering %d requests in flight first (a slow one is waited for: "
                         "no bound but the service manager's)", self.config.name, self.leases.n_in_flight,
                         extra={"event": "worker_stopping", "worker": self.config.name,
                                "in_flight": self.leases.n_in_flight})
            if stopping and self.leases.n_in_flight == 0 and not self._done:
                break
            if self.sessions.by_pidfd.keys() != pidfds or attach.pending.keys() != waiting:
                # NOTE: one set for both kinds: a closed fd's number may come back as the other kind
                pidfds, waiting = set(self.sessions.by_pidfd), set(attach.pending)
                wanted = pidfds | waiting
                for fd in polled - wanted:
                    poller.unregister(fd)
                for fd in wanted - polled:
                    poller.register(fd)
                polled = wanted
            timeout_ms = 50 if stopping else self._poll_timeout_ms(next_check)
            if self._launched is not None:
                events = self._await_launched(poller, lane_rang, timeout_ms)
            elif self._hold_until:  # parked requests waiting for the rest of their batch (--batch-wait-us)
                events = self._spin(poller, lane_rang, self._hold_until)
            elif lanes is not None and lanes.soon_until_ns:
                # a lane's client said it is about to ring (the early ring: call() copying its inputs in): read the
                # lanes until a request is there or the scan's time has passed, so that the ring finds this loop
                # awake (its doorbell write comes too and is cleared by a later turn)
                left_s = (lanes.soon_until_ns - time.monotonic_ns()) / 1e9
                lanes.soon_until_ns = 0
                events = self._await_soon(poller, lane_rang, time.perf_counter() + left_s)
                if not events and not self._done:
                    events = self._wait(poller, lane_rang, spin_s, timeout_ms)
            else:
                events = self._wait(poller, lane_rang, spin_s, timeout_ms)
            # NOTE: the work after a request's answer up to the next wait is part of the next round trip when the
            # client is woken on this core (the blocking lane): the fds other than the socket and the doorbell are
            # looked at only when the turn has any
            rang_sock = sock in events
            if rang_sock:
                self._drain_socket(stopping)
            rang_lane = doorbell in events
            if rang_lane:
                assert lanes is not None
                for lane, seq, frame in lanes.scan():
                    self._on_call(lane.identity, frame, stopping, seq)
                if events is not lane_rang:
                    # NOTE: the doorbell is cleared after the scan's answers went out (a system call off their way);
                    # a request rung between the scan and the clear lost its ring to the clear, so the lanes are
                    # read once more after it (a request rung after the clear rings again)
                    lanes.clear_doorbell()
                    for lane, seq, frame in lanes.scan():
                        self._on_call(lane.identity, frame, stopping, seq)
            if self._pending and (self._launched is None or not self._launched[2]) and not self._holding(stopping):
                # the turn's batchable requests: one run per plan (see _batch.py); while a launched batch is on the
                # device they stay parked, and run as one batch once it is answered (the device and the loop overlap)
                self._run_pending()
            others = len(events) > rang_sock + rang_lane  # the wake pipe, the attach socket, pidfds
            if others and wake_r in events:  # NOTE: read before the completions are drained: one queued later rings
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
            if self._done or self.dispatch.fatal:
                self._drain_done()
            if others:
                if attach_fd in events:
                    attach.accept()
                    if attach.paused_until:  # out of fds: not polled until then (it stays readable: a spin)
                        poller.unregister(attach_fd)
                if watch_fd in events:
                    with contextlib.suppress(BlockingIOError):
                        os.read(watch_fd, 4096)
                    if self._files_lost is None and self._lock is not None and self._lock.lost():
                        poller.unregister(watch_fd)  # (it watched the removed file)
                        os.close(watch_fd)
                        watch_fd = self._files_removed(poller, attach, attach_fd)
                        attach_fd = attach.fileno()
                for fd in waiting & events.keys():
                    self._on_attach(fd, stopping)
                for fd in pidfds & events.keys():
                    client = self.sessions.by_pidfd.get(fd)
                    # NOTE: the number may be a new session's since the poll (a BYE closed the old pidfd, a HELLO
                    # opened one): the event was the old file's, so the pidfd is asked again
                    if client is not None and _readable(fd):
                        self.sessions.end_client(client, "its process exited")
            now = time.monotonic()
            if now >= next_check:
                next_check = now + self.config.heartbeat_s
                self._loop_tick = now
                self.sessions.check_clients()
                self.sessions.gauge_memory()
                if self._files_lost is None and self._lock is not None and self._lock.lost():
                    if watch_fd >= 0:
                        poller.unregister(watch_fd)
                        os.close(watch_fd)
                    watch_fd = self._files_removed(poller, attach, attach_fd)
                    attach_fd = attach.fileno()
            if len(self._waiters):
                self.sessions.expire_pending(now)
            if attach.pending:
                attach.expire(now)
            if attach.paused_until and now >= attach.paused_until:
                attach.paused_until = 0.0
                poller.register(attach_fd)
            # the turn's answers are out: its metrics are added now, off their way (metrics._RequestStats); unless a
            # lane's request is already waiting, which goes first (a later turn folds: one with no request waiting,
            # such as the one that launched a batch, whose device time it overlaps; a spin folds a few at a time while
            # no request waits; observe folds past _FOLD_AT queued, and a scrape folds before it reads)
            if lanes is None or not lanes.ready():
                self.metrics.fold()
        if watch_fd >= 0:
            poller.unregister(watch_fd)
            os.close(watch_fd)
        log.info("worker %s stopped", self.config.name, extra={"event": "worker_stopped", "worker": self.config.name})

    def _on_attach(self, fd: int, stopping: bool) -> None:
        """A pending attach connection is readable: answer its HELLO there and close it."""
        assert self._attach is not None
        got = self._attach.receive(fd)
        if got is None:
            return
        conn, frame, peer = got
        if frame is None:
            conn.close()
            return
        if frame[:1] == m.STATUS:  # `shmrpc status`: the kernel says who asks
            self._attach.reply(conn, self._state() if peer.uid in (os.geteuid(), 0) else ErrorReply(
                InvalidRequestError.code, "refused", "STATUS is answered to the worker's uid and root only",
                "uid").encode(), [])
            return
        try:
            reply, fds, welcomed = self.sessions.on_hello(frame, peer, stopping)
        except Exception as e:  # noqa: BLE001 - nothing a peer sends may stop the loop
            log.exception("unexpected error handling a HELLO")
            reply, fds, welcomed = ErrorReply(InternalError.code, "bad_message",
                                              f"the HELLO could not be handled ({type(e).__name__})",
                                              "hello").encode(), [], None
        if not self._attach.reply(conn, reply, fds) and welcomed is not None:
            # its client gave up waiting (a connect that timed out while the loop was held up) and closed the
            # connection: the session it will never know of is ended now, not when that process exits (a process
            # connecting again and again left one each, up to --max-clients-per-uid, then its uid was refused)
            self.sessions.end_client(welcomed, "its WELCOME could not be sent: it gave up its connect")
        if self._lanes is not None:  # the client has its copies of the lanes' pages
            for lane in self._lanes.by_identity.values():
                lane.handed_over()
        for i in self.sessions.region_owner:  # a private region goes to one client only: keep no fd of it
            self.regions[i].close_fd()

    def _wait(self, poller: LoopPoll, lane_rang: dict[int, int], spin_s: float, timeout_ms: int) -> dict[Any, int]:
        """The loop's wait for its next events when nothing is in progress: a spin first while ``--spin-us`` asks for
        one or the linger time of an answer has not passed (:meth:`_spin`), then a poll of up to ``timeout_ms``.

        --spin-us: poll without sleeping for a while before blocking, so a request arriving soon finds the loop
        awake (one scheduler wake-up less per request; costs a core while it spins). With lanes, the lanes'
        call_seq words are read in between, and the poll (a system call, for the socket, the pidfds and the attach
        socket) runs every SPIN_POLL_S only: a lane's request is found within a fraction of a µs, its doorbell
        eventfd left for the next poll to clear. Lingering (schema/lane.py) is the same spin, until the time the
        last lingering answer said."""
        linger = self._linger
        end = time.perf_counter() + spin_s if spin_s else 0.0
        if linger.until_ns:
            # NOTE: until_ns stays until it has passed: a spin that ends early (events) is followed by another one,
            # never by a sleep while the lanes' awake words say this loop reads them
            left_s = (linger.until_ns - time.monotonic_ns()) / 1e9
            if left_s > 0:
                end = max(end, time.perf_counter() + left_s)
            else:
                linger.until_ns = 0
        if end:
            events = poller.poll(0) or self._spin(poller, lane_rang, end)
            if events or self._done:
                return events
        return poller.poll(timeout_ms)

    def _poll_timeout_ms(self, next_check: float) -> int:
        first = self._waiters.next_deadline() if len(self._waiters) else None
        deadline = next_check if first is None else min(next_check, first)
        paused = self._attach.paused_until if self._attach is not None else 0.0
        if paused:  # the attach socket is polled again then
            deadline = min(deadline, paused)
        return max(0, int((deadline - time.monotonic()) * 1000) + 1)

    def _zero(self, s: Slot) -> None:
        self.regions[s.region].zero_slot(s.index)
