"""Slot bookkeeping: who holds which slot, its generation, and whether a request is in it.

Slot states (per ``(region, slot)``; kept in worker memory only, never in the region)::

            open()/acquire()               CALL (header checked)
    FREE ──────────────────────▶ LEASED ─────────────────────▶ IN_FLIGHT
     ▲  zeroed first if another     │  ▲                            │
     │  client wrote it last        │  └──────── DONE sent ─────────┘
     └──── release()/close() ───────┘
           (a slot IN_FLIGHT at close() is freed when its request finishes)

Every grant bumps the slot's ``generation``; a CALL or header carrying an older
generation is refused (:class:`StaleSlotError`), so a client that keeps a stale
slot number cannot have a request run in a slot someone else now holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shmrpc.schema.errors import BusyError, InvalidRequestError, RequestTooLargeError, StaleSlotError
from shmrpc.schema.layout import Geometry, format_size

__all__ = ["Slot", "Leases"]


@dataclass(eq=False)
class Slot:
    """One slot's bookkeeping."""

    region: int
    index: int
    nbytes: int
    cls: int
    generation: int = 0
    owner: int | None = None
    borrowed: bool = False
    in_flight: bool = False
    last_owner: int | None = None
    freeing: bool = False  # owner gone while in flight: free when the request finishes


@dataclass
class _Holdings:
    """The slots one client holds (leased and borrowed)."""

    slots: list[Slot] = field(default_factory=list)


class Leases:
    """Slot leases of all clients over the worker's regions.

    Args:
        geometries: the geometry of each region, by region index.
        lease: slots of each size class granted at :meth:`open`.
        zero: called with a slot before it goes to a client other than the one that wrote it last.
    """

    def __init__(self, geometries: list[Geometry], lease: tuple[int, ...], zero: Callable[[Slot], None],
                 max_borrowed_slots: int = 0, max_borrowed_bytes: int = 0) -> None:
        self._zero = zero
        self._max_slots, self._max_bytes = max_borrowed_slots, max_borrowed_bytes
        self._lease = lease
        self._slots: dict[tuple[int, int], Slot] = {}
        self._free: list[list[Slot]] = []  # per size class, over all regions, FIFO
        self._sizes: list[int] = []
        for r, geo in enumerate(geometries):
            for c, sc in enumerate(geo.classes):
                if c >= len(self._free):
                    self._free.append([])
                    self._sizes.append(sc.slot_nbytes)
                for i in geo.slots_of_class(c):
                    s = Slot(r, i, sc.slot_nbytes, c)
                    self._slots[(r, i)] = s
                    self._free[c].append(s)
        self._n_pool = len(self._slots)  # every slot made here is the pool's (private regions come later)
        self._clients: dict[int, _Holdings] = {}
        self._private: dict[int, int] = {}  # region -> the client it belongs to

    # ------------------------------------------------------------ private regions

    def add_private(self, client: int, region: int, geometry: Geometry) -> list[Slot]:
        """Give ``client`` every slot of its own new ``region`` (nobody else is ever granted them)."""
        self._private[region] = client
        c = self._clients.setdefault(client, _Holdings())
        out = []
        for cls_i, sc in enumerate(geometry.classes):
            for i in geometry.slots_of_class(cls_i):
                s = Slot(region, i, sc.slot_nbytes, cls_i, generation=1, owner=client)
                self._slots[(region, i)] = s
                c.slots.append(s)
                out.append(s)
        return out

    def region_idle(self, region: int) -> bool:
        """True when ``region`` is private, its client is gone and none of its slots holds a request."""
        client = self._private.get(region)
        if client is None or client in self._clients:
            return False
        return not any(s.in_flight for (r, _), s in self._slots.items() if r == region)

    def remove_private(self, region: int) -> None:
        """Forget an idle private region's slots."""
        self._private.pop(region, None)
        for key in [k for k in self._slots if k[0] == region]:
            del self._slots[key]

    # ------------------------------------------------------------ grants

    def _grant(self, client: int, s: Slot, borrowed: bool) -> Slot:
        if s.last_owner is not None and s.last_owner != client:
            self._zero(s)
            s.last_owner = None
        s.generation = (s.generation + 1) & 0xFFFFFFFF or 1
        s.owner, s.borrowed = client, borrowed
        self._clients[client].slots.append(s)
        return s

    def open(self, client: int, from_pool: bool = True, lease: tuple[int, ...] | None = None) -> list[Slot]:
        """Start ``client``'s lease: up to ``lease[c]`` (default: the lease given at construction) free pool
        slots of each class (fewer when short), or none with ``from_pool=False`` (its slots then come from
        :meth:`add_private`)."""
        self._clients[client] = _Holdings()
        out: list[Slot] = []
        if not from_pool:
            return out
        for c, want in enumerate(self._lease if lease is None else lease):
            for _ in range(min(want, len(self._free[c]))):
                out.append(self._grant(client, self._free[c].pop(0), borrowed=False))
        return out

    def acquire(self, client: int, nbytes: int) -> Slot:
        """Borrow the smallest free slot of at least ``nbytes``.

        Raises:
            InvalidRequestError: ``nbytes`` is not positive.
            RequestTooLargeError: no slot class is that large.
            BusyError: every slot large enough is taken, or the client borrows all it may.
        """
        if client not in self._clients:
            raise StaleSlotError("no lease: say HELLO first", field="client")
        if nbytes <= 0:
            raise InvalidRequestError(f"ACQUIRE nbytes must be at least 1, got {nbytes}", field="nbytes")
        if nbytes > self._sizes[-1]:
            raise RequestTooLargeError(
                f"a request of {format_size(nbytes)} does not fit the largest slot ({format_size(self._sizes[-1])}): "
                "start the worker with a larger class in --slots (e.g. --slots 64K:64,1M:16,1G:1)",
                field="nbytes",
            )
        borrowed = [s for s in self._clients[client].slots if s.borrowed]
        for c, size in enumerate(self._sizes):
            if size >= nbytes and self._free[c]:
                if self._max_slots and len(borrowed) + 1 > self._max_slots:
                    raise BusyError(f"this client already borrows {len(borrowed)} slots, the most a client may "
                                    "(--client-max-slots)", field="nbytes")
                if self._max_bytes and sum(s.nbytes for s in borrowed) + size > self._max_bytes:
                    raise BusyError(f"borrowing a {format_size(size)} slot would take this client over its "
                                    f"{format_size(self._max_bytes)} (--client-max-bytes)", field="nbytes")
                return self._grant(client, self._free[c].pop(0), borrowed=True)
        raise BusyError(f"every slot of {format_size(nbytes)} or more is in use; retry later", field="nbytes")

    @property
    def sizes(self) -> list[int]:
        """Slot bytes of each size class, smallest first."""
        return list(self._sizes)

    def free_fits(self, nbytes: int) -> bool:
        """True when some free pool slot holds ``nbytes``."""
        return any(self._free[c] for c, size in enumerate(self._sizes) if size >= nbytes)

    # ------------------------------------------------------------ returns

    def _free_slot(self, s: Slot) -> None:
        s.last_owner = s.owner
        s.owner, s.borrowed, s.in_flight, s.freeing = None, False, False, False
        if s.region not in self._private:
            self._free[s.cls].append(s)

    def release(self, client: int, region: int, index: int) -> bool:
        """Give back a borrowed slot; False when ``client`` does not hold it borrowed."""
        s = self._slots.get((region, index))
        if s is None or s.owner != client or not s.borrowed:
            return False
        self._clients[client].slots.remove(s)
        if s.in_flight:
            s.freeing = True
        else:
            self._free_slot(s)
        return True

    def close(self, client: int) -> int:
        """End ``client``'s lease; slots in flight are freed when their request finishes. Returns slots ended."""
        c = self._clients.pop(client, None)
        if c is None:
            return 0
        for s in c.slots:
            if s.in_flight:
                s.freeing = True
            else:
                self._free_slot(s)
        return len(c.slots)

    # ------------------------------------------------------------ calls

    def begin(self, client: int, region: int, index: int, generation: int) -> Slot:
        """Mark a slot in flight for a CALL.

        Raises:
            StaleSlotError: unknown slot, not leased to ``client``, old generation.
            InvalidRequestError subclass: the slot already holds a request in flight (a second doorbell).
        """
        s = self._slots.get((region, index))
        if s is None:
            raise StaleSlotError(f"there is no slot ({region}, {index})", field="slot")
        if s.owner != client:
            raise StaleSlotError(f"slot ({region}, {index}) is not leased to this client", field="slot")
        if s.generation != generation:
            raise StaleSlotError(
                f"slot ({region}, {index}) generation {generation} is stale (now {s.generation})", field="generation"
            )
        if s.in_flight:
            raise BusyError(f"slot ({region}, {index}) already holds a request in flight", field="slot")
        s.in_flight = True
        return s

    def end(self, s: Slot) -> None:
        """The request in ``s`` finished (its DONE was sent or its owner is gone)."""
        s.in_flight = False
        s.last_owner = s.owner if s.owner is not None else s.last_owner
        if s.freeing:
            self._free_slot(s)

    # ------------------------------------------------------------ views

    def clients(self) -> Iterable[int]:
        """Client ids with a lease."""
        return self._clients.keys()

    def held(self, client: int) -> list[Slot]:
        """Slots ``client`` holds."""
        c = self._clients.get(client)
        return list(c.slots) if c else []

    @property
    def n_leased(self) -> int:
        """Slots held by clients (their own regions' included)."""
        return sum(len(c.slots) for c in self._clients.values())

    @property
    def n_pool_held(self) -> int:
        """Slots of the pool region that are not free: leased from it or borrowed by a client, or still holding the
        request of a client that is gone (freed once it finishes). Any thread may read it (a scrape does)."""
        return self._n_pool - sum(len(free) for free in self._free)

    @property
    def n_in_flight(self) -> int:
        """Slots holding a request."""
        return sum(1 for s in self._slots.values() if s.in_flight)
