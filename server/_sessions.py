"""The worker's control plane: handshakes, leases and private regions, borrowing, resident tensors, status.

:class:`Sessions` is a collaborator of :class:`~shmrpc.server._loop.Worker`; it owns no loop
of its own. Every handler answers on the worker's ROUTER socket through the ``send`` it was
given and keeps the lease bookkeeping (:mod:`._lease`) and the regions in step:

====================  =====================================================================
message               handled by
====================  =====================================================================
HELLO (attach socket) :meth:`Sessions.on_hello`: identity from the kernel, pidfd, private memfd, WELCOME
ACQUIRE / RELEASE     :meth:`Sessions.on_acquire`, :meth:`Sessions.on_release` (wait queue)
MANAGE                :meth:`Sessions.on_manage`: list / drop resident tensors (``shared/`` ones: owner only);
                      "plan": output specs for a client sizing its slot (``_oprules.answer_plan``)
BYE, pidfd readable   :meth:`Sessions.end_client`: end the lease, drop residents, free regions
STATUS                :meth:`Sessions.state`
====================  =====================================================================
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shmrpc import kernels
from shmrpc.kernels import Backend
from shmrpc.schema import SCHEMA_HASH
from shmrpc.schema import messages as m
from shmrpc.schema.control import Acquire, ErrorReply, Grant, Hello, Manage, Managed, MessageError, Welcome
from shmrpc.schema.errors import BusyError, ClientLimitError, InvalidRequestError, KernelError, RequestError
from shmrpc.schema.layout import Geometry
from shmrpc.schema.naming import socket_path
from shmrpc.schema.optable import build_op_table, parse_op_table
from shmrpc.schema.proc import process_start_ticks

from . import checks
from ._admission import Admission
from ._attach import PeerCred, check_identity
from ._dispatch import resident_name
from ._lanes import Lanes
from ._lease import Slot
from ._logs import RateLimited
from ._oprules import answer_plan, op_summary
from ._primed import PrimedSlots
from ._shared import SHARED_PREFIX
from ._waiters import Waiter, Waiters
from .procs import fds_open_and_limit, pid_alive
from .region import Region

if TYPE_CHECKING:
    from ._lease import Leases
    from ._shared import SharedOwners
    from .config import WorkerConfig
    from .metrics import Metrics

__all__ = ["Sessions"]

log = logging.getLogger("shmrpc.server")

#: Longest an ACQUIRE may wait for a slot (a longer ``wait_s`` is cut to it).
_MAX_WAIT_S = 3600.0


@dataclass(eq=False)
class ClientSession:
    id: int
    identity: bytes  # the session token: the DEALER's routing id, issued in WELCOME
    pid: int
    uid: int
    pidfd: int | None
    start_ticks: int | None
    since: float


class Sessions:
    """The worker's control plane: sessions, their leases and private regions, borrowing, resident tensors.

    It owns the sessions (by token and by pidfd), the admission counts and the private regions' owners;
    the worker's loop hands it messages and the pidfds that became readable. Everything else it is
    given: ``regions`` and ``views`` are the worker's own dicts (a private region is added to and
    removed from them here), ``send`` answers a peer on the ROUTER socket.
    """

    def __init__(self, config: WorkerConfig, *, regions: dict[int, Region], views: dict[tuple[int, int], memoryview],
                 backend: Backend, leases: Leases, waiters: Waiters, metrics: Metrics, shared: SharedOwners,
                 send: Callable[[bytes, bytes], None], started: float, primed: PrimedSlots | None = None,
                 lanes: Lanes | None = None) -> None:
        self.config = config
        self.lanes = lanes  # None: lanes are not granted (--no-lanes)
        self.regions = regions
        self._views = views
        self._primed = primed
        self.backend = backend
        self.leases = leases
        self._waiters = waiters
        self.metrics = metrics
        self.shared = shared
        # read at each scrape: a pool slot stays held while a gone client's request still runs in it, and is freed when
        # that request is answered, off every path that sets the gauges
        metrics.pool_slots_held.set_function(lambda: float(leases.n_pool_held))
        # identity -> (client id, shared/ names that its requests in flight keep, with their counts): a name stays its
        # owner's until the last of them finished, also after the session ended (settle_keeps)
        self._keeping: dict[bytes, tuple[int, collections.Counter[str]]] = {}
        self._send = send
        self._started = started
        self.admission = Admission(config)
        self.clients: dict[bytes, ClientSession] = {}  # by session token
        self.by_pidfd: dict[int, ClientSession] = {}
        self.region_owner: dict[int, int] = {}  # private region index -> client id
        self._next_client = 1
        self._start_ticks = process_start_ticks(os.getpid())
        self._op_table: tuple[int, dict[str, Any]] = (-1, {})  # (ops registered, the WELCOME's table) when built
        # refused handshakes' lines: the failed requests' rate (20 at once, then 5 per second), at WARNING
        self._refusals = RateLimited(log, rate_per_s=5.0, burst=20, level=logging.WARNING)

    def close(self) -> None:
        """Forget every session (the worker is closing): close their pidfds."""
        for c in self.clients.values():
            if c.pidfd is not None:
                os.close(c.pidfd)
        self.clients.clear()
        self.by_pidfd.clear()

    def _refuse(self, identity: bytes, kind: str, message: str, field: str = "",
                request_id: int | None = None) -> None:
        self._send(identity, _refusal(kind, message, field, request_id))

    def on_hello(self, frame: bytes, peer: PeerCred,
                 stopping: bool) -> tuple[bytes, list[int], ClientSession | None]:
        """Answer a HELLO from the attach socket: (WELCOME, the fds of its regions, the new session) or (ERROR, [],
        None); a session whose WELCOME cannot be sent is the caller's to end."""
        if stopping:
            self.refused(peer, "stopping", "the worker is shutting down")
            return _refusal("stopping", "the worker is shutting down; connect to its successor"), [], None
        if frame[:1] != m.HELLO:
            self.refused(peer, "bad_message", f"not a HELLO (kind {frame[:1]!r})")
            return _refusal("bad_message", "the attach socket takes one HELLO", "kind"), [], None
        try:
            hello = Hello.decode(frame)
        except MessageError as e:
            # a pid, uid or start time that is not a number is a claim the kernel does not back
            kind = "refused" if e.field in ("pid", "uid", "start_ticks") else "bad_message"
            self.refused(peer, "identity" if kind == "refused" else "bad_message", f"HELLO is malformed ({e})")
            return _refusal(kind, f"HELLO is malformed ({e})", e.field), [], None
        proto, shash = hello.protocol, hello.schema_hash
        if proto != m.PROTOCOL_VERSION or shash != SCHEMA_HASH:
            self.refused(peer, "protocol", f"it speaks protocol {proto} schema {shash}, the worker protocol "
                         f"{m.PROTOCOL_VERSION} schema {SCHEMA_HASH}")
            return _refusal(
                "protocol_mismatch",
                f"client speaks protocol {proto} schema {shash}, worker speaks protocol {m.PROTOCOL_VERSION} "
                f"schema {SCHEMA_HASH}: install the same shmrpc version on both sides",
                "protocol" if proto != m.PROTOCOL_VERSION else "schema_hash",
            ), [], None
        problem = check_identity(hello.to_json(), peer, self.config.allow_uids)
        if problem is not None:
            self.refused(peer, "identity", problem[0])
            return _refusal("refused", *problem), [], None
        short = fds_short()
        if short:  # refused while the worker can still open what it needs (libzmq aborts the process at EMFILE)
            self.refused(peer, "fds", short)
            return ErrorReply(BusyError.code, "too_many_clients", short, "fds").encode(), [], None
        try:
            self.admission.admit(peer.uid)
            lease = self.admission.lease_for(hello.lease)
        except ClientLimitError as e:
            self.refused(peer, e.field or "max_clients", str(e))
            return ErrorReply(BusyError.code, "too_many_clients", str(e), "clients").encode(), [], None
        except ValueError as e:
            self.refused(peer, "bad_message", f"HELLO is malformed ({e})")
            return _refusal("bad_message", f"HELLO is malformed ({e})", "lease"), [], None
        client = self._admit(peer)
        try:
            regions, slots = self._lease_regions(client, lease)
        except Exception as e:  # noqa: BLE001 - no memory, memlock, GPU registration: refuse, keep serving
            self._forget(client)
            self.refused(peer, "region", f"cannot create its region (lease {','.join(map(str, lease))}): {e}")
            asked = "" if hello.lease is None else f" (it asked for a lease of {','.join(map(str, lease))} slots)"
            return _refusal("refused", f"cannot create this client's region{asked}: {e}", "region"), [], None
        self.metrics.clients.set(len(self.clients))
        self._count_slots()
        log.info("client %d (pid %d uid %d) connected with %d slots", client.id, peer.pid, peer.uid, len(slots),
                 extra={"event": "client_connected", "client_id": client.id, "client_pid": peer.pid,
                        "client_uid": peer.uid, "slots": len(slots)})
        fds = [r.fd for r in regions if r.fd is not None]
        lane = None
        if hello.lane and self.lanes is not None:
            try:
                lane = self.lanes.open(client.identity)
            except Exception as e:  # noqa: BLE001 - out of fds or memory: this client is refused, the worker serves on
                # its session was admitted and holds its region and lease: ended here, not when its process exits
                self.end_client(client, f"its lane could not be opened: {e}")
                self.refused(peer, "lane", f"cannot open its lane: {e}")
                return _refusal("refused", f"cannot open this client's lane: {e}", "lane"), [], None
            fds += lane.fds()
        return self._welcome(client, regions, slots, lane is not None), fds, client

    def refused(self, peer: PeerCred, reason: str, why: str) -> None:
        """A handshake of ``peer`` is refused for ``reason`` (a label of ``shmrpc_clients_refused_total``): counted,
        and a WARNING line (rate-limited as failed requests' lines are: a client retrying in a loop cannot flood the
        log; the next line let through says how many were held back)."""
        self.metrics.client_refused(reason)
        self._refusals.log("refused a HELLO from pid %d uid %d: %s", peer.pid, peer.uid, why,
                           extra={"event": "hello_refused", "client_pid": peer.pid, "client_uid": peer.uid,
                                  "reason": reason})

    def _admit(self, peer: PeerCred) -> ClientSession:
        """A new session for the process the kernel vouched for, watched through a pidfd, under a fresh token."""
        try:
            pidfd: int | None = os.pidfd_open(peer.pid)
        except (AttributeError, OSError):
            pidfd = None
        token = secrets.token_hex(m.TOKEN_NBYTES).encode()
        client = ClientSession(self._next_client, token, peer.pid, peer.uid, pidfd,
                         process_start_ticks(peer.pid), time.time())
        self._next_client += 1
        self.clients[token] = client
        self.admission.joined(peer.uid)
        if pidfd is not None:
            self.by_pidfd[pidfd] = client
        return client

    def _forget(self, client: ClientSession) -> None:
        """Undo :meth:`_admit` for a session that never started."""
        self.clients.pop(client.identity, None)
        self.admission.left(client.uid)
        if self.lanes is not None:
            self.lanes.drop(client.identity)
        if client.pidfd is not None:
            self.by_pidfd.pop(client.pidfd, None)
            os.close(client.pidfd)
            client.pidfd = None

    def _lease_regions(self, client: ClientSession, lease: tuple[int, ...]) -> tuple[list[Region], list[Slot]]:
        """The regions ``client`` maps (the pool, and its own with ``--isolation client``) and its leased slots.

        ``lease``: slots per size class granted by admission (what the HELLO asked for, capped by --lease-max).
        """
        private = self.config.private_geometry(lease) if self.config.isolation == "client" else None
        if private is None:
            return [self.regions[0]], self.leases.open(client.id, lease=lease if self.config.isolation == "shared"
                                                        else ())
        region = self._new_private_region(client.id, private)
        self.leases.open(client.id, from_pool=False)
        return [self.regions[0], region], self.leases.add_private(client.id, region.index, private)

    def _welcome(self, client: ClientSession, regions: list[Region], slots: list[Slot], lane: bool) -> bytes:
        """The WELCOME; the regions' fds travel beside it, in the order of its ``regions`` list."""
        return Welcome(
            protocol=m.PROTOCOL_VERSION,
            schema_hash=SCHEMA_HASH,
            client_id=client.id,
            token=client.identity.decode(),
            worker_pid=os.getpid(),
            worker_start_ticks=self._start_ticks,
            backend=self.backend.name,
            regions=[{"index": r.index, "name": r.name, "nbytes": r.nbytes, "geometry": r.geometry.to_json()}
                     for r in regions],
            geometry=self.config.geometry.to_json(),
            lease=[[s.region, s.index, s.generation] for s in slots],
            op_table=self._welcome_op_table(),
            lane=True if lane else None,
        ).encode()

    def _welcome_op_table(self) -> dict[str, Any]:
        """The op table as WELCOME carries it, checked through the schema's entry format; built again only
        when ops were registered since (users' ops load at start, so in practice once)."""
        n = len(kernels.REGISTRY)
        if self._op_table[0] != n:
            self._op_table = (n, build_op_table(parse_op_table(kernels.op_table()).values()))
        return self._op_table[1]

    def _new_private_region(self, client: int, geometry: Geometry) -> Region:
        """Create, pin and record the region holding ``client``'s leased slots (a memfd: it has no name)."""
        checks.check_memory(geometry.region_nbytes)
        index = next(i for i in range(1, 1 << 16) if i not in self.regions)
        region = Region.create(self.config.name, geometry, index=index, mlock=self.config.mlock)
        try:
            if self.config.register_host:
                self.backend.register_host(region.address, region.nbytes)
        except BaseException:
            region.close()
            raise
        self.regions[index] = region
        self.region_owner[index] = client
        return region

    def close_idle_regions(self) -> None:
        for i in [i for i in self.region_owner if self.leases.region_idle(i)]:
            region = self.regions.pop(i)
            self.region_owner.pop(i)
            for key in [k for k in self._views if k[0] == i]:
                del self._views[key]
            if self._primed is not None:  # its views hold the mapping open
                self._primed.drop_region(i)
            self.leases.remove_private(i)
            if self.config.register_host:
                self.backend.unregister_host(region.address)
            region.close()

    def on_manage(self, identity: bytes, frame: bytes) -> None:
        c = self.clients.get(identity)
        if c is None:
            return self._refuse(identity, "no_session", "no lease: say HELLO first", "client")
        try:
            req = Manage.decode(frame)
        except MessageError as e:
            return self._refuse(identity, "bad_message", f"MANAGE is malformed ({e})", e.field)
        action, name, rid = req.action, req.name, req.id
        if action == "plan":  # output specs for sizing a slot (schema/planquery.py)
            return self._send(identity, answer_plan(self.backend, c.id, req))
        own = f"{c.id}/"
        if action == "list":
            listing = {}
            for full, spec in self.backend.resident().items():
                if full.startswith(own) or full.startswith("shared/"):
                    listing[full.removeprefix(own)] = {"shape": list(spec.shape), "dtype": spec.dtype}
            return self._send(identity, Managed(resident=listing, id=rid).encode())
        if action == "drop":
            full = resident_name(c.id, name)
            try:
                self.shared.check(c.id, full, "resident")
            except RequestError as e:
                return self._send(identity, _error_msg(e, rid))
            if full not in self.backend.resident():
                self.shared.forget(full)
                return self._send(identity, _error_msg(KernelError(f"no resident tensor {name!r}", tensor=name,
                                                                   field="resident"), rid))
            self.backend.drop(full)
            self.shared.forget(full)
            self.metrics.resident.set(self.backend.resident_bytes)
            return self._send(identity, Managed(dropped=name, id=rid).encode())
        return self._refuse(identity, "bad_message", f"unknown MANAGE action {action!r}", "action", rid)

    def _drop_residents(self, client_id: int, identity: bytes = b"") -> None:
        """Drop the client's private resident tensors and the shared ones it owns; a shared name that one of its
        requests still running keeps stays its own until that request finished (:meth:`settle_keeps`), so that no
        other client puts a tensor there which the late request would replace."""
        own = f"{client_id}/"
        shared = set(self.shared.release(client_id))
        kept = self._keeping.get(identity)
        if kept is not None:
            self.shared.claim(client_id, [n for n, k in kept[1].items() if k > 0])
        for full in [n for n in self.backend.resident() if n.startswith(own) or n in shared]:
            self.backend.drop(full)
        self.metrics.resident.set(self.backend.resident_bytes)

    def _count_slots(self) -> None:
        """The slots gauge: every slot clients hold (the pool's, what its exhaustion alert reads, is read at each
        scrape)."""
        self.metrics.slots_leased.set(self.leases.n_leased)

    def claim_keeps(self, identity: bytes, client_id: int, names: Iterable[str]) -> None:
        """A request of session ``identity`` that keeps ``names`` (the backend's names) is about to run: the shared
        ones become its client's (InvalidRequestError when another client owns one), and are counted as kept in
        flight until :meth:`settle_keeps`."""
        names = list(names)
        self.shared.claim(client_id, names)
        shared = [n for n in names if n.startswith(SHARED_PREFIX)]
        if shared:
            self._keeping.setdefault(identity, (client_id, collections.Counter()))[1].update(shared)

    def settle_keeps(self, identity: bytes, names: Iterable[str], ok: bool) -> None:
        """A request that keeps resident tensors ``names`` (the backend's names) finished.

        Its session may have ended while it ran (BYE, its process died): that session's tensors were dropped at its
        end, so what the request kept afterwards is dropped now (a private name of an ended session could never be
        dropped by anyone, and would count against --resident-limit for good), unless another client has claimed
        the shared name since. A request that failed gives up its claim on a shared name it did not keep (the
        claim is made when the request is validated, before it runs).
        """
        names = list(names)
        c = self.clients.get(identity)
        record = self._keeping.get(identity)
        ended_id = record[0] if record is not None else None
        if record is not None:
            record[1].subtract(n for n in names if n.startswith(SHARED_PREFIX))
            if not +record[1]:
                del self._keeping[identity]
        if c is not None and ok:
            return  # (every put's path: nothing more to look up)
        still = self._keeping.get(identity, (0, collections.Counter()))[1]
        dropped = False
        for full in names:
            shared = full.startswith(SHARED_PREFIX)
            there = self.backend.resident_spec(full) is not None
            if c is None:
                # an ended session's: its name was held for it while this request ran (end_client), so no other
                # client has put a tensor under it meanwhile; free once the last such request finished
                owner = self.shared.owner(full)
                if there and (not shared or owner is None or owner == ended_id):
                    self.backend.drop(full)
                    dropped = True
                if shared and owner == ended_id and still[full] <= 0:
                    self.shared.forget(full)
            elif shared and not there and self.shared.owner(full) == c.id:
                self.shared.forget(full)
        if dropped:
            self.metrics.resident.set(self.backend.resident_bytes)

    def end_client(self, c: ClientSession, why: str) -> None:
        self.clients.pop(c.identity, None)
        if self.lanes is not None:
            self.lanes.drop(c.identity)
        self.admission.left(c.uid)
        self._drop_residents(c.id, c.identity)
        if c.pidfd is not None:
            self.by_pidfd.pop(c.pidfd, None)
            os.close(c.pidfd)
            c.pidfd = None
        n = self.leases.close(c.id)
        self._waiters.cancel(c.id)
        self.metrics.clients.set(len(self.clients))
        self._count_slots()
        log.info("client %d (pid %d) gone (%s): %d slots reclaimed", c.id, c.pid, why, n,
                 extra={"event": "client_gone", "client_id": c.id, "client_pid": c.pid, "why": why, "slots": n})
        self.close_idle_regions()
        self.serve_pending()

    def gauge_memory(self) -> None:
        mem = self.backend.memory()
        self.metrics.gpu_memory.set(mem.get("device_used_bytes", 0))
        self.metrics.resident.set(mem.get("resident_bytes", 0))

    def check_clients(self) -> None:
        for c in list(self.clients.values()):
            if c.pidfd is None and not pid_alive(c.pid, c.start_ticks):
                self.end_client(c, "its process is gone")

    def _grant_msg(self, s: Slot, request_id: int | None) -> bytes:
        return Grant(s.region, s.index, s.generation, s.nbytes, request_id).encode()

    def on_acquire(self, identity: bytes, frame: bytes) -> None:
        c = self.clients.get(identity)
        if c is None:
            return self._refuse(identity, "no_session", "no lease: say HELLO first", "client")
        try:
            req = Acquire.decode(frame)
        except MessageError as e:
            return self._refuse(identity, "bad_message", f"ACQUIRE is malformed ({e})", e.field)
        nbytes, wait_s, rid = req.nbytes, float(req.wait_s), req.id
        try:
            s = self.leases.acquire(c.id, nbytes)
        except BusyError as e:
            # wait only for a slot to free, never for this client's own borrow limit (nothing it waits on frees)
            if not wait_s > 0 or self.leases.free_fits(nbytes):
                return self._send(identity, _error_msg(e, rid))
            try:
                self._waiters.add(c.id, identity, nbytes, time.monotonic() + min(wait_s, _MAX_WAIT_S), rid)
            except BusyError as over:
                return self._send(identity, _error_msg(over, rid))
            return None
        except RequestError as e:
            return self._send(identity, _error_msg(e, rid))
        self._count_slots()
        self._send(identity, self._grant_msg(s, rid))
        return None

    def serve_pending(self) -> None:
        if len(self._waiters):
            self._waiters.serve(self._grant_waiter)
            self._count_slots()

    def _grant_waiter(self, w: Waiter) -> bool:
        """Give waiter ``w`` a slot: True when it was answered (a grant, or an error), False when none fits yet."""
        try:
            s = self.leases.acquire(w.client, w.nbytes)
        except BusyError as e:
            if not self.leases.free_fits(w.nbytes):
                return False
            self._send(w.identity, _error_msg(e, w.request_id))  # a slot is free but the client borrows all it may
            return True
        except RequestError as e:
            self._send(w.identity, _error_msg(e, w.request_id))
            return True
        self._send(w.identity, self._grant_msg(s, w.request_id))
        return True

    def expire_pending(self, now: float) -> None:
        for w in self._waiters.expired(now):
            self._send(w.identity, _error_msg(BusyError("no slot became free in time", field="nbytes"), w.request_id))

    def on_release(self, identity: bytes, frame: bytes) -> None:
        c = self.clients.get(identity)
        try:
            _, region, index = m.SLOT_STRUCT.unpack(frame)
        except Exception:  # noqa: BLE001
            return
        if c is not None and self.leases.release(c.id, region, index):
            self._count_slots()
            self.serve_pending()

    def state(self) -> dict[str, Any]:
        """The worker's state for ``shmrpc status``: every resident tensor counted, the first
        :data:`STATE_RESIDENT_LISTED` named (any client may keep thousands: all of them once made the one packet
        of STATE too large to send, and `shmrpc status`, the readiness check, failed on a healthy worker)."""
        resident = self.backend.resident() if self.backend else {}
        return {
            "name": self.config.name,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self._started, 3),
            "backend": self.backend.name if self.backend else None,
            "socket": str(socket_path(self.config.name)),
            "regions": [{"index": r.index, "name": r.name, "nbytes": r.nbytes, "slots": r.geometry.spec(),
                         "mlocked": r.mlocked, "owner": self.region_owner.get(r.index)}
                        for r in self.regions.values()],
            "clients": [{"id": c.id, "pid": c.pid, "uid": c.uid, "connected_s": round(time.time() - c.since, 3),
                         "slots": [[s.region, s.index, s.nbytes, s.borrowed, s.in_flight] for s in self.leases.held(c.id)]}
                        for c in self.clients.values()],
            "slots_leased": self.leases.n_leased,
            "in_flight": self.leases.n_in_flight,
            "pending_acquires": len(self._waiters),
            "counters": self.metrics.snapshot(),
            "ops": op_summary(),
            "resident": {k: {"shape": list(v.shape), "dtype": v.dtype}
                         for k, v in itertools.islice(resident.items(), STATE_RESIDENT_LISTED)},
            "resident_count": len(resident),
        }


#: file descriptors a HELLO leaves free for the worker's own use (a client costs up to ~8: its ZeroMQ connection,
#: pidfd, region, lane; the attach socket's waiting connections, CuPy's). The metrics server holds at most
#: ``_http.MAX_CONNECTIONS`` (16) and takes none of the last ``_http.FD_RESERVE`` (32): it cannot use up this headroom
FD_HEADROOM = 64


def fds_short() -> str:
    """Why this process cannot take one more client for want of file descriptors ("" when it can): fewer than
    :data:`FD_HEADROOM` are left under its soft RLIMIT_NOFILE. libzmq asserts (SIGABRT, the whole worker) when an
    accept finds none left, so a client is refused before that can happen."""
    n, soft = fds_open_and_limit()
    if soft is None or n + FD_HEADROOM <= soft:
        return ""
    return (f"the worker has {n} file descriptors open of its limit of {soft} (RLIMIT_NOFILE) and keeps "
            f"{FD_HEADROOM} for itself: raise the limit (LimitNOFILE=, ulimit -n) or close idle clients")


#: resident tensors named in STATE (``resident``; ``resident_count`` counts them all)
STATE_RESIDENT_LISTED = 200


def _refusal(kind: str, message: str, field: str = "", request_id: int | None = None) -> bytes:
    return ErrorReply(InvalidRequestError.code, kind, message, field, request_id).encode()


def _error_msg(e: RequestError, request_id: int | None = None) -> bytes:
    """The ERROR answering a refused ACQUIRE or MANAGE: the typed error's wire code, echoing the request's id."""
    return ErrorReply(e.code, "refused_request", e.message, e.field, request_id).encode()

