"""Lanes (schema/lane.py): the opt-in doorbell beside ZeroMQ, against real worker processes.

Each test checks answers against NumPy, and that nothing is lost when a side cannot use
the lane: a worker that grants none, requests in flight beside a lane call, a worker
that dies while a lane call waits, a client that dies with a lane call in the worker,
and a page written with garbage by its client.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from wire import wait_for_state

from shmrpc.client import Client, KernelError, UnknownOpError, WorkerGoneError
from shmrpc.schema import lane as L
from shmrpc.schema import messages as m
from shmrpc.schema.errors import RequestError

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@pytest.mark.parametrize("mode", ["block", "spin"])
def test_lane_calls_are_answered_like_zeromq_ones(worker: WorkerProc, mode: str) -> None:
    rng = np.random.default_rng(12)
    with Client(worker.name, lane=mode, spin_us=50) as c:
        assert c._t.lane is not None
        with c.loan(4096) as req:
            x = req.array("x", (16,), np.float32)
            y = req.array("y", (16,), np.float32)
            for _ in range(200):
                a, b = rng.standard_normal(16, dtype=np.float32), rng.standard_normal(16, dtype=np.float32)
                x[...], y[...] = a, b
                np.testing.assert_array_equal(req.send("vector_add")["out"], a + b)
        for n in (1, 7, 1000):
            a = rng.standard_normal(n)
            np.testing.assert_allclose(c.call("scale", x=a, a=2.0, b=1.0)["out"], 2 * a + 1)
        # an error travels the lane as it travels ZeroMQ: typed, naming the field
        with pytest.raises(KernelError) as e:
            c.call("vector_add", x=np.ones(3), y=np.ones(4))
        assert e.value.op == "vector_add" and e.value.tensor == "y"
        with pytest.raises(UnknownOpError):
            c.call("no_such_op", x=np.ones(3))
        assert c._t.lane.seq > 200  # the calls above went through the lane


def test_a_worker_without_lanes_serves_the_client_over_zeromq(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--no-lanes")
    with Client(w.name, lane="block") as c:
        assert c._t.lane is None
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(3), y=np.ones(3))["out"], 2.0)


def test_requests_in_flight_beside_a_lane_call_go_over_zeromq(worker: WorkerProc) -> None:
    with Client(worker.name, lane="block") as c:
        futs = [c.submit("scale", x=np.full(8, float(i)), a=3.0, b=0.0) for i in range(3)]
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(2), y=np.ones(2))["out"], 2.0)
        for i, f in enumerate(futs):
            np.testing.assert_array_equal(f.result(10)["out"], 3.0 * i)
        assert c._t.lane is not None and c._t.lane.busy == 0


def test_a_worker_that_dies_fails_a_waiting_lane_call_at_once(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker()
    with Client(w.name, lane="block", timeout_s=30) as c:
        c.call("vector_add", x=np.ones(2), y=np.ones(2))
        os.kill(w.pid, signal.SIGSTOP)  # the lane call below waits on a worker that cannot answer ...
        killer = threading.Timer(0.3, os.kill, (w.pid, signal.SIGKILL))  # ... until it dies
        t0 = time.monotonic()
        killer.start()
        try:
            with pytest.raises(WorkerGoneError):
                c.call("vector_add", x=np.ones(2), y=np.ones(2))
        finally:
            killer.join()
        assert time.monotonic() - t0 < 5  # the pidfd, not the 30 s timeout
    w.proc.wait(5)
    w2 = spawn_worker()  # same name: removes the dead predecessor's sockets, and serves lanes again
    with Client(w2.name, lane="block") as c2:
        np.testing.assert_array_equal(c2.call("vector_add", x=np.ones(2), y=np.ones(2))["out"], 2.0)


def test_a_spinning_lane_that_waited_long_wakes_for_a_sooner_answer_and_a_dying_worker(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    # an answer that came after the spin budget makes the next wait sleep through most of the same time: an
    # answer that comes sooner still wakes it (its eventfd), and so does the worker's death (its pidfd)
    w = spawn_worker()
    x = np.ones(2)
    with Client(w.name, lane="spin", spin_us=50, timeout_s=30) as c:
        c.call("vector_add", x=x, y=x)
        os.kill(w.pid, signal.SIGSTOP)
        threading.Timer(0.6, os.kill, (w.pid, signal.SIGCONT)).start()
        np.testing.assert_array_equal(c.call("vector_add", x=x, y=x)["out"], 2.0)  # answered after ~0.6 s
        t0 = time.monotonic()
        np.testing.assert_array_equal(c.call("vector_add", x=x, y=x)["out"], 2.0)
        assert time.monotonic() - t0 < 0.4  # the answer woke it, not the ~0.5 s it expected
        c.call("vector_add", x=x, y=x)  # fast again: back to spinning from the ring
        os.kill(w.pid, signal.SIGSTOP)
        threading.Timer(0.6, os.kill, (w.pid, signal.SIGCONT)).start()
        c.call("vector_add", x=x, y=x)
        os.kill(w.pid, signal.SIGSTOP)
        killer = threading.Timer(0.1, os.kill, (w.pid, signal.SIGKILL))
        t0 = time.monotonic()
        killer.start()
        try:
            with pytest.raises(WorkerGoneError):
                c.call("vector_add", x=x, y=x)  # dies while the lane sleeps toward its expected answer
        finally:
            killer.join()
        assert time.monotonic() - t0 < 0.45  # the pidfd, not the expected ~0.5 s nor the 30 s timeout
    w.proc.wait(5)
    w2 = spawn_worker()  # same name: removes the dead predecessor's sockets
    with Client(w2.name, lane="spin") as c2:
        np.testing.assert_array_equal(c2.call("vector_add", x=x, y=x)["out"], 2.0)


_CHILD = textwrap.dedent("""
    import os, sys, numpy as np
    from shmrpc.client import Client
    c = Client(sys.argv[1], lane="block")
    c.call("vector_add", x=np.ones(2), y=np.ones(2))
    print("ready", flush=True)
    os._exit(0)  # gone without BYE: the worker must notice by its pidfd
""")


def test_a_client_that_dies_with_a_lane_is_noticed_and_its_lane_dropped(worker: WorkerProc) -> None:
    out = subprocess.run([sys.executable, "-c", _CHILD, worker.name], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "ready", out.stderr
    wait_for_state(worker.name, lambda s: not s["clients"], "the dead client's session ended")
    with Client(worker.name, lane="block") as c:  # and the worker still serves lanes
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(2), y=np.ones(2))["out"], 2.0)


@pytest.mark.parametrize("mode", ["block", "spin"])
def test_threads_sharing_a_lane_client_each_get_their_own_answer(worker: WorkerProc, mode: str) -> None:
    # the lane carries one request at a time; a thread that rings while another's answer sits unread in the page
    # must leave it to its waiter (it goes over ZeroMQ), not collect it and ring over it: the waiter would then
    # read the other's DONE (RequestError) or sleep through the wake-up its eventfd had for both (Timeout)
    errors: list[str] = []
    carried = [0]
    with Client(worker.name, lane=mode, spin_us=20, timeout_s=10) as c:
        lane = c._t.lane
        assert lane is not None
        ring = lane.ring

        def counted(frame: bytes, rid: int, sleeper: bool = False) -> None:
            carried[0] += 1
            ring(frame, rid, sleeper)

        lane.ring = counted  # type: ignore[method-assign]

        def run(k: int) -> None:
            try:
                with c.loan(4096) as req:
                    x, y = req.array("x", (8,), np.float32), req.array("y", (8,), np.float32)
                    for i in range(400):
                        x[...], y[...] = i, k
                        np.testing.assert_array_equal(req.send("vector_add")["out"], i + k)
            except Exception as e:  # noqa: BLE001 - reported below with the others
                errors.append(repr(e))

        # a spinning waiter holds the GIL for the whole switch interval, and on a busy machine every request could then
        # be answered before another thread rings: a short interval, and up to three rounds, so that some ring finds the
        # lane taken (the case under test)
        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)
        try:
            for rounds in range(1, 4):
                threads = [threading.Thread(target=run, args=(k,)) for k in range(3)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(50)
                assert not errors, errors[:3]
                if carried[0] < 1200 * rounds:
                    break
        finally:
            sys.setswitchinterval(switch)
        assert 0 < carried[0] < 1200 * rounds  # some went through the lane, the rest over ZeroMQ
        assert not lane.busy and not lane.waiting
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(2), y=np.ones(2))["out"], 2.0)


def test_a_lane_answer_for_another_request_or_not_a_done_is_refused(worker: WorkerProc) -> None:
    # the page is shared with the worker: the client checks what it reads there before it routes it
    with Client(worker.name, lane="block", timeout_s=10) as c, c.loan(4096) as req:
        lane = c._t.lane
        assert lane is not None
        req.array("x", (4,), np.float32)[...] = 1
        np.testing.assert_array_equal(req.send("echo")["out"], 1)
        rid, s = 7, req._s
        done_seq = L.seq_word(lane._map, L.DONE_SEQ)  # the worker's half of the page, written here as it would
        bad = (m.pack_done(s.region, s.index, rid + 1, 0), b"\x00" * 5, m.pack_call(0, 0, rid, 1)[:13],
               m.pack_call(0, 0, rid, 1)[:14])  # another request's DONE, too short, a CALL cut short, a CALL
        for frame in bad:
            lane.busy = rid
            L.post(lane.page, done_seq, L.DONE_SEQ, lane.seq, frame)
            with pytest.raises(RequestError) as ei:
                c._lane_wait(lane, time.monotonic() + 5)
            assert ei.value.field == "lane", frame
            assert lane.busy == 0  # that answer is taken: the lane is free again
        c._inflight.add(rid, s)
        s.in_flight = rid
        lane.busy = rid
        L.post(lane.page, done_seq, L.DONE_SEQ, lane.seq, m.pack_done(s.region, s.index, rid, 0))
        c._lane_wait(lane, time.monotonic() + 5)  # its own DONE: routed, the slot answered
        assert rid not in c._inflight and s.in_flight is None and s.status == 0
        del done_seq  # it exports the page's buffer: gone before the client unmaps it


@pytest.mark.parametrize("spin_us", ["0", "300"])  # a spinning worker reads the page inside its spin
def test_garbage_in_the_lane_page_never_stops_the_worker(spawn_worker: Callable[..., WorkerProc], spin_us: str) -> None:
    worker = spawn_worker("--spin-us", spin_us)
    rng = np.random.default_rng(7)
    with Client(worker.name, lane="block") as c:
        lane = c._t.lane
        assert lane is not None
        for i in range(300):
            # a call_seq that changes, over a length and a frame of random bytes
            L.LEN.pack_into(lane.page, L.CALL_LEN, int(rng.integers(0, 1 << 32)) if i % 3 else int(rng.integers(0, 65)))
            lane.page[L.CALL_FRAME:L.CALL_FRAME + 64] = rng.bytes(64)
            # and garbage in the words of the early ring and the early wake (the worker's own: a client can write it)
            for word in (L.CALL_SOON, L.TAKEN_SEQ):
                L.SEQ.pack_into(lane.page, word, int(rng.integers(0, 1 << 64, dtype=np.uint64)))
            L.SEQ.pack_into(lane.page, L.CALL_SEQ, int(rng.integers(0, 1 << 64, dtype=np.uint64)))
            os.eventfd_write(lane.doorbell_fd, 1)
        lane.seq = L.SEQ.unpack_from(lane.page, L.CALL_SEQ)[0]  # go on from what the page holds now
        time.sleep(0)
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(2), y=np.ones(2))["out"], 2.0)
    with Client(worker.name) as c2:
        np.testing.assert_array_equal(c2.call("vector_add", x=np.ones(2), y=np.ones(2))["out"], 2.0)


_BUSY_CHILD = textwrap.dedent("""
    import sys, numpy as np
    from shmrpc.client import Client
    rng = np.random.default_rng(int(sys.argv[2]))
    with Client(sys.argv[1], lane=sys.argv[3]) as c, c.loan(4096) as req:
        x, y = req.array("x", (8,), np.float32), req.array("y", (8,), np.float32)
        for i in range(int(sys.argv[4])):
            a, b = rng.standard_normal(8, dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
            x[...], y[...] = a, b
            out = req.send("vector_add")["out"]
            assert np.array_equal(out, a + b), (i, out, a + b)
        assert c._t.lane is not None and c._t.lane.seq == int(sys.argv[4])
    print("ok", flush=True)
""")


@pytest.mark.parametrize("mode", ["block", "spin"])
def test_several_clients_ring_their_lanes_at_once(worker: WorkerProc, mode: str) -> None:
    # one doorbell for every lane: each request is taken once, answered in its own page (600 each, past byte
    # boundaries of the seq words)
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY_CHILD, worker.name, str(20261130 + k), mode, "600"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=50)
        assert p.returncode == 0 and out.strip() == "ok", err[-2000:]


_VICTIM_CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from shmrpc.client import Client
    c = Client(sys.argv[1], lane=sys.argv[2] or None)
    c.call("echo", x=np.zeros(4))
    print("ready", flush=True)
    time.sleep(60)
""")


def _a_client_dies(name: str, lane: str | None, clients: int) -> None:
    """Start a client (with ``lane``) that makes one call and waits; once the worker counts ``clients`` sessions,
    SIGKILL it and wait until the worker has ended its session."""
    victim = subprocess.Popen([sys.executable, "-c", _VICTIM_CHILD, name, lane or ""], stdout=subprocess.PIPE,
                              text=True)
    assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
    wait_for_state(name, lambda st: len(st["clients"]) == clients, f"{clients} clients")
    victim.kill()
    victim.communicate(timeout=10)  # also closes its pipe
    wait_for_state(name, lambda st: len(st["clients"]) == clients - 1, "the killed client's session ended")


_HAMMER_CHILD = textwrap.dedent("""
    import os, sys, numpy as np
    from shmrpc.client import Client
    rng = np.random.default_rng(7)
    n = 0
    with Client(sys.argv[1], lane="spin", spin_us=1000, timeout_s=30) as c, c.loan(4096) as req:
        x, y = req.array("x", (8,), np.float32), req.array("y", (8,), np.float32)
        while not os.path.exists(sys.argv[2]):
            a, b = rng.standard_normal(8, dtype=np.float32), rng.standard_normal(8, dtype=np.float32)
            x[...], y[...] = a, b
            out = req.send("vector_add")["out"]
            assert np.array_equal(out, a + b), (n, out, a + b)
            n += 1
            if n == 200:
                print("ready", flush=True)
        assert c._t.lane is not None and c._t.lane.seq == n
    print("ok", n, flush=True)
""")


def test_a_lane_kept_busy_leaves_the_spinning_worker_serving_everything_else(
        spawn_worker: Callable[..., WorkerProc], tmp_path: Path) -> None:
    # a lane client sending without a pause: its requests are served inside the spinning loop's spin, and the loop
    # must still turn: ZeroMQ calls answered, STATE answered, a client that dies seen, all while the lane is busy
    w = spawn_worker("--spin-us", "300")
    stop = tmp_path / "stop"
    hammer = subprocess.Popen([sys.executable, "-c", _HAMMER_CHILD, w.name, str(stop)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert hammer.stdout is not None and hammer.stdout.readline().strip() == "ready"
        rng = np.random.default_rng(9)
        with Client(w.name, timeout_s=30) as c:  # no lane: over ZeroMQ
            for _ in range(50):
                a = rng.standard_normal(8)
                np.testing.assert_allclose(c.call("scale", x=a, a=3.0)["out"], 3 * a)
            _a_client_dies(w.name, None, clients=3)
            np.testing.assert_allclose(c.call("scale", x=np.ones(3), a=2.0)["out"], 2.0)
            assert hammer.poll() is None, "the lane client stopped before the checks were done"
    finally:
        stop.touch()
        out, err = hammer.communicate(timeout=30)
    assert hammer.returncode == 0 and out.split()[0] == "ok", err[-2000:]
    assert int(out.split()[1]) > 200  # its lane stayed busy through the checks


def test_a_spinning_worker_serves_lanes_zeromq_and_a_dying_client(spawn_worker: Callable[..., WorkerProc]) -> None:
    # the spinning loop reads the lanes' seq words between its polls: ZeroMQ calls, other lanes and a client
    # that dies must still be seen while it spins on them
    w = spawn_worker("--spin-us", "300")
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY_CHILD, w.name, str(20261201 + k), mode, "400"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, mode in enumerate(("block", "spin"))]
    rng = np.random.default_rng(5)
    with Client(w.name, timeout_s=30) as c:  # no lane: every call over ZeroMQ, beside the lanes' traffic
        for _ in range(100):
            a = rng.standard_normal(8)
            np.testing.assert_allclose(c.call("scale", x=a, a=3.0)["out"], 3 * a)
        for p in procs:
            out, err = p.communicate(timeout=50)
            assert p.returncode == 0 and out.strip() == "ok", err[-2000:]
        _a_client_dies(w.name, "spin", clients=2)  # its pidfd was seen by the spinning loop
        np.testing.assert_allclose(c.call("scale", x=np.ones(3), a=2.0)["out"], 2.0)
