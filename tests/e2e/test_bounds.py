"""Bounds: one client or one request cannot freeze the worker or make it use unbounded memory.

Each test runs the attack against a real worker process over its real region and socket
(docs/reliability.md, "Bounds"): heavy work off the loop thread, plan memory refused before
it runs, oversized messages, HELLO floods, ACQUIRE floods, shared resident tensors, and
malformed frames. Orders between processes come from the worker's observable state.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import zmq
from wire import attach_hello, hello_body
from zmq.utils.monitor import recv_monitor_message

from shmrpc.client import (
    BusyError,
    Client,
    ClientLimitError,
    InvalidRequestError,
    Pipeline,
    RequestTooLargeError,
    Resident,
    ResourceError,
)
from shmrpc.schema import messages as m
from shmrpc.schema.errors import WIRE_CODES
from shmrpc.schema.naming import endpoint

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


# ------------------------------------------------------------ helpers


@contextmanager
def _dealer(name: str) -> Iterator[zmq.Socket]:
    """A raw DEALER on the worker's socket, speaking the protocol by hand."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint(name))
    try:
        yield s
    finally:
        s.close()
        ctx.term()


def _reply(s: zmq.Socket, timeout_s: float = 5.0) -> tuple[bytes, Any]:
    assert s.poll(int(timeout_s * 1000)), "no reply from the worker"
    frame = s.recv()
    return frame[:1], m.unpack_json(frame)


@contextmanager
def _session(name: str, **hello: Any) -> Iterator[tuple[zmq.Socket, dict[str, Any]]]:
    """A session opened by hand: HELLO on the attach socket, then a DEALER under the WELCOME's token."""
    kind, body = attach_hello(name, hello_body(**hello))
    assert kind[:1] == m.WELCOME, body
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTING_ID, str(body["token"]).encode())
    s.connect(endpoint(name))
    try:
        yield s, body
    finally:
        s.send(m.BYE)
        s.close(linger=1000)
        ctx.term()


def _status(name: str) -> dict[str, Any]:
    with _dealer(name) as s:
        s.send(m.STATUS)
        assert s.poll(5000), "the worker did not answer STATUS within 5 s (is its loop thread busy?)"
        return m.unpack_json(s.recv())  # type: ignore[no-any-return]


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


# ------------------------------------------------------------ work and memory from the plan


def test_heavy_request_runs_off_the_loop_thread(worker: WorkerProc) -> None:
    # 72 KiB of inputs (under the 256 KiB inline byte limit), about 51 GFLOP of work: x @ w is (N, N)
    n = 2048
    rng = np.random.default_rng(9)
    x = (rng.random((n, 4)) / n).astype(np.float32)
    w = rng.random((4, n)).astype(np.float32)
    v = rng.random((n, 1)).astype(np.float32)
    p = (Pipeline().then("gemm", outputs={"out": "a"})
         .then("gemm", inputs={"x": "a", "w": "a"}, outputs={"out": "b"})
         .then("gemm", inputs={"x": "b", "w": "a"}, outputs={"out": "c"})
         .then("gemm", inputs={"x": "c", "w": "a"}, outputs={"out": "d"})
         .then("gemm", inputs={"x": "d", "w": "v"}, outputs={"out": "y"}))
    with Client(worker.name, timeout_s=60) as a:
        fut = a.submit(p, x=x, w=w, v=v)
        deadline = time.monotonic() + 10
        while _status(worker.name)["in_flight"] == 0:  # STATUS is answered while the heavy request runs
            assert time.monotonic() < deadline, "the heavy request never showed in flight"
        with Client(worker.name, timeout_s=3, connect_timeout_s=3) as b:  # a new connection is served
            np.testing.assert_array_equal(b.call("vector_add", x=np.ones(8, np.float32),
                                                 y=np.ones(8, np.float32))["out"], 2.0)
        still_running = _status(worker.name)["in_flight"] == 1
        got = fut.result()["y"]
    m4 = w.astype(np.float64) @ x.astype(np.float64)  # y = x (w x)^3 (w v), computed the cheap way
    want = x @ np.linalg.matrix_power(m4, 3) @ (w.astype(np.float64) @ v)
    np.testing.assert_allclose(got, want, rtol=1e-3)
    assert still_running, "the heavy request finished before the other client was served: make it heavier"


def test_plan_memory_is_refused_before_it_runs(worker: WorkerProc) -> None:
    # (N, 1) x (1, N) then x v: 720 KiB in the slot, 13.4 GiB of intermediate at N = 60 000
    n = 60_000
    x = np.ones((n, 1), np.float32)
    w = np.ones((1, n), np.float32)
    v = np.ones((n, 1), np.float32)
    p = Pipeline().then("gemm", outputs={"out": "a"}).then("gemm", inputs={"x": "a", "w": "v"}, outputs={"out": "y"})
    with Client(worker.name, timeout_s=20) as c:
        with pytest.raises(ResourceError) as e:
            c.call(p, x=x, w=w, v=v)
        assert (e.value.op, e.value.step, e.value.field) == ("gemm", 0, "request_memory_limit")
        assert "--request-memory-limit" in e.value.message and "2.0 GiB" in e.value.message
        np.testing.assert_array_equal(c.call("vector_add", x=x[:4, 0], y=x[:4, 0])["out"], 2.0)
    assert _peak_rss_mib(worker.pid) < 1024, "the worker allocated the intermediate"


def test_request_memory_limit_names_the_step_that_crosses_it(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--request-memory-limit", "6M")
    n = 1024  # each (N, N) float32 is 4 MiB: step 0 fits, step 1 brings the request to 8 MiB
    x = np.ones((n, 1), np.float32)
    y = np.ones((1, n), np.float32)
    p = Pipeline().then("gemm", inputs={"x": "x", "w": "w"}, outputs={"out": "a"}) \
        .then("gemm", inputs={"x": "a", "w": "a"}, outputs={"out": "b"}) \
        .then("gemm", inputs={"x": "b", "w": "v"}, outputs={"out": "y"})
    with Client(w.name, timeout_s=20) as c:
        with pytest.raises(ResourceError) as e:
            c.call(p, x=x, w=y, v=x)
        assert (e.value.step, e.value.field) == (1, "request_memory_limit") and "6.0 MiB" in e.value.message
        one = Pipeline().then("gemm", outputs={"out": "a"}).then("gemm", inputs={"x": "a", "w": "v"},
                                                                  outputs={"out": "y"})
        np.testing.assert_array_equal(c.call(one, x=x, w=y, v=x)["y"], float(n))


# ------------------------------------------------------------ messages


def test_oversized_message_drops_the_peer(worker: WorkerProc) -> None:
    big = b"H" + b"\x00" * (4 << 20)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    mon = s.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)  # before connect: see every event
    try:
        s.connect(endpoint(worker.name))
        assert mon.poll(5000) and recv_monitor_message(mon)["event"] == zmq.EVENT_CONNECTED
        for _ in range(16):  # 64 MiB in all: none of it may be buffered by the worker
            s.send(big, copy=False)
        assert mon.poll(5000), "the worker kept the connection of a peer sending 4 MiB messages"
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        s.disable_monitor()
        mon.close()
        s.close()
        ctx.term()
    assert _peak_rss_mib(worker.pid) < 200
    with Client(worker.name, timeout_s=5) as c:
        np.testing.assert_array_equal(c.call("echo", x=np.arange(3))["out"], np.arange(3))


def test_multi_frame_and_deeply_nested_messages_get_a_typed_error(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker()
    deep = b"[" * 30_000 + b"]" * 30_000  # 60 KB: under the message bound, far over Python's recursion limit
    with _dealer(w.name) as s:
        s.send_multipart([m.STATUS, b"x", b"y"])
        kind, body = _reply(s)
        assert kind == m.ERROR and body["kind"] == "bad_message" and body["field"] == "frames"
        for frame in (m.HELLO + deep, m.HELLO + b'{"a":' * 10_000 + b"1" + b"}" * 10_000):
            kind, body = attach_hello(w.name, frame)  # HELLO is said on the attach socket
            assert kind[:1] == m.ERROR and body["kind"] == "bad_message", body
        with Client(w.name, timeout_s=5) as c:
            c._t.sock.send(m.MANAGE + deep)
            c._pump(time.monotonic() + 5, lambda: None in c._control)
            assert c._control.pop(None).kind == "bad_message"  # type: ignore[attr-defined]
            c._t.sock.send(m.ACQUIRE + deep)
            c._pump(time.monotonic() + 5, lambda: None in c._control)
            assert c._control.pop(None).kind == "bad_message"  # type: ignore[attr-defined]
    assert w.stop() == 0
    assert "Traceback" not in w.stderr and "unexpected error" not in w.stderr, w.stderr


# ------------------------------------------------------------ clients


def test_hello_flood_is_capped_per_uid_with_a_typed_error(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--max-clients-per-uid", "5", lease="4,1,0,0")
    welcomed, refused = [], []
    for _ in range(20):  # 20 HELLOs of one uid
        kind, body = attach_hello(w.name, hello_body())
        (welcomed if kind[:1] == m.WELCOME else refused).append(body)
    state = _status(w.name)
    assert len(welcomed) == 5 and len(state["clients"]) == 5
    assert all(b["kind"] == "too_many_clients" and WIRE_CODES[b["code"]] is BusyError for b in refused)
    assert "--max-clients-per-uid" in refused[0]["message"]
    with pytest.raises(ClientLimitError):
        Client(w.name, connect_timeout_s=5)
    ctx = zmq.Context()
    try:
        for b in welcomed:  # end each session under its token
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.ROUTING_ID, str(b["token"]).encode())
            d.connect(endpoint(w.name))
            d.send(m.BYE)
            d.close(linger=1000)
    finally:
        ctx.term()
    deadline = time.monotonic() + 5
    while _status(w.name)["clients"]:
        assert time.monotonic() < deadline
    with Client(w.name, timeout_s=5) as c:  # room again once they are gone
        assert c.call("echo", x=np.ones(2))["out"].tolist() == [1.0, 1.0]


def test_max_clients_caps_every_uid_together(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--max-clients", "2")
    with Client(w.name) as a, Client(w.name) as b:
        with pytest.raises(ClientLimitError) as e:
            Client(w.name, connect_timeout_s=5)
        assert "--max-clients" in str(e.value)
        assert a.client_id != b.client_id


def test_private_region_is_sized_to_the_lease_asked_for(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--lease-max", "4,1,1,0", lease="2,0,0,0")
    with Client(w.name) as small, Client(w.name, lease=(4, 1, 1)) as big, Client(w.name, lease=(99, 99, 99, 99)) as greedy:
        regions = {r["owner"]: r["nbytes"] for r in _status(w.name)["regions"] if r["owner"] is not None}
        page = 4096
        assert regions[small.client_id] == page + 2 * (64 << 10)
        assert regions[big.client_id] == page + 4 * (64 << 10) + (1 << 20) + (4 << 20)
        assert regions[greedy.client_id] == regions[big.client_id]  # capped at --lease-max
        assert sorted(s.nbytes for s in small._slots.free) == [64 << 10] * 2
        x = np.arange(300_000, dtype=np.float32)  # 1.2 MB: borrowed from the pool by the small client
        np.testing.assert_array_equal(small.call("echo", x=x)["out"], x)
    for bad in ("4", [-1], [1.5], [True], [[1]], {"0": 1}):
        kind, body = attach_hello(w.name, hello_body(lease=bad))
        assert kind[:1] == m.ERROR and (body["kind"], body["field"]) == ("bad_message", "lease"), bad


# ------------------------------------------------------------ ACQUIRE


def test_acquire_refuses_bad_sizes_and_bounds_waiters(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--client-max-waiters", "3", slots="64K:2,1M:1", lease="1,0")
    with Client(w.name, timeout_s=10) as holder, _session(w.name) as (s, _):
        for nbytes in (-5, 0):
            s.send(m.pack_json(m.ACQUIRE, {"nbytes": nbytes, "wait_s": 1}))
            kind, body = _reply(s)
            assert kind == m.ERROR and WIRE_CODES[body["code"]] is InvalidRequestError and body["field"] == "nbytes"
        s.send(m.pack_json(m.ACQUIRE, {"nbytes": 1 << 30}))
        kind, body = _reply(s)
        assert WIRE_CODES[body["code"]] is RequestTooLargeError and body["field"] == "nbytes"
        loan = holder.loan(200_000)  # the only 1M slot
        for _ in range(1000):  # a flood of long waits: 3 queue, the rest are refused at once
            s.send(m.pack_json(m.ACQUIRE, {"nbytes": 500_000, "wait_s": 3600}))
        for _ in range(997):
            kind, body = _reply(s)
            assert kind == m.ERROR and WIRE_CODES[body["code"]] is BusyError and "--client-max-waiters" in body["message"]
        assert _status(w.name)["pending_acquires"] == 3
        loan.release()  # the slot frees: the first waiter gets it
        kind, body = _reply(s)
        assert kind == m.GRANT and body["slot_nbytes"] == 1 << 20
        s.send(m.SLOT_STRUCT.pack(m.RELEASE, body["region"], body["slot"]))
        assert _reply(s)[0] == m.GRANT  # and the next one, in order
        assert not s.poll(200)
        assert _status(w.name)["pending_acquires"] == 1


# ------------------------------------------------------------ shared resident tensors

_PUBLISHER = """
import sys, time, numpy as np
from shmrpc.client import Client
c = Client(sys.argv[1], timeout_s=10)
c.put("pub", np.full(256, 3.0, np.float32), shared=True)
print("ready", flush=True)
time.sleep(600)
"""


def test_shared_tensors_have_an_owner_and_go_with_it(worker: WorkerProc) -> None:
    pub = subprocess.Popen([sys.executable, "-c", _PUBLISHER, worker.name], stdout=subprocess.PIPE, text=True)
    try:
        assert pub.stdout is not None and pub.stdout.readline().strip() == "ready"
        with Client(worker.name, timeout_s=10) as other:
            np.testing.assert_array_equal(other.call("vector_add", x=np.ones(256, np.float32),
                                                     y=Resident("shared/pub"))["out"], 4.0)  # anyone may read
            with pytest.raises(InvalidRequestError) as e:
                other.put("pub", np.zeros(256, np.float32), shared=True)  # nobody else may replace
            assert (e.value.tensor, e.value.field) == ("shared/pub", "keep")
            with pytest.raises(InvalidRequestError) as e:
                other.drop("shared/pub")  # nor drop
            assert (e.value.tensor, e.value.field) == ("shared/pub", "resident")
            np.testing.assert_array_equal(other.call("vector_add", x=np.ones(256, np.float32),
                                                     y=Resident("shared/pub"))["out"], 4.0)
            pub.send_signal(signal.SIGKILL)
            pub.wait(10)
            deadline = time.monotonic() + 5
            while "shared/pub" in _status(worker.name)["resident"]:  # dropped with its dead owner
                assert time.monotonic() < deadline, "a dead client's shared tensor stayed"
            other.put("pub", np.zeros(256, np.float32), shared=True)  # the name is free again
            other.drop("shared/pub")
            assert "shared/pub" not in other.resident()
    finally:
        pub.kill()
        pub.communicate(timeout=10)  # also closes its stdout pipe
