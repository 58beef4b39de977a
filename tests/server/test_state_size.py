"""STATE fits the one packet the attach socket carries: the clients' slot lists give way to their counts."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from shmrpc.schema.control import State
from shmrpc.server._loop import _STATE_MAX_NBYTES, Worker


def _state(n_clients: int, n_slots: int) -> dict[str, Any]:
    return {"name": "w", "pid": 1, "uptime_s": 1.0, "backend": "numpy", "socket": "w.sock", "regions": [],
            "clients": [{"id": i, "pid": 100 + i, "uid": 0, "connected_s": 1.0,
                         "slots": [[1 + i, j, 65536, False, 0] for j in range(n_slots)]} for i in range(n_clients)],
            "slots_leased": n_clients * n_slots, "in_flight": 0, "pending_acquires": 0, "counters": {},
            "resident": {}}


def _encoded(state: dict[str, Any]) -> bytes:
    stub = SimpleNamespace(sessions=SimpleNamespace(state=lambda: state), health=lambda: (True, ""))
    return Worker._state(stub)  # type: ignore[arg-type]


def test_a_small_state_is_sent_whole() -> None:
    got = State.decode(_encoded(_state(2, 3))).to_json()
    assert got["clients"][1]["slots"] == [[2, j, 65536, False, 0] for j in range(3)] and "truncated" not in got
    assert got["health"] == "ok"


def test_a_state_too_large_for_one_packet_counts_the_clients_slots_instead() -> None:
    frame = _encoded(_state(64, 600))  # 64 clients with a lease of 600 slots each: over a MiB listed
    assert len(frame) <= _STATE_MAX_NBYTES
    got = State.decode(frame).to_json()
    assert got["truncated"] is True and [c["slots"] for c in got["clients"]] == [600] * 64
    assert [c["pid"] for c in got["clients"]] == [100 + i for i in range(64)]


def test_status_prints_a_state_cut_to_fit_its_packet() -> None:
    # `shmrpc status`'s text took the clients' slot lists for granted: a state cut to counts made it fail (TypeError)
    # where --json and -q worked
    from shmrpc.server.cli import status_text

    state = _state(64, 600)
    state["clients"][0]["slots"][5][4] = 7  # one request in flight
    got = State.decode(_encoded(state)).to_json()
    lines = status_text(got)
    clients = [ln for ln in lines if ln.startswith("  client ")]
    assert len(clients) == 64
    assert clients[0] == "  client 0 pid 100 uid 0: 600 slots, 1 in flight", clients[0]
    assert clients[1] == "  client 1 pid 101 uid 0: 600 slots, 0 in flight", clients[1]
    whole = status_text(State.decode(_encoded(_state(2, 3))).to_json())
    assert "  client 1 pid 101 uid 0: 3 slots, 0 in flight" in whole
