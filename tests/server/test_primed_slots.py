"""PrimedSlots: the requests kept per slot for the steady path, up to PER_SLOT of one owner."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from shmrpc.server._primed import PER_SLOT, Express, Primed, PrimedSlots, _frame_key


def _primed(payload: bytes, client: int = 1, op_code: int = 0, flags: int = 0) -> Primed:
    return Primed(payload, op_code, flags, client, SimpleNamespace(), ({}, {}))  # type: ignore[arg-type]


def _express(slot: tuple[int, int], primed: Primed) -> Express:
    s: Any = SimpleNamespace(region=slot[0], index=slot[1])
    return Express(b"id", None, s, memoryview(b""), primed, None, b"")  # type: ignore[arg-type]


def test_requests_taking_turns_in_a_slot_are_each_found_again() -> None:
    ps, key = PrimedSlots(), (0, 3)
    kept = [_primed(bytes([i]) * 8) for i in range(PER_SLOT)]
    for p in kept:
        ps.put(key, p)
    for _ in range(3):
        for p in kept:
            assert ps.get(key, p.payload, 0, 0, 1) is p
    assert ps.hits == 3 * PER_SLOT and len(ps) == PER_SLOT
    # only exactly those bytes, op code, flags and owner
    assert ps.get(key, kept[0].payload[:-1], 0, 0, 1) is None
    assert ps.get(key, kept[0].payload, 1, 0, 1) is None
    assert ps.get(key, kept[0].payload, 0, 4, 1) is None
    assert ps.get(key, kept[0].payload, 0, 0, 2) is None
    assert ps.get((0, 4), kept[0].payload, 0, 0, 1) is None


def test_the_least_recently_served_goes_first_and_a_new_owner_replaces_them_all() -> None:
    ps, key = PrimedSlots(), (1, 0)
    kept = [_primed(bytes([i]) * 8) for i in range(PER_SLOT)]
    for p in kept:
        ps.put(key, p)
    assert ps.get(key, kept[0].payload, 0, 0, 1) is kept[0]  # served: now the most recent
    newer = _primed(b"new" * 3)
    ps.put(key, newer)
    assert ps.get(key, kept[1].payload, 0, 0, 1) is None  # the least recently served went
    assert all(ps.get(key, p.payload, 0, 0, 1) is p for p in (kept[0], *kept[2:], newer))
    again = _primed(kept[0].payload)  # the same bytes validated again replace their entry
    ps.put(key, again)
    assert ps.get(key, kept[0].payload, 0, 0, 1) is again and len(ps) == PER_SLOT
    other = _primed(kept[2].payload, client=2)  # the slot changed hands
    ps.put(key, other)
    assert len(ps) == 1 and ps.get(key, kept[2].payload, 0, 0, 1) is None
    assert ps.get(key, kept[2].payload, 0, 0, 2) is other


def test_the_armed_entries_follow_the_slots_entries() -> None:
    ps, key = PrimedSlots(), (0, 7)
    fk = _frame_key(key)
    a, b = _primed(b"a" * 8), _primed(b"b" * 8)
    ps.put(key, a)
    ps.put(key, b)
    ex_a, ex_b = _express(key, a), _express(key, b)
    ps.arm(ex_a)
    ps.arm(ex_b)
    assert ps.express[fk] == (ex_b, ex_a)  # the last armed first
    ex_a2 = _express(key, a)  # the same entry armed again (a later lease generation, say): one per entry
    ps.arm(ex_a2)
    assert ps.express[fk] == (ex_a2, ex_b)
    ps.arm(_express(key, _primed(b"z" * 8)))  # not an entry of the slot: never armed
    assert ps.express[fk] == (ex_a2, ex_b)
    for i in range(PER_SLOT - 2):
        ps.put(key, _primed(bytes([i]) * 8))
    assert ps.express[fk] == (ex_a2, ex_b)  # more entries: the armed ones stay
    ps.put(key, _primed(b"new" * 3))  # one too many: the least recently served (a) goes, and its armed entry
    assert ps.get(key, a.payload, 0, 0, 1) is None and ps.express[fk] == (ex_b,)
    ps.put(key, _primed(b.payload))  # b's bytes validated again: its entry replaced, its armed one gone
    assert fk not in ps.express
    ps.arm(_express(key, ps.get(key, b.payload, 0, 0, 1)))  # type: ignore[arg-type]
    ps.forget(key)  # a request failed there: every entry and every armed one go
    assert len(ps) == 0 and fk not in ps.express


def test_a_region_dropped_takes_its_slots_entries_only() -> None:
    ps = PrimedSlots()
    ps.put((1, 0), _primed(b"x" * 8))
    ps.put((1, 1), _primed(b"y" * 8))
    ps.put((2, 0), _primed(b"z" * 8))
    ps.arm(_express((1, 0), ps.get((1, 0), b"x" * 8, 0, 0, 1)))  # type: ignore[arg-type]
    ps.drop_region(1)
    assert len(ps) == 1 and not ps.express and ps.get((2, 0), b"z" * 8, 0, 0, 1) is not None
