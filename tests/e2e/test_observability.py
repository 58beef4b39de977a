"""The worker as operators see it: status as a health check, the metrics endpoint, the logs."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from shmrpc.client import Client, KernelError

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
SHMRPC = [sys.executable, "-m", "shmrpc.cli"]


def _shmrpc(*args: str, timeout_s: float = 30, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SHMRPC, *args], capture_output=True, text=True, timeout=timeout_s, **kw)  # type: ignore[call-overload]


def test_status_exit_codes_and_dead_worker(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker()
    assert _shmrpc("status", "--name", w.name, "-q").returncode == 0
    os.kill(w.pid, signal.SIGKILL)
    w.proc.wait(10)
    t0 = time.monotonic()
    out = _shmrpc("status", "--name", w.name, "--timeout-s", "0.5", timeout_s=20)
    assert time.monotonic() - t0 < 10, "status must exit after its timeout, not wait for the dead worker"
    # the attach socket is a plain Unix socket: with nobody behind it, the connection is refused at once
    assert out.returncode == 1 and "no worker listens on" in out.stderr and "Traceback" not in out.stderr
    w2 = spawn_worker()  # same name: cleans what the killed one left
    assert w2.stop() == 0


def test_status_into_a_closed_pipe(worker: WorkerProc) -> None:
    r, wfd = os.pipe()
    os.close(r)  # the reader is gone before the first line, like `| head` that has had enough
    try:
        out = subprocess.run([*SHMRPC, "status", "--name", worker.name, "--json"], stdout=wfd,
                             stderr=subprocess.PIPE, text=True, timeout=30)
    finally:
        os.close(wfd)
    assert out.returncode == 0 and out.stderr == ""


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_port_zero_labels_and_healthz(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--metrics-port", "0", "--log-level", "INFO", "--log-format", "json")
    url = _metrics_url(w)
    assert _get(url.replace("/metrics", "/healthz")) == (200, "ok\n")
    with Client(w.name, timeout_s=10) as c:
        c.call("vector_add", x=np.ones(3), y=np.ones(3))
        with pytest.raises(KernelError):
            c.call("vector_add", x=np.ones(3), y=np.ones(4))
        c.put("weights", np.ones(16, np.float32))
        for _ in range(200):  # a flood of failures: the log keeps to its rate
            with pytest.raises(KernelError):
                c.call("vector_add", x=np.ones(2), y=np.ones(5))
        code, body = _get(url)
    assert code == 200
    assert 'shmrpc_requests_total{op="vector_add",status="ok"} 1.0' in body
    assert 'shmrpc_requests_total{op="vector_add",status="KernelError"} 201.0' in body
    assert 'shmrpc_requests_total{op="put",status="ok"} 1.0' in body
    assert 'op="invalid"' not in body and 'op="echo"' not in body
    assert 'shmrpc_build_info{backend="numpy",device="cpu",version=' in body
    for name in ("process_resident_memory_bytes", "process_open_fds", "shmrpc_slots_total", "shmrpc_resident_limit_bytes"):
        assert name in body
    assert w.stop() == 0
    lines = [json.loads(x) for x in w.stderr.splitlines() if x.startswith("{")]
    assert any(x["msg"].startswith("metrics on http://127.0.0.1:") for x in lines)
    # the lifecycle lines carry their event and fields, as the failed requests' do
    events = [x.get("event") for x in lines]
    for event in ("worker_ready", "client_connected", "client_gone", "worker_stopping", "worker_stopped"):
        assert event in events, (event, events)
    connected = next(x for x in lines if x.get("event") == "client_connected")
    assert connected["client_pid"] == os.getpid() and connected["slots"] > 0
    failed = [x for x in lines if x.get("event") == "request_failed"]
    assert failed and len(failed) <= 40, len(failed)
    first = failed[0]
    assert first["client_pid"] == os.getpid() and first["op"] == "vector_add" and first["error"] == "KernelError"
    assert first["level"] == "INFO" and "field" in first


def _metrics_url(w: WorkerProc) -> str:
    # the ready line on stdout names the endpoint
    for part in w.ready_line.split():
        if part.startswith("http://"):
            return part.rstrip(")")
    raise AssertionError(w.ready_line)


def test_taken_metrics_port_is_one_line(spawn_worker: Callable[..., WorkerProc], worker_name: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        out = _shmrpc("serve", "--name", worker_name, "--slots", "64K:4", "--backend", "numpy", "--no-mlock",
                      "--metrics-port", str(port))
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("shmrpc serve: cannot serve metrics on 127.0.0.1:") and "--metrics-port" in lines[-1]
    assert "Traceback" not in out.stderr


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=10)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.unix_path)


def _unix_get(path: str, url: str, token: str | None = None) -> tuple[int, str]:
    conn = _UnixHTTP(path)
    try:
        conn.request("GET", url, headers={"Authorization": f"Bearer {token}"} if token else {})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_metrics_on_a_unix_socket_with_a_token(spawn_worker: Callable[..., WorkerProc], tmp_path: Path,
                                               shmrpc_runtime_dir: Path) -> None:
    token = "s3cret-" + os.urandom(16).hex()
    tfile = tmp_path / "token"
    tfile.write_text(token + "\n")
    tfile.chmod(0o600)
    sock = tmp_path / "metrics.sock"
    w = spawn_worker("--metrics-addr", f"unix:{sock}", "--metrics-token-file", str(tfile))
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert _unix_get(str(sock), "/healthz") == (200, "ok\n")  # open: it tells only ready or not
    assert _unix_get(str(sock), "/metrics")[0] == 401
    assert _unix_get(str(sock), "/metrics", "wrong-token")[0] == 401
    code, body = _unix_get(str(sock), "/metrics", token)
    assert code == 200 and "shmrpc_requests_total" in body
    assert w.stop() == 0
    assert not sock.exists()


def _serve_fails(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return _shmrpc("serve", "--name", name, "--slots", "64K:4", "--backend", "numpy", "--no-mlock", *args)


def test_metrics_unix_path_replaces_only_a_stale_socket(spawn_worker: Callable[..., WorkerProc], tmp_path: Path,
                                                         worker_name: str) -> None:
    """A file at the --metrics-addr unix: path refuses the start in one line naming it and is kept (it was deleted);
    a socket nobody listens on (a dead worker's) is replaced."""
    keep = tmp_path / "precious.conf"
    keep.write_text("keep me\n")
    out = _serve_fails(worker_name, "--metrics-addr", f"unix:{keep}")
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"shmrpc serve: cannot serve metrics on --metrics-addr unix:{keep}: ") and \
        "not a socket" in last and "Traceback" not in out.stderr, out.stderr
    assert keep.read_text() == "keep me\n"
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(stale))  # closed without unlink: what a killed worker leaves
    w = spawn_worker("--metrics-addr", f"unix:{stale}")
    assert _unix_get(str(stale), "/healthz") == (200, "ok\n")
    assert w.stop() == 0
    assert not stale.exists()


def test_metrics_unix_socket_of_a_live_worker_is_not_taken(spawn_worker: Callable[..., WorkerProc], tmp_path: Path,
                                                           worker_name: str) -> None:
    """A second worker given a live worker's metrics socket is refused (it took the socket, and removed it when it
    stopped); a worker removes the path at exit only while it is still its own socket."""
    sock = tmp_path / "metrics.sock"
    first = spawn_worker("--metrics-addr", f"unix:{sock}")
    out = _serve_fails(worker_name + "-b", "--metrics-addr", f"unix:{sock}")
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert f"--metrics-addr unix:{sock}" in last and "in use" in last, out.stderr
    assert _unix_get(str(sock), "/healthz") == (200, "ok\n")  # still the first worker's
    # another process's socket at the path now: the first worker leaves it at exit
    sock.unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as other:
        other.bind(str(sock))
        assert first.stop() == 0
        assert sock.exists()
    sock.unlink()


def _gauge(body: str, name: str) -> float:
    return float(next(ln.split()[-1] for ln in body.splitlines() if ln.startswith(name + " ")))


def test_pool_gauge_counts_only_the_pool_and_ready_follows_healthz(spawn_worker: Callable[..., WorkerProc]) -> None:
    """Idle clients hold slots of their own regions, not of the pool: shmrpc_pool_slots_held stays 0 (the alert on
    shmrpc_slots_leased / shmrpc_slots_total fired with every pool slot free), a borrowed slot counts; shmrpc_ready
    is 1 while /healthz says ok."""
    w = spawn_worker("--metrics-port", "0", "--slots", "64K:32,1M:8", "--lease", "4,2")
    url = _metrics_url(w)
    clients = [Client(w.name, timeout_s=10) for _ in range(10)]
    try:
        body = _get(url)[1]
        assert _gauge(body, "shmrpc_slots_leased") == 60 and _gauge(body, "shmrpc_slots_total") == 40
        assert _gauge(body, "shmrpc_pool_slots_held") == 0 and _gauge(body, "shmrpc_ready") == 1.0
        big = [clients[0].loan(600_000) for _ in range(3)]  # two from its own 1M slots, the third borrowed
        try:
            assert _gauge(_get(url)[1], "shmrpc_pool_slots_held") == 1
        finally:
            for loan in big:
                loan.release()
    finally:
        for c in clients:
            c.close()
    assert w.stop() == 0


def test_idle_metrics_connections_leave_the_worker_its_fds(worker_name: str) -> None:
    """Connections to the metrics port that send nothing once held one fd each for good: under RLIMIT_NOFILE 200
    (lowered in the worker's process only), ~190 of them used every fd, HELLOs timed out and libzmq's accept of the
    next ZeroMQ connection aborted the worker. Now the endpoint holds at most 16 and none of the worker's last fds."""
    import resource

    from shmrpc.schema.naming import socket_path

    def low_fds() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))  # hard too: the worker cannot raise it

    args = [sys.executable, "-m", "shmrpc.server", "serve", "--name", worker_name, "--backend", "numpy", "--no-mlock",
            "--slots", "64K:8", "--lease", "2", "--metrics-port", "0", "--log-level", "WARNING"]
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=low_fds) as w:
        assert w.stdout is not None
        line = w.stdout.readline()
        assert "ready" in line, line
        url = next(p for p in line.split() if p.startswith("http://")).rstrip(")")
        port = int(url.split(":")[2].split("/")[0])
        idle: list[socket.socket] = []
        try:
            misses = 0
            while len(idle) < 250 and misses < 3:  # (a connect may wait while the kernel's accept queue is full)
                try:
                    idle.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                    misses = 0
                except OSError:
                    misses += 1
            time.sleep(0.5)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:  # a ZeroMQ peer's connect
                raw.connect(str(socket_path(worker_name)))
                with Client(worker_name, timeout_s=10, connect_timeout_s=5) as c:
                    np.testing.assert_array_equal(c.call("vector_add", x=np.ones(3), y=np.ones(3))["out"], 2.0)
                time.sleep(0.3)
            assert w.poll() is None
        finally:
            for s in idle:
                s.close()
        deadline = time.monotonic() + 10
        while True:  # the idle connections' handlers see them closed
            try:
                assert _get(url)[0] == 200
                break
            except (OSError, AssertionError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        w.send_signal(signal.SIGTERM)
        _, err = w.communicate(timeout=30)
        assert w.returncode == 0, err
        assert "metrics endpoint: closed a connection at once" in err, err


def _count(body: str, name: str, **labels: str) -> float:
    total = 0.0
    for ln in body.splitlines():
        head, _, value = ln.rpartition(" ")
        if head.startswith(name + "{") and all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def test_calls_refused_before_their_slot_is_read_are_counted(spawn_worker: Callable[..., WorkerProc],
                                                             tmp_path: Path, worker_name: str) -> None:
    """BusyError while the worker drains, a stranger's doorbell (StaleSlotError), a malformed CALL frame: each was
    logged as a failed request but missing from shmrpc_requests_total, so the error-ratio alert never saw them. Now
    each is counted under op "unknown" with its error class as status."""
    import zmq
    from wire import WAITING_OPS, wait_in_flight

    from shmrpc.client import BusyError
    from shmrpc.schema import messages as m
    from shmrpc.schema.naming import endpoint

    mod = "waiting_" + worker_name.replace("-", "_")
    (tmp_path / f"{mod}.py").write_text(WAITING_OPS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    w = spawn_worker("--ops", mod, "--metrics-port", "0", env=env)
    url = _metrics_url(w)
    flag = tmp_path / "go"
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint(w.name))
        with Client(w.name, timeout_s=30) as c1, Client(w.name, timeout_s=10) as c2:
            slot = c2._slots.free[0]
            s.send(m.pack_call(slot.region, slot.index, 9, slot.generation))  # not its session: StaleSlotError
            assert s.poll(5000) and m.unpack_done(s.recv())[3] & 0x8000
            s.send(m.CALL + b"\x00")  # a doorbell too short to name a slot
            assert s.poll(5000)
            s.recv()
            fut = c1.submit("t_wait", x=np.ones(4), path=str(flag))
            wait_in_flight(w.name)
            w.proc.send_signal(signal.SIGTERM)  # it drains: the waiting request keeps it serving
            deadline = time.monotonic() + 10
            while _get(url.replace("/metrics", "/healthz"))[0] != 503:
                assert time.monotonic() < deadline, "the worker did not start to drain"
                time.sleep(0.05)
            for _ in range(3):
                with pytest.raises(BusyError):
                    c2.call("vector_add", x=np.ones(4), y=np.ones(4))
            body = _get(url)[1]
            flag.touch()
            np.testing.assert_array_equal(fut.result()["out"], 1.0)
    finally:
        flag.touch()
        s.close()
        ctx.term()
    assert _count(body, "shmrpc_requests_total", op="unknown", status="BusyError") == 3, body
    assert _count(body, "shmrpc_requests_total", op="unknown", status="StaleSlotError") == 1
    assert _count(body, "shmrpc_requests_total", op="unknown", status="InvalidRequestError") == 1
    assert w.proc.wait(20) == 0


def test_refused_handshakes_are_logged_rate_limited_and_counted(spawn_worker: Callable[..., WorkerProc],
                                                                worker_name: str) -> None:
    """A HELLO refused by --max-clients or --max-clients-per-uid left no line and no metric (the other refusals got a
    WARNING line each, unlimited: a client retrying in a loop flooded the log). Now every refusal is counted in
    shmrpc_clients_refused_total{reason} and logged at the failed requests' rate (20 at once, then 5 per second)."""
    from shmrpc.client import ClientLimitError

    w = spawn_worker("--max-clients", "1", "--metrics-port", "0")
    url = _metrics_url(w)
    t0 = time.monotonic()
    with Client(w.name, timeout_s=10):
        for _ in range(60):
            with pytest.raises(ClientLimitError):
                Client(w.name, timeout_s=5, connect_timeout_s=5)
        elapsed = time.monotonic() - t0
        time.sleep(0.5)  # a token comes back: the next line says how many were held back
        with pytest.raises(ClientLimitError):
            Client(w.name, timeout_s=5, connect_timeout_s=5)
        body = _get(url)[1]
    assert _count(body, "shmrpc_clients_refused_total", reason="max_clients") == 61, body
    assert _count(body, "shmrpc_clients_refused_total", reason="max_clients_per_uid") == 0
    assert w.stop() == 0
    lines = [ln for ln in w.stderr.splitlines() if "refused a HELLO" in ln]
    assert 20 <= len(lines) <= 20 + 5 * (elapsed + 0.5) + 2 and len(lines) < 61, len(lines)
    assert "--max-clients 1" in lines[0]
    assert "similar lines suppressed" in lines[-1], lines[-1]

    w2 = spawn_worker("--max-clients-per-uid", "1", "--metrics-port", "0", "--log-format", "json",
                      name=worker_name + "-b")
    with Client(w2.name, timeout_s=10):
        with pytest.raises(ClientLimitError):
            Client(w2.name, timeout_s=5, connect_timeout_s=5)
        body = _get(_metrics_url(w2))[1]
    assert _count(body, "shmrpc_clients_refused_total", reason="max_clients_per_uid") == 1, body
    assert w2.stop() == 0
    refused = [json.loads(ln) for ln in w2.stderr.splitlines() if "refused a HELLO" in ln]
    assert len(refused) == 1 and refused[0]["event"] == "hello_refused", refused
    assert refused[0]["reason"] == "max_clients_per_uid" and refused[0]["client_pid"] == os.getpid()
    assert "--max-clients-per-uid 1" in refused[0]["msg"] and refused[0]["level"] == "WARNING"


_HOLDER = r'''
import sys, time
import numpy as np
from shmrpc.client import Client
c = Client(sys.argv[1], timeout_s=30)
futs = [c.submit("t_wait", x=np.ones(4), path=sys.argv[2]) for _ in range(2)]
print("submitted", flush=True)
time.sleep(60)
'''


def test_pool_gauge_counts_the_slots_a_dead_clients_requests_still_hold(spawn_worker: Callable[..., WorkerProc],
                                                                        tmp_path: Path, worker_name: str) -> None:
    """A client killed with requests in flight in pool slots: its lease ends at once, but those slots stay busy until
    the requests finish. shmrpc_pool_slots_held dropped to 0 then (the exhaustion alert under-counted); now it counts
    them until they are answered, and drops to 0 after."""
    from wire import WAITING_OPS

    mod = "waiting_" + worker_name.replace("-", "_")
    (tmp_path / f"{mod}.py").write_text(WAITING_OPS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    # --isolation shared: a client's leased slots are the pool's (4 x 64K and 1 x 1M each)
    w = spawn_worker("--ops", mod, "--metrics-port", "0", "--isolation", "shared", env=env)
    url = _metrics_url(w)
    flag = tmp_path / "go"
    with subprocess.Popen([sys.executable, "-c", _HOLDER, w.name, str(flag)], stdout=subprocess.PIPE,
                          text=True) as holder:
        _watch_dead_clients_slots(w, holder, url, flag)
    assert w.stop() == 0


def _watch_dead_clients_slots(w: WorkerProc, holder: subprocess.Popen[str], url: str, flag: Path) -> None:
    from wire import wait_for_state

    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "submitted"
        wait_for_state(w.name, lambda st: st["in_flight"] == 2, "two requests in flight")
        assert _gauge(_get(url)[1], "shmrpc_pool_slots_held") == 5
        holder.kill()
        holder.wait(10)
        wait_for_state(w.name, lambda st: not st["clients"], "the killed client's lease ended")
        body = _get(url)[1]
        assert _gauge(body, "shmrpc_requests_in_flight") == 2
        assert _gauge(body, "shmrpc_pool_slots_held") == 2, "the dead client's requests still hold two pool slots"
        flag.touch()
        wait_for_state(w.name, lambda st: st["in_flight"] == 0, "the requests finished")
        assert _gauge(_get(url)[1], "shmrpc_pool_slots_held") == 0
    finally:
        flag.touch()
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


def test_a_put_refused_before_it_runs_is_named_and_counted_as_a_put(spawn_worker: Callable[..., WorkerProc]) -> None:
    """A Client.put over --request-memory-limit was counted under op="echo" and its error said "step 0 (echo)": the
    op it runs as on the worker, which neither its caller nor the operator ever named."""
    from shmrpc.client import ResourceError

    w = spawn_worker("--metrics-port", "0", "--request-memory-limit", "64K")
    with Client(w.name, timeout_s=10) as c:
        with pytest.raises(ResourceError) as ei:
            c.put("w", np.ones(50_000, np.float32))
        c.put("small", np.ones(16, np.float32))  # under the limit: served, as a put
        body = _get(_metrics_url(w))[1]
    e = ei.value
    assert e.op == "put" and e.field == "request_memory_limit", (e.op, e.field)
    assert "echo" not in str(e) and "this put needs" in str(e) and "--request-memory-limit" in str(e), str(e)
    assert _count(body, "shmrpc_requests_total", op="put", status="ResourceError") == 1, body
    assert _count(body, "shmrpc_requests_total", op="put", status="ok") == 1
    assert _count(body, "shmrpc_requests_total", op="echo") == 0
    assert w.stop() == 0
