"""Prepared requests per slot: the steady path of a slot that is sent the same request again.

A client that sends the same op over the same tensors from one slot (a loan sent
in a loop, ``Client.call`` with arrays of one shape) writes the same descriptor
bytes every time. The loop keeps, per slot, the descriptor bytes of the last
requests it validated there (up to :data:`PER_SLOT` different ones: a client whose
calls take turns between a few ops or shapes through one kept loan), each with the
:class:`~._dispatch.Prepared` request and the NumPy views over the slot that go
with it, and the backend's bound run of the plan over those views (``Backend.bind``:
the views' checks and where each step writes, done once). A request is served from
an entry only when its copied-out descriptor bytes, header op code and flags, and
the slot's owner are equal to the entry's: the bytes are compared, never a flag
trusted, so a writer that changes one byte between two requests gets a full
decode, validation and plan.

Everything read from shared memory is still checked per request: the header
against the doorbell (:func:`~._dispatch.check_header`), the descriptor bytes by
comparison with bytes already validated for this very slot. The views are over
the worker's own mapping of the slot, so they hold the region's mapping open:
:meth:`PrimedSlots.drop_region` runs before a private region is closed.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shmrpc.kernels._backend_base import BoundRun, ItemViews
from shmrpc.schema.header import AFTER_REQUEST_ID, HEADER_NBYTES

from ._dispatch import Prepared
from ._lease import Slot

if TYPE_CHECKING:
    from ._sessions import ClientSession

__all__ = ["Express", "PER_SLOT", "Primed", "PrimedSlots"]


@dataclass(frozen=True, slots=True)
class Primed:
    """A request validated in one slot, with its views."""

    payload: bytes  # the descriptor bytes, a private copy
    op_code: int
    flags: int
    client: int
    prep: Prepared
    views: ItemViews
    bound: BoundRun | None = None  # the backend's bound run over ``views`` (None: nothing to run)


@dataclass(frozen=True, slots=True)
class Express:
    """A slot's request served on the loop thread (run inline, or parked for a batch) from one of the slot's
    :class:`Primed` entries, armed for the express path.

    The loop looks it up by the CALL frame's region and slot bytes (``frame[2:8]``) before anything else
    and serves the request straight from it when the doorbell's sender, the slot's lease and generation,
    the header and the descriptor bytes in the slot are what they were (``Worker._serve_express``): the
    same checks as the full path, against values that passed them before; the descriptor is compared on
    a private copy, as :meth:`PrimedSlots.get` does, but not decoded.
    """

    identity: bytes  # the session token the request came from
    session: ClientSession  # that session (the loop checks it is still the one of that token)
    slot: Slot
    view: memoryview  # the slot's bytes (the worker's own mapping)
    primed: Primed
    raw: ctypes.Array[ctypes.c_char]  # the slot's header and descriptor (over ``view``)
    expect: bytes  # what must follow the request id there: the header's op code, length, flags and generation,
    # then the descriptor

    @classmethod
    def of(cls, identity: bytes, session: ClientSession, slot: Slot, view: memoryview, primed: Primed,
           gen: int) -> Express:
        """The entry of ``primed``'s slot for requests whose header carries ``gen`` (the slot's lease)."""
        raw = (ctypes.c_char * (HEADER_NBYTES + len(primed.payload))).from_buffer(view)
        expect = AFTER_REQUEST_ID.pack(primed.op_code, len(primed.payload), primed.flags, gen) + primed.payload
        return cls(identity, session, slot, view, primed, raw, expect)


#: Most requests kept per slot (the least recently served goes first).
PER_SLOT = 4


class PrimedSlots:
    """``(region, slot) -> {descriptor bytes: Primed}``: up to :data:`PER_SLOT` entries per slot, all of the
    slot's owner of the time; a request of another owner, or one that fails validation, drops them all.

    ``express`` holds, by the CALL frame's region and slot bytes, the slot's entries armed for the express path
    (:class:`Express`, the most recently armed first); an armed entry goes whenever its :class:`Primed` entry goes
    or is replaced.
    """

    def __init__(self) -> None:
        self._by_slot: dict[tuple[int, int], dict[bytes, Primed]] = {}
        self.express: dict[bytes, tuple[Express, ...]] = {}
        self.hits = 0  # requests served from an entry (read by tests and the bench tool)

    def get(self, key: tuple[int, int], payload: bytes, op_code: int, flags: int, client: int) -> Primed | None:
        """The entry of slot ``key`` made from exactly these bytes, op code, flags and client, if any."""
        entries = self._by_slot.get(key)
        if entries is None:
            return None
        p = entries.get(payload)
        if p is None or p.op_code != op_code or p.flags != flags or p.client != client:
            return None
        if len(entries) > 1:
            del entries[payload]
            entries[payload] = p  # the most recently served last
        self.hits += 1
        return p

    def put(self, key: tuple[int, int], primed: Primed) -> None:
        """Keep ``primed`` for slot ``key``, beside the slot's other entries of the same owner (the least recently
        served one dropped beyond :data:`PER_SLOT`); entries of another owner, or of these bytes, are replaced."""
        entries = self._by_slot.get(key)
        if entries is None or next(iter(entries.values())).client != primed.client:
            entries = self._by_slot[key] = {}
        else:
            entries.pop(primed.payload, None)
            if len(entries) >= PER_SLOT:
                del entries[next(iter(entries))]
        entries[primed.payload] = primed
        self._keep_armed(key, entries, ())

    def arm(self, ex: Express) -> None:
        """Serve the next requests of ``ex``'s slot that equal its entry by the express path."""
        key = (ex.slot.region, ex.slot.index)
        entries = self._by_slot.get(key)
        if entries is not None and entries.get(ex.primed.payload) is ex.primed:
            self._keep_armed(key, entries, (ex,))

    def _keep_armed(self, key: tuple[int, int], entries: dict[bytes, Primed], first: tuple[Express, ...]) -> None:
        """Slot ``key``'s armed entries: ``first``, then those armed before that are still its entries (one per
        entry)."""
        fk = _frame_key(key)
        armed = first + tuple(e for e in self.express.get(fk, ())
                              if entries.get(e.primed.payload) is e.primed and (not first or e.primed is not first[0].primed))
        if armed:
            self.express[fk] = armed
        else:
            self.express.pop(fk, None)

    def forget(self, key: tuple[int, int]) -> None:
        """Drop slot ``key``'s entries and the armed ones (a request there failed validation)."""
        self._by_slot.pop(key, None)
        self.express.pop(_frame_key(key), None)

    def drop_region(self, region: int) -> None:
        """Drop every entry of ``region`` (before its mapping closes: the views hold it open)."""
        for key in [k for k in self._by_slot if k[0] == region]:
            del self._by_slot[key]
        for fk in [k for k, exs in self.express.items() if exs[0].slot.region == region]:
            del self.express[fk]

    def clear(self) -> None:
        self._by_slot.clear()
        self.express.clear()

    def __len__(self) -> int:
        """Entries kept, over all slots."""
        return sum(len(e) for e in self._by_slot.values())


_KEY = struct.Struct("<HI")


def _frame_key(key: tuple[int, int]) -> bytes:
    """The bytes a CALL frame carries at [2:8] for slot ``key`` (region u16, slot u32; schema.messages)."""
    return _KEY.pack(*key)
