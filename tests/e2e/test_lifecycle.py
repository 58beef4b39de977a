"""Process lifecycles: drain on SIGTERM, client death, worker death and restart, handshake, status, metrics."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from wire import attach_hello, hello_body, slow_pipeline, wait_in_flight

from shmrpc.client import (
    Client,
    ConnectError,
    ForkedClientError,
    KernelError,
    Loan,
    ProtocolMismatchError,
    Timeout,
    WorkerGoneError,
)
from shmrpc.schema import messages as m
from shmrpc.schema.naming import attach_path, lock_path, region_prefix, socket_path

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

PROCS = str(Path(__file__).with_name("procs.py"))
#: A client's patience in the tests of a dying worker, and the bound its calls must beat: "fails fast" means
#: well before the timeout (the pidfd), with room for a loaded machine; not a latency claim (see bench/).
TIMEOUT_S = 60.0
FAST_S = 20.0


def _regions(name: str) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(region_prefix(name))]




@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_drains_in_flight_then_cleans_up(worker: WorkerProc, sig: int) -> None:
    # SIGHUP's default action killed the worker: the request in flight got WorkerGoneError, and the lock file and both
    # sockets stayed behind. It has no other meaning for the worker (no reload): it stops as on SIGTERM
    with Client(worker.name, timeout_s=60) as c:
        fut = c.submit(slow_pipeline(), x=np.ones(3_500_000))  # 28 MB through 20 steps: runs in the executor
        wait_in_flight(worker.name)
        worker.proc.send_signal(sig)
        np.testing.assert_array_equal(fut.result()["19.out"], 1.0)  # answered, not dropped
    assert worker.proc.wait(20) == 0
    assert not socket_path(worker.name).exists() and not attach_path(worker.name).exists()
    assert not lock_path(worker.name).exists()
    assert _regions(worker.name) == []


def test_a_worker_that_closes_connections_unanswered_is_a_connect_error_in_time(worker_name: str) -> None:
    # a worker flooded with connections closes some before their HELLO: the client connects again until its connect
    # timeout, then says so as a ConnectError (it raised a bare ConnectionResetError or BlockingIOError)
    import socket
    import threading

    path = attach_path(worker_name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(8)
    accepted = []
    stop = threading.Event()

    def close_each() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            conn.close()

    t = threading.Thread(target=close_each)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectError, match="did not take the connection in time") as e:
            Client(worker_name, connect_timeout_s=0.5)
        assert 0.4 < time.monotonic() - t0 < 5.0 and len(accepted) > 1, (time.monotonic() - t0, len(accepted))
        assert e.value.path == str(path)
    finally:
        stop.set()
        t.join(10)
        listener.close()
        path.unlink()


def test_connect_to_missing_worker_is_a_connect_error(worker_name: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match="no worker named") as e:
        Client(worker_name, connect_timeout_s=30)
    assert time.monotonic() - t0 < 1.0, "a missing socket must fail at once, not after the connect timeout"
    assert str(attach_path(worker_name)) in str(e.value) and "shmrpc serve --name" in str(e.value)


def test_client_killed_mid_request_slots_come_back_zeroed(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker(slots="64K:4", lease="4")
    p = subprocess.Popen([sys.executable, PROCS, "victim", w.name], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().startswith("ready")
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    p.stdout.close()
    t0 = time.monotonic()
    with Client(w.name, timeout_s=10) as c:  # every slot was the victim's; they must come back
        with c.loan(1000) as req:
            seen = req.array("x", 1000, np.uint8).copy()
        np.testing.assert_array_equal(c.call("scale", x=np.ones(10), a=3.0)["out"], 3.0)
    assert time.monotonic() - t0 < 2.5
    assert not (seen == 0xAB).any(), "a reclaimed slot was not zeroed"


def test_worker_killed_pending_call_fails_fast_then_restart_cleans(spawn_worker: Callable[..., WorkerProc],
                                                                   worker_name: str) -> None:
    w = spawn_worker()
    c = Client(w.name, timeout_s=TIMEOUT_S)
    fut = c.submit(slow_pipeline(), x=np.ones(3_500_000))  # 28 MB through 20 steps
    wait_in_flight(w.name)
    os.kill(w.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerGoneError):
        fut.result()
    assert time.monotonic() - t0 < FAST_S, "the pending call waited for its timeout instead of seeing the worker die"
    t0 = time.monotonic()
    with pytest.raises(WorkerGoneError):
        c.call("echo", x=np.ones(4))
    assert time.monotonic() - t0 < FAST_S
    c.close()
    w.proc.wait(5)
    # regions are memfds: a SIGKILL leaves nothing in /dev/shm; the sockets stay for the successor to remove
    assert _regions(worker_name) == []
    assert socket_path(worker_name).exists() and attach_path(worker_name).exists()
    with pytest.raises(ConnectError, match="no worker listens"):
        Client(worker_name, connect_timeout_s=5)
    w2 = spawn_worker()  # same name: finds the dead predecessor's lock, removes its sockets
    assert _regions(worker_name) == []
    with Client(w2.name, timeout_s=10) as c2:
        np.testing.assert_array_equal(c2.call("echo", x=np.arange(5))["out"], np.arange(5))


def test_schema_mismatch_refused_at_connect(worker: WorkerProc, monkeypatch: pytest.MonkeyPatch) -> None:
    frame, body = attach_hello(worker.name, hello_body(schema_hash="0" * 16))
    assert frame[:1] == m.ERROR and body["kind"] == "protocol_mismatch" and body["field"] == "schema_hash"
    import shmrpc.client._attach as transport

    monkeypatch.setattr(transport, "SCHEMA_HASH", "f" * 16)
    with pytest.raises(ProtocolMismatchError):
        Client(worker.name, connect_timeout_s=5)


def _use_in_child(c: Client, q: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        c.call("echo", x=np.ones(2))
        q.put("no error")
    except ForkedClientError as e:
        q.put(f"ForkedClientError: {e}")


def test_forked_child_is_told_to_reconnect(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_use_in_child, args=(c, q))
        p.start()
        msg = q.get(timeout=20)
        p.join(10)
        assert msg.startswith("ForkedClientError") and "create its own Client" in msg
        np.testing.assert_array_equal(c.call("echo", x=np.ones(2))["out"], 1.0)  # the parent is unaffected


_DROP_UNCLOSED = """
import gc, os, sys
import numpy as np
from shmrpc.client import Client
fds = []
for _ in range(4):
    c = Client(sys.argv[1], timeout_s=10)  # never closed: dropped and collected, as a finished task's would be
    assert c.call("scale", x=np.arange(3.0), a=2.0)["out"].tolist() == [0.0, 2.0, 4.0]
    del c
    gc.collect()
    fds.append(len(os.listdir("/proc/self/fd")))
print("ok", *fds)
"""


def test_a_client_collected_unclosed_neither_hangs_the_process_nor_leaves_its_fds(worker: WorkerProc) -> None:
    # Before: the collector could finalize the client's ZeroMQ context before its socket, and pyzmq's
    # Context.__del__ then waited in term() for that socket forever (the next Client(...) or gc pass hung).
    p = subprocess.run([sys.executable, "-c", _DROP_UNCLOSED, worker.name], capture_output=True, text=True,
                       timeout=30)
    assert p.returncode == 0, p.stderr
    words = p.stdout.split()
    assert words[0] == "ok", p.stdout
    fds = [int(w) for w in words[1:]]
    assert fds[-1] == fds[0], f"fds grew with each client dropped: {fds}"


def _steady_use_in_child(c: Client, req: Loan, q: mp.Queue) -> None:  # type: ignore[type-arg]
    for what, use in (("call", lambda: c.call("echo", x=np.ones(2))), ("send", lambda: req.send("echo"))):
        try:
            use()
            q.put(f"{what}: no error")
        except ForkedClientError:
            q.put(f"{what}: ForkedClientError")


def test_a_forked_child_is_told_on_the_steady_paths_too(worker: WorkerProc) -> None:
    # call() of a signature already planned, and a loan sent again, test for a fork without a call of their own
    with Client(worker.name, timeout_s=10) as c, c.loan(4096) as req:
        req.array("x", 2, np.float64)[:] = 3.0
        for _ in range(2):
            np.testing.assert_array_equal(c.call("echo", x=np.ones(2))["out"], 1.0)
            np.testing.assert_array_equal(req.send("echo")["out"], 3.0)
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=_steady_use_in_child, args=(c, req, q))
        p.start()
        got = [q.get(timeout=20), q.get(timeout=20)]
        p.join(10)
        assert got == ["call: ForkedClientError", "send: ForkedClientError"]
        np.testing.assert_array_equal(c.call("echo", x=np.ones(2))["out"], 1.0)  # the parent is unaffected
        np.testing.assert_array_equal(req.send("echo")["out"], 3.0)


def test_timeout_is_a_timeout_error(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        fut = c.submit(slow_pipeline(), x=np.ones(3_500_000))
        wait_in_flight(worker.name)
        with pytest.raises(Timeout) as e:  # what the call raised is both shmrpc's Timeout and a TimeoutError
            fut.result(timeout=0.001)
        assert isinstance(e.value, TimeoutError)
        assert e.value.op == "scale" and str(e.value).endswith("(op 'scale')")  # the pipeline's first step
        fut.result()  # the request still completes; the slot is not reused meanwhile


def test_a_futures_and_an_async_calls_timeout_name_the_op(worker: WorkerProc) -> None:
    # a future past its own deadline and an AsyncClient call past its timeout say which op got no answer, as a
    # blocking call's Timeout does (their Timeout once had op "" and no op in the message); the worker is stopped
    # while they wait, so no answer can come in time on any machine
    import asyncio

    from shmrpc.client import AsyncClient

    x = np.ones(4)
    with Client(worker.name, timeout_s=60) as c:
        c.call("scale", x=x, a=2.0, b=0.0)  # the signature planned: the timed call below asks the worker nothing first
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            with pytest.raises(Timeout) as e:
                c.submit("scale", x=x, a=2.0, b=0.0, timeout_s=0.1).result()
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert e.value.op == "scale" and str(e.value).endswith("(op 'scale')"), e.value

    async def run_async() -> Timeout:
        async with await AsyncClient.connect(worker.name, timeout_s=60) as ac:
            await ac.call("scale", x=x, a=2.0, b=0.0)
            os.kill(worker.pid, signal.SIGSTOP)
            try:
                with pytest.raises(Timeout) as e:
                    await ac.call("scale", x=x, a=2.0, b=0.0, timeout_s=0.1)
            finally:
                os.kill(worker.pid, signal.SIGCONT)
            return e.value

    err = asyncio.run(run_async())
    assert err.op == "scale" and str(err).endswith("(op 'scale')"), err


def test_status_command_shows_leases_and_counters(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        c.call("vector_add", x=np.ones(3), y=np.ones(3))
        out = subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", worker.name, "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        state = json.loads(out.stdout)
        assert state["pid"] == worker.pid and len(state["clients"]) == 1
        assert state["clients"][0]["pid"] == os.getpid() and state["slots_leased"] == 5
        text = subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", worker.name],
                              capture_output=True, text=True, timeout=30).stdout
        assert "clients 1" in text and "region 0" in text
        assert "resident tensors 0\n" in text
        c.put("w", np.ones((2, 3), np.float32))
        text = subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", worker.name],
                              capture_output=True, text=True, timeout=30).stdout
        line = next(ln for ln in text.splitlines() if ln.startswith("resident tensors"))
        assert line.startswith("resident tensors 1: ") and line.endswith("w (float32 2x3)"), line


def test_status_answers_with_thousands_of_resident_tensors(worker: WorkerProc) -> None:
    # STATE is one packet: listing every resident tensor of a client that keeps thousands (long names) made it too
    # large to send, and `shmrpc status` (the readiness check) failed on a healthy worker; now the first 200 are
    # named and all are counted
    with Client(worker.name, timeout_s=10) as c:
        for i in range(3000):
            c.put(f"layer{i:05d}." + "k" * 100, np.zeros(2, np.float32))
        status = [sys.executable, "-m", "shmrpc.server", "status", "--name", worker.name]
        out = subprocess.run([*status, "--json"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        state = json.loads(out.stdout)
        assert state["resident_count"] == 3000 and len(state["resident"]) == 200
        text = subprocess.run(status, capture_output=True, text=True, timeout=30)
        assert text.returncode == 0, text.stderr
        line = next(ln for ln in text.stdout.splitlines() if ln.startswith("resident tensors"))
        assert line.startswith("resident tensors 3000: ") and "/layer00000." in line, line[:80]
        assert line.endswith(", and 2980 more (--json lists 200)"), line[-80:]
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(2), y=np.ones(2))["out"], 2.0)


def test_connects_that_gave_up_while_the_worker_stalled_leave_no_session(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    # while the worker is stopped, connects time out and close their connection; resumed, the worker answered each
    # queued HELLO with a WELCOME to a closed socket and kept the session until that process exited: a process
    # connecting again and again took every place of its uid (--max-clients-per-uid), itself included
    w = spawn_worker("--max-clients-per-uid", "4", "--log-level", "INFO")
    os.kill(w.pid, signal.SIGSTOP)
    try:
        for _ in range(6):
            with pytest.raises(ConnectError):
                Client(w.name, timeout_s=5, connect_timeout_s=0.3)
    finally:
        os.kill(w.pid, signal.SIGCONT)
    with Client(w.name, timeout_s=10, connect_timeout_s=10) as c:  # its HELLO queued behind the others
        np.testing.assert_array_equal(c.call("scale", x=np.ones(4), a=2.0, b=0.0)["out"], 2.0)
        out = subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", w.name, "--json"],
                             capture_output=True, text=True, timeout=30)
        assert [cl["pid"] for cl in json.loads(out.stdout)["clients"]] == [os.getpid()]
    assert w.stop() == 0
    assert w.stderr.count("its WELCOME could not be sent") == 6, w.stderr


def test_a_hello_whose_lane_cannot_be_opened_is_refused_and_leaves_no_session(
        worker_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a HELLO that failed after its session was admitted (its lane: out of fds) was refused, but the session, its
    # region and its lease stayed until the client's process exited (one per connect of a retrying process)
    import threading

    from shmrpc.schema.layout import parse_geometry
    from shmrpc.server._loop import Worker
    from shmrpc.server.config import WorkerConfig

    w = Worker(WorkerConfig(name=worker_name, geometry=parse_geometry("64K:8"), lease=(2,), backend="numpy",
                            mlock=False, dumpable=True))
    w.start()
    th = threading.Thread(target=w.serve_forever, daemon=True)
    th.start()
    try:
        assert w._lanes is not None

        def no_fds(identity: bytes) -> None:
            raise OSError(24, "Too many open files")

        monkeypatch.setattr(w._lanes, "open", no_fds)
        # clients in a process of their own (the worker leases no slot to its own pid), alive meanwhile
        child = ("import sys, numpy as np\nfrom shmrpc.client import Client, ConnectError\n"
                 "for _ in range(3):\n"
                 "    try:\n        Client(sys.argv[1], connect_timeout_s=5, lane='block')\n"
                 "    except ConnectError as e:\n        print(e.field, 'Too many open files' in str(e))\n"
                 "with Client(sys.argv[1], timeout_s=5) as c:\n"
                 "    print(c.call('scale', x=np.ones(4), a=2.0, b=0.0)['out'].tolist())\n"
                 "    sys.stdin.readline()\n")
        with subprocess.Popen([sys.executable, "-c", child, worker_name], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) as p:
            assert p.stdout is not None and p.stdin is not None
            lines = [p.stdout.readline().strip() for _ in range(4)]
            assert lines == ["lane True"] * 3 + ["[2.0, 2.0, 2.0, 2.0]"], lines
            # the process lives on with one client: the one it holds, not the three refused
            assert [c.pid for c in w.sessions.clients.values()] == [p.pid]
            assert len(w.sessions.region_owner) == 1
            p.stdin.write("\n")
            p.stdin.flush()
            assert p.wait(20) == 0
    finally:
        w.stop()
        th.join(10)
        w.close()


def test_a_worker_near_its_fd_limit_refuses_clients_and_lives(worker_name: str) -> None:
    # at its RLIMIT_NOFILE, libzmq's accept of a client's connection asserted and the worker died (SIGABRT), every
    # client with it; now a HELLO is refused while the worker still has fds of its own, and it serves on
    import resource

    def low_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (120, 120))  # hard too: the worker cannot raise it

    args = [sys.executable, "-m", "shmrpc.server", "serve", "--name", worker_name, "--backend", "numpy", "--no-mlock",
            "--slots", "64K:64", "--lease", "2", "--max-clients-per-uid", "64", "--log-level", "WARNING"]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=low_fds) as w:
        assert w.stdout is not None and "ready" in w.stdout.readline()
        clients, refused = [], []
        try:
            for _ in range(40):
                try:
                    clients.append(Client(worker_name, timeout_s=10, connect_timeout_s=5, lane="block"))
                except ConnectError as e:
                    refused.append(e)
                    if len(refused) >= 3:
                        break
            assert refused and all(e.field == "fds" and "RLIMIT_NOFILE" in str(e) for e in refused), refused
            assert len(clients) >= 3
            for c in clients:  # every client admitted is served
                np.testing.assert_array_equal(c.call("scale", x=np.ones(4), a=2.0, b=0.0)["out"], 2.0)
            assert w.poll() is None
        finally:
            for c in clients:
                c.close()
        with Client(worker_name, timeout_s=10, lane="block") as c:  # room again once they left
            np.testing.assert_array_equal(c.call("scale", x=np.ones(4), a=2.0, b=0.0)["out"], 2.0)
        w.send_signal(signal.SIGTERM)
        _, err = w.communicate(timeout=30)
        assert w.returncode == 0, err
        assert "refused a HELLO" in err and "file descriptors" in err


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_worker_out_of_fds_does_not_spin_on_the_attach_socket(spawn_worker: Callable[..., WorkerProc]) -> None:
    """Out of fds, a connection waiting on the attach socket could not be accepted and kept it readable: the loop
    spun (a full core) and logged a WARNING line per turn (~100 000 in 3 s). Now it stops polling the socket for a
    while after a failed accept and says so once per burst; once fds are free again, clients get in."""
    import resource
    import socket

    w = spawn_worker("--dumpable")  # (its /proc/<pid>/fd is read here)
    old = resource.prlimit(w.pid, resource.RLIMIT_NOFILE)
    n = len(os.listdir(f"/proc/{w.pid}/fd"))
    conns: list[socket.socket] = []
    try:
        resource.prlimit(w.pid, resource.RLIMIT_NOFILE, (n + 3, old[1]))  # the worker's own soft limit only
        for _ in range(6):  # three are accepted and wait for their HELLO; the others find no fd left
            c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            c.connect(str(attach_path(w.name)))
            conns.append(c)
        time.sleep(0.3)
        cpu0 = _cpu_s(w.pid)
        time.sleep(2.0)
        used = _cpu_s(w.pid) - cpu0
        assert used < 0.5, f"the worker used {used:.2f} s of CPU in 2 s out of fds"
    finally:
        for c in conns:
            c.close()
        resource.prlimit(w.pid, resource.RLIMIT_NOFILE, old)
    with Client(w.name, timeout_s=10, connect_timeout_s=10) as cl:  # accepted again
        np.testing.assert_array_equal(cl.call("scale", x=np.ones(4), a=2.0, b=0.0)["out"], 2.0)
    assert w.stop() == 0, w.stderr
    assert 1 <= w.stderr.count("attach socket: accept failed") <= 2, w.stderr[-2000:]


def test_metrics_endpoint(spawn_worker: Callable[..., WorkerProc], free_port: int) -> None:
    w = spawn_worker("--metrics-port", str(free_port))
    with Client(w.name, timeout_s=10) as c:
        for _ in range(3):
            c.call("vector_add", x=np.ones(3), y=np.ones(3))
        with pytest.raises(KernelError):
            c.call("vector_add", x=np.ones(3), y=np.ones(4))
        body = urllib.request.urlopen(f"http://127.0.0.1:{free_port}/metrics", timeout=10).read().decode()
    assert 'shmrpc_requests_total{op="vector_add",status="ok"} 3.0' in body
    assert 'status="KernelError"' in body
    assert "shmrpc_request_duration_seconds_bucket" in body and "shmrpc_clients_connected" in body


@pytest.mark.parametrize("fault", ["cuda_error", "fatal"])
def test_injected_backend_fault(spawn_worker: Callable[..., WorkerProc], fault: str,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An injected device error fails one request cleanly; a fatal one makes the worker drain and exit 3."""
    monkeypatch.setenv("SHMRPC_INJECT_FAULT", fault)
    w = spawn_worker()
    x = np.arange(8.0)
    with Client(w.name, timeout_s=10) as c:
        with pytest.raises(KernelError) as e:
            c.call("scale", x=x, a=2.0)
        assert e.value.op == "scale"
        if fault == "cuda_error":
            np.testing.assert_array_equal(c.call("scale", x=x, a=2.0)["out"], 2 * x)
            return
        assert w.proc.wait(10) == 3
        with pytest.raises(WorkerGoneError):
            c.call("scale", x=x, a=2.0)
    w.stop()
    assert "unrecoverable" in w.stderr


def test_spinning_worker_and_client(spawn_worker: Callable[..., WorkerProc]) -> None:
    """--spin-us / spin_us change how both sides wait, nothing else: answers, client death, worker death."""
    with pytest.raises(ValueError, match="spin_us"):
        Client("unused", spin_us=-1)
    w = spawn_worker("--spin-us", "300", slots="64K:4", lease="4")
    p = subprocess.Popen([sys.executable, PROCS, "victim", w.name], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().startswith("ready")
    os.kill(p.pid, signal.SIGKILL)  # its pidfd must be seen by a loop that is spinning
    p.wait(10)
    p.stdout.close()
    t0 = time.monotonic()
    c = Client(w.name, timeout_s=TIMEOUT_S, spin_us=300)
    x = np.arange(64, dtype=np.float32)
    for i in range(50):
        np.testing.assert_array_equal(c.call("scale", x=x, a=float(i))["out"], x * i)
    with c.loan(4096) as req:
        req.array("x", 64, np.float32)[...] = x
        for _ in range(50):
            np.testing.assert_array_equal(req.send("echo")["out"], x)
    assert time.monotonic() - t0 < 5
    os.kill(w.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerGoneError):
        c.call("echo", x=x)
    assert time.monotonic() - t0 < FAST_S
    c.close()
    w.proc.wait(5)
    spawn_worker(slots="64K:4", lease="4")  # a restart removes what the killed worker left



def test_malformed_op_table_is_a_protocol_mismatch_at_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    """The client parses WELCOME's op table through the schema's definition: a bad one fails the connect."""
    import shmrpc.client._client as client_mod
    from shmrpc.schema.layout import DEFAULT_GEOMETRY

    closed = []

    class FakeConnection:  # a handshake that went through, with an op code out of range in its WELCOME
        def __init__(self, name: str, connect_timeout_s: float, spin_us: int = 0,
                     worker_uid: int | None = None, lease: tuple[int, ...] | None = None, lane: str | None = None,
                     lane_spin_us: int = 0) -> None:
            self.fds: list[int] = []
            self.lane = None
            self.worker_pid = os.getpid()
            self.worker_uid = os.getuid()
            self.welcome = {"client_id": 1, "backend": "numpy", "worker_pid": os.getpid(), "regions": [],
                            "geometry": DEFAULT_GEOMETRY.to_json(), "lease": [],
                            "op_table": {"echo": {"code": 70000, "inputs": ["x"], "outputs": ["out"]}}}

        def close(self, bye: bool = False) -> None:
            closed.append(True)

    monkeypatch.setattr(client_mod, "Connection", FakeConnection)
    with pytest.raises(ProtocolMismatchError, match="op table entry 'echo': code"):
        Client("fake", connect_timeout_s=1)
    assert closed, "the transport was not closed after the refused handshake"


def test_serve_cpus_pins_every_thread_of_the_worker(spawn_worker: Callable[..., WorkerProc]) -> None:
    cpu = max(os.sched_getaffinity(0))
    w = spawn_worker("--cpus", str(cpu), "--threads", "2")
    with Client(w.name) as c:  # a request on the executor: its threads exist too
        np.testing.assert_array_equal(c.call("scale", x=np.ones(300_000), a=2.0)["out"], 2.0)
    tids = os.listdir(f"/proc/{w.pid}/task")
    assert len(tids) > 1
    assert {t: os.sched_getaffinity(int(t)) for t in tids} == {t: {cpu} for t in tids}


def test_sigterm_while_the_worker_stops_itself_never_hangs_it(worker_name: str) -> None:
    # a fatal backend error makes the worker stop itself; SIGTERMs at every line from there on (procs_worker_storm.py)
    # must not make its handler wait on a lock the interrupted stop holds: it drains and exits 3 as without them
    env = dict(os.environ, SHMRPC_INJECT_FAULT="fatal")
    p = subprocess.Popen([sys.executable, str(Path(__file__).with_name("procs_worker_storm.py")), "serve", "--name",
                          worker_name, "--backend", "numpy", "--no-mlock", "--log-level", "WARNING"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None and "ready" in p.stdout.readline()
        with Client(worker_name, timeout_s=10) as c, pytest.raises(KernelError):
            c.call("scale", x=np.arange(8.0), a=2.0)
        out, err = p.communicate(timeout=15)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=10)
    assert p.returncode == 3 and "storm" in err and "unrecoverable" in err, err[-2000:]
    assert not socket_path(worker_name).exists()


def test_a_hello_whose_region_cannot_be_made_is_refused_logged_and_the_worker_serves_on(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    # a client asks for a lease of 1 GiB slots whose region is twice the memory available: its HELLO is refused with
    # field "region" and the lease it asked for, the worker logs why (a worker that refuses clients in silence cannot
    # be told from one that sees none), and the next client with the default lease is served
    avail = next(int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines()
                 if ln.startswith("MemAvailable:")) * 1024
    n = 2 * avail // (1 << 30) + 1
    w = spawn_worker("--lease-max", f"16,{n}", slots="64K:16,1G:1", lease="4,0")
    with pytest.raises(ConnectError) as ei:
        Client(w.name, lease=(4, n), timeout_s=5, connect_timeout_s=5)
    assert ei.value.field == "region" and f"lease of 4,{n} slots" in str(ei.value), ei.value
    with Client(w.name, timeout_s=5) as c:
        np.testing.assert_array_equal(c.call("scale", x=np.ones(4, np.float32), a=2.0, b=0.0)["out"], 2.0)
    assert w.stop() == 0
    refused = [ln for ln in w.stderr.splitlines() if "refused a HELLO" in ln]
    assert len(refused) == 1 and f"cannot create its region (lease 4,{n})" in refused[0], w.stderr
    assert "needs" in refused[0] and "available" in refused[0]


_LEAVER = r'''
import sys
import numpy as np
from shmrpc.client import Client
with Client(sys.argv[1], timeout_s=30) as c:
    c.call("vector_add", x=np.ones(4), y=np.ones(4))
    print("ready", flush=True)
    sys.stdin.readline()
'''  # says BYE as the block ends, then exits


_HELLO_LATER = r'''
import os, socket, sys
from shmrpc.schema import messages as m
from shmrpc.schema.control import Hello
from shmrpc.schema import SCHEMA_HASH
from shmrpc.schema.naming import attach_path
from shmrpc.schema.proc import process_start_ticks
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.settimeout(20)
s.connect(str(attach_path(sys.argv[1])))
print("connected", flush=True)
sys.stdin.readline()
pid = os.getpid()
s.send(m.pack_json(m.HELLO, Hello(m.PROTOCOL_VERSION, SCHEMA_HASH, pid, os.getuid(), process_start_ticks(pid)).to_json()))
reply, fds, _, _ = socket.recv_fds(s, m.ATTACH_MAX_NBYTES, 8)
print(reply[:1] == m.WELCOME, flush=True)
sys.stdin.readline()
'''  # connects at once, says HELLO when told, then lives on


def test_a_new_clients_pidfd_under_a_number_just_freed_is_not_taken_for_the_old_clients_exit(
        worker_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One turn of the loop reads a client's BYE (its pidfd closed), a new client's HELLO (its pidfd opened under the
    same number) and the first client's exit: the exit was the old pidfd's, and the new session lives on (found by
    an operations trial, 2026-12-05: short-lived clients connecting 10 at a time had fresh sessions ended as "its
    process exited", their first call refused with "no lease")."""
    import threading

    from shmrpc.schema.layout import parse_geometry
    from shmrpc.server._loop import Worker
    from shmrpc.server.config import WorkerConfig

    w = Worker(WorkerConfig(name=worker_name, geometry=parse_geometry("64K:8"), lease=(2,), backend="numpy",
                            mlock=False))
    w.start()
    th = threading.Thread(target=w.serve_forever, daemon=True)
    th.start()
    fillers: list[int] = []
    procs: list[subprocess.Popen[str]] = []
    try:
        leaver, later = (subprocess.Popen([sys.executable, "-c", code, worker_name], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True) for code in (_LEAVER, _HELLO_LATER))
        procs += [leaver, later]
        assert leaver.stdout is not None and leaver.stdout.readline().strip() == "ready"
        assert later.stdout is not None and later.stdout.readline().strip() == "connected"
        deadline = time.monotonic() + 10
        while not w._attach or not w._attach.pending:  # accepted: its HELLO is read in a turn after it was sent
            assert time.monotonic() < deadline, "the connection was not accepted"
            time.sleep(0.01)
        (pidfd,) = [c.pidfd for c in w.sessions.clients.values()]
        assert pidfd is not None
        # the loop held before its next wait, while the BYE, the exit and the HELLO arrive: one turn reads them all
        held, go = threading.Event(), threading.Event()
        poll = w._poller.poll if w._poller else None
        assert poll is not None

        def held_poll(timeout_ms: int) -> dict[Any, int]:
            if not go.is_set():
                held.set()
                go.wait(20)
            return poll(timeout_ms)

        monkeypatch.setattr(w._poller, "poll", held_poll)
        os.write(w._wake_w, b"x")
        assert held.wait(10)
        assert leaver.stdin is not None and later.stdin is not None
        leaver.stdin.write("\n")
        leaver.stdin.flush()
        assert leaver.wait(10) == 0  # its BYE sent, its process gone
        later.stdin.write("\n")
        later.stdin.flush()
        time.sleep(0.3)  # (the BYE through the worker's I/O thread, the HELLO into its connection)
        for fd in range(pidfd):  # every free number below the leaver's pidfd taken: the next fd opened gets its number
            if not os.path.exists(f"/proc/self/fd/{fd}"):
                fillers.append(os.open(os.devnull, os.O_RDONLY))
        go.set()
        assert later.stdout.readline().strip() == "True"  # WELCOME
        time.sleep(0.2)
        assert [c.pid for c in w.sessions.clients.values()] == [later.pid], \
            "the new session was ended as though its process had exited"
    finally:
        for fd in fillers:
            os.close(fd)
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)  # (closes its pipes)
        w.stop()
        th.join(10)
        w.close()


def test_a_worker_whose_runtime_files_are_removed_makes_them_again_and_says_so(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    # a tmp cleaner removing the runtime files of a running worker (default directory /tmp/shmrpc-<uid>): the worker
    # did not notice, new clients could not reach it, and a second worker of the same name started beside it; now it
    # sees the lock file go at once (inotify), takes the lock again, makes its sockets again and logs it

    w = spawn_worker("--metrics-port", "0")
    with Client(w.name, timeout_s=10) as c:
        np.testing.assert_array_equal(c.call("scale", x=np.ones(4), a=2.0, b=0.0)["out"], 2.0)  # (connected)
        for path in (lock_path(w.name), socket_path(w.name), attach_path(w.name)):
            os.unlink(path)
        deadline = time.monotonic() + 10
        while not all(p.exists() for p in (lock_path(w.name), socket_path(w.name), attach_path(w.name))):
            assert time.monotonic() < deadline, "the runtime files were not made again"
            time.sleep(0.01)
        second = subprocess.run([sys.executable, "-m", "shmrpc.server", "serve", "--name", w.name, "--slots", "64K:4",
                                 "--no-mlock", "--backend", "numpy"], capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and f"a worker named {w.name!r} is already running (pid {w.pid}" in second.stderr
        np.testing.assert_array_equal(c.call("scale", x=np.ones(4), a=2.0, b=0.0)["out"], 2.0)  # its client served on
        with Client(w.name, timeout_s=10) as late:  # a new client reaches it through the new sockets
            np.testing.assert_array_equal(late.call("scale", x=np.ones(4), a=3.0, b=0.0)["out"], 3.0)
        url = next(p for p in w.ready_line.split() if p.startswith("http://")).rstrip(")").replace("/metrics", "/healthz")
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200
        for path in (lock_path(w.name), attach_path(w.name)):  # and a second removal is seen too (a new watch)
            os.unlink(path)
        deadline = time.monotonic() + 10
        while not (lock_path(w.name).exists() and attach_path(w.name).exists()):
            assert time.monotonic() < deadline, "the runtime files were not made again a second time"
            time.sleep(0.01)
    assert w.stop() == 0
    assert w.stderr.count("was removed: taken again, so no second worker of the name starts") == 2, w.stderr
    assert not any(p.exists() for p in (lock_path(w.name), socket_path(w.name), attach_path(w.name)))
