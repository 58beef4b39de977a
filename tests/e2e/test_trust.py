"""Trust: each attack of the threat model (docs/reliability.md) run for real, with real processes.

Tests that need another uid create two users (and remove them); they need root and skip
elsewhere. Root bypasses the kernel's checks on /proc and on file modes, so to show what a
process of the *same* uid without ptrace rights can do, the worker, its clients and the
attacker all run as the created user. Every process read from has a hard deadline.
"""

from __future__ import annotations

import json
import os
import pwd
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import zmq
from wire import attach_hello, hello_body

from shmrpc.client import Client, ConnectError
from shmrpc.schema import messages as m
from shmrpc.schema.naming import attach_path, endpoint

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

TRUST = str(Path(__file__).with_name("trust_procs.py"))
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates users and runs processes as them: needs root")


# ------------------------------------------------------------ helpers


@pytest.fixture(scope="module")
def users() -> Iterator[list[tuple[int, int]]]:
    """Two fresh system users (uid, gid), removed afterwards."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a second user")
    tag = uuid.uuid4().hex[:6]
    names = [f"srpc{tag}{c}" for c in "uv"]
    made = []
    try:
        for n in names:
            subprocess.run(["useradd", "-M", "-r", "-s", "/usr/sbin/nologin", n], check=True, timeout=30,
                           capture_output=True)
            made.append(n)
        yield [(pwd.getpwnam(n).pw_uid, pwd.getpwnam(n).pw_gid) for n in names]
    finally:
        for n in made:
            subprocess.run(["userdel", n], timeout=30, capture_output=True)


@pytest.fixture
def scratch_dirs() -> Iterator[Callable[[str], Path]]:
    """Runtime directories under /tmp (which other users can traverse), removed afterwards."""
    made: list[Path] = []

    def make(tag: str) -> Path:
        p = Path(f"/tmp/shmrpc-test-{uuid.uuid4().hex[:8]}-{tag}")
        made.append(p)
        return p

    yield make
    for p in made:
        shutil.rmtree(p, ignore_errors=True)


def as_user(user: tuple[int, int], role: str, *args: str, rdir: Path | None = None) -> subprocess.Popen[str]:
    """Start trust_procs.py as ``user`` playing ``role``."""
    env = dict(os.environ)
    if rdir is not None:
        env["SHMRPC_RUNTIME_DIR"] = str(rdir)
    return subprocess.Popen([sys.executable, TRUST, str(user[0]), str(user[1]), role, *args], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def line(p: subprocess.Popen[str], timeout_s: float = 30.0) -> str:
    """The next stdout line of ``p``, failing (with its stderr) after ``timeout_s`` or at its exit."""
    assert p.stdout is not None
    if not select.select([p.stdout], [], [], timeout_s)[0]:
        p.kill()
        pytest.fail(f"no output from {p.args} in {timeout_s} s: {p.communicate(timeout=10)[1]}")
    got = p.stdout.readline()
    if not got:
        pytest.fail(f"{p.args} exited ({p.wait(10)}): {p.communicate(timeout=10)[1]}")
    return got.strip()


def finish(p: subprocess.Popen[str], sig: int = signal.SIGKILL, wait_s: float = 0.0) -> tuple[int, str, str]:
    """Close ``p``'s stdin, give it ``wait_s`` to leave on its own, stop it, return (status, rest of stdout, stderr)."""
    if p.stdin is not None:
        p.stdin.close()
        p.stdin = None
    try:
        p.wait(wait_s)
    except subprocess.TimeoutExpired:
        pass
    if p.poll() is None:
        p.send_signal(sig)
    try:
        out, err = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate(timeout=10)
    return p.returncode, out, err


# ------------------------------------------------------------ 1. impersonating the worker


@needs_root
def test_runtime_dir_planted_by_another_uid_is_refused_before_a_byte(
        users: list[tuple[int, int]], scratch_dirs: Callable[[str], Path], worker_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    attacker = users[0]
    rdir = scratch_dirs("planted")  # as /tmp/shmrpc-<uid> would be, made first by another user
    fake = as_user(attacker, "fake-worker", str(rdir), worker_name)
    try:
        assert line(fake) == "listening"
        monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(rdir))
        with pytest.raises(ConnectError) as e:
            Client(worker_name, connect_timeout_s=5)
        msg = str(e.value)
        assert str(rdir) in msg and f"owned by uid {attacker[0]}" in msg and "Remove it" in msg, msg
        assert e.value.path == str(rdir) and e.value.owner_uid == attacker[0]
    finally:
        _, out, _ = finish(fake)
    assert "connected" not in out, "the client connected to the fake worker"


@needs_root
def test_socket_answered_by_another_uid_is_refused_before_a_byte(
        users: list[tuple[int, int]], scratch_dirs: Callable[[str], Path], worker_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    attacker = users[0]
    theirs, ours = scratch_dirs("theirs"), scratch_dirs("ours")
    fake = as_user(attacker, "fake-worker", str(theirs), worker_name)
    try:
        assert line(fake) == "listening"
        # Make every file check pass: our directory, 0700, and the fake's socket in it, owned by us.
        # Only the kernel's word on the process behind the socket is left to tell the truth.
        ours.mkdir(mode=0o700)
        os.rename(theirs / f"{worker_name}.attach", ours / f"{worker_name}.attach")
        os.chown(ours / f"{worker_name}.attach", os.getuid(), os.getgid())
        monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(ours))
        with pytest.raises(ConnectError) as e:
            Client(worker_name, connect_timeout_s=5)
        msg = str(e.value)
        assert str(ours / f"{worker_name}.attach") in msg and f"runs as uid {attacker[0]}" in msg, msg
        assert e.value.path == str(ours / f"{worker_name}.attach") and e.value.owner_uid == attacker[0]
        assert line(fake) == "connected"
    finally:
        (ours / f"{worker_name}.attach").unlink(missing_ok=True)
        _, out, _ = finish(fake)
    assert "hello" not in out, "the client sent the fake worker its HELLO"


def _fake_region_fd(kind: str, nbytes: int) -> int:
    """An fd a fake worker could hand over: a plain file, a memfd of the wrong mode or size, unsealed."""
    import fcntl
    import tempfile

    if kind == "file":
        fd, path = tempfile.mkstemp()
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        return fd
    fd = os.memfd_create("fake", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes * 2 if kind == "size" else nbytes)
    os.fchmod(fd, 0o644 if kind == "mode" else 0o600)
    if kind != "unsealed":
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


@pytest.mark.parametrize("kind, says", [("file", "not a sealed memfd"), ("unsealed", "not a sealed memfd"),
                                        ("mode", "mode 0644"), ("size", "not 69632 as the worker said")])
def test_region_fd_is_checked_before_it_is_mapped(kind: str, says: str, worker_name: str,
                                                  scratch_dirs: Callable[[str], Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import threading

    from shmrpc.schema import SCHEMA_HASH
    from shmrpc.schema.layout import parse_geometry

    geo = parse_geometry("64K:1")
    rdir = scratch_dirs("fd")
    rdir.mkdir(mode=0o700)
    path = rdir / f"{worker_name}.attach"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)
    listener.settimeout(10)

    def serve() -> None:  # a worker of our own uid (its credentials pass) handing over a bad fd
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            fd = _fake_region_fd(kind, geo.region_nbytes)
            welcome = {"protocol": m.PROTOCOL_VERSION, "schema_hash": SCHEMA_HASH, "client_id": 1, "token": "ab" * 16,
                       "worker_pid": os.getpid(), "worker_start_ticks": hello_body()["start_ticks"], "backend": "numpy",
                       "regions": [{"index": 0, "name": "fake", "nbytes": geo.region_nbytes,
                                    "geometry": geo.to_json()}],
                       "geometry": geo.to_json(), "lease": [], "op_table": {}}
            socket.send_fds(conn, [m.pack_json(m.WELCOME, welcome)], [fd])
            os.close(fd)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(rdir))
    try:
        with pytest.raises(ConnectError, match=says):
            Client(worker_name, connect_timeout_s=5)
    finally:
        t.join(10)
        listener.close()
        path.unlink()
    fds = os.listdir("/proc/self/fd")
    assert not [f for f in fds if "memfd:fake" in _readlink(f"/proc/self/fd/{f}")], "a refused fd was kept open"


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


# ------------------------------------------------------------ 2. the same uid, without ptrace rights


@needs_root
def test_same_uid_process_finds_no_door_to_the_regions(users: list[tuple[int, int]],
                                                       scratch_dirs: Callable[[str], Path], worker_name: str) -> None:
    user = users[0]
    rdir = scratch_dirs("same")
    procs: list[subprocess.Popen[str]] = []
    try:
        watcher = as_user(user, "watch", "8")  # (a) inotify on /dev/shm during every HELLO and call below
        procs.append(watcher)
        assert line(watcher) == "watching"
        w = as_user(user, "worker", worker_name, "--slots", "64K:8,1M:2", "--lease", "2,1", "--backend", "numpy",
                    "--no-mlock", "--log-level", "WARNING", rdir=rdir)
        procs.append(w)
        assert "ready" in line(w)
        plain = as_user(user, "client", worker_name, rdir=rdir)
        hardened = as_user(user, "client", worker_name, "--non-dumpable", rdir=rdir)
        procs += [plain, hardened]
        pids = [int(line(c).split()[1]) for c in (plain, hardened)]
        att = as_user(user, "attacker", str(w.pid), str(pids[0]))
        att2 = as_user(user, "attacker", str(w.pid), str(pids[1]))
        procs += [att, att2]
        seen, seen2 = json.loads(line(att)), json.loads(line(att2))
        created = json.loads(line(watcher, 20))
        for c in (plain, hardened):
            rc, _, err = finish(c, wait_s=30)
            assert rc == 0, err
        rc, _, err = finish(w, signal.SIGTERM)
        assert rc == 0, err
    finally:
        for p in procs:
            finish(p)
    mine = f"shmrpc.{worker_name}."  # other suites on this machine may create names of their own meanwhile
    assert [n for n in created if n.startswith(mine)] == [], f"region names appeared in /dev/shm: {created}"
    assert [n for n in seen["shm"] if n.startswith(mine)] == []
    worker = seen["worker"]  # non-dumpable (the default): /proc/<worker>/fd and /mem are shut
    assert worker["fd_dir"] == "PermissionError" and worker["mem"] == "PermissionError", worker
    assert worker["opened_memfds"] == [] and worker["map_files_opened"] == [], worker
    client = seen["client"]  # dumpable client: holds no fd of a region, so /proc/<client>/fd has no door
    assert client["fd_dir"] == "ok" and client["memfd_links"] == [] and client["opened_memfds"] == [], client
    assert client["map_files_opened"] == [], client  # needs CAP_SYS_ADMIN
    assert client["maps_memfd"], "the mapping should be visible in maps (it has no name to open)"
    assert client["mem"] == "ok", "a dumpable client's memory is readable by its uid (documented)"
    hard = seen2["client"]  # Client(non_dumpable=True): /mem shut too
    assert hard["mem"] == "PermissionError" and hard["fd_dir"] == "PermissionError", hard


# ------------------------------------------------------------ 3. identity from the kernel


def test_hello_claims_must_match_the_kernel(worker: WorkerProc) -> None:
    for changes, field in (({"pid": worker.pid}, "pid"), ({"pid": 1}, "pid"), ({"pid": float("inf")}, "pid"),
                           ({"uid": os.getuid() + 1}, "uid"), ({"start_ticks": None}, "start_ticks"),
                           ({"start_ticks": 1}, "start_ticks")):
        frame, body = attach_hello(worker.name, hello_body(**changes))
        assert frame[:1] == m.ERROR and body["kind"] == "refused" and body["field"] == field, (changes, body)
    frame, body = attach_hello(worker.name, hello_body())
    assert frame[:1] == m.WELCOME, body
    with Client(worker.name) as c:
        state = _status(c)
    assert worker.pid not in [x["pid"] for x in state["clients"]], "a lease in the worker's own name"


def test_frames_from_a_stranger_cannot_act_in_a_session(worker: WorkerProc) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint(worker.name))
        with Client(worker.name, timeout_s=10) as c:
            slot = c._slots.free[0]
            s.send(m.pack_json(m.HELLO, hello_body()))  # HELLO on ZeroMQ: pointed to the attach socket
            assert s.poll(5000)
            body = m.unpack_json(s.recv())
            assert body["kind"] == "bad_message" and str(attach_path(worker.name)) in body["message"]
            s.send(m.pack_call(slot.region, slot.index, 9, slot.generation))  # a doorbell for c's slot
            assert s.poll(5000)
            _, _, _, status = m.unpack_done(s.recv())
            assert status & 0x8000, "the stranger's doorbell must be refused, the slot untouched"
            s.send(m.BYE)  # must not end c's session
            np.testing.assert_array_equal(c.call("scale", x=np.ones(4), a=2.0)["out"], 2.0)
            assert len(_status(c)["clients"]) == 1
    finally:
        s.close()
        ctx.term()


def _status(c: Client) -> dict:
    """The worker's STATE, asked through a live session."""
    c._control.pop(None, None)
    c._t.send(m.STATUS)  # STATE answers with no id: it lands under None
    c._pump(time.monotonic() + 5, lambda: None in c._control)
    return c._control.pop(None).to_json()


# ------------------------------------------------------------ --allow-uid


@needs_root
def test_allow_uid_admits_that_user_and_no_other(users: list[tuple[int, int]], scratch_dirs: Callable[[str], Path],
                                                 spawn_worker: Callable[..., WorkerProc], worker_name: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    allowed, other = users
    shared, private = scratch_dirs("shared"), scratch_dirs("private")
    monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(shared))
    w = spawn_worker("--allow-uid", str(allowed[0]))
    assert os.stat(shared).st_mode & 0o777 == 0o711
    monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(private))
    w2 = spawn_worker(name=worker_name + "p")
    try:
        ok = as_user(allowed, "client", w.name, "--worker-uid", "0", rdir=shared)
        assert line(ok).startswith("ready"), "the allowed uid could not use the worker"
        refused = as_user(other, "client", w.name, "--worker-uid", "0", rdir=shared)
        got = line(refused)
        assert got.startswith("ConnectError") and f"uid {other[0]} may not use this worker" in got, got
        closed = as_user(allowed, "client", w2.name, "--worker-uid", "0", rdir=private)
        got = line(closed)
        assert got.startswith("ConnectError") and f"--allow-uid {allowed[0]}" in got, got
        rc, _, err = finish(ok, wait_s=30)  # after its stdin closes it leaves on its own
        assert rc == 0, err
        for p in (refused, closed):
            finish(p)
        # `shmrpc status`: refused in one line, to the allowed uid (by the worker) and to the other (by the directory)
        for user, d, why in ((allowed, shared, "STATUS is answered to the worker's uid and root only"),
                             (other, private, "is not yours")):
            rc, out, err = finish(as_user(user, "status", w.name if d == shared else w2.name, rdir=d), wait_s=30)
            assert rc == 1 and why in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    finally:
        for p, d in ((w, shared), (w2, private)):
            monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(d))
            assert p.stop() == 0, p.stderr


def test_a_flood_of_connections_keeps_no_admitted_user_out(users: list[tuple[int, int]],
                                                           scratch_dirs: Callable[[str], Path],
                                                           spawn_worker: Callable[..., WorkerProc],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the attach socket of a worker started with --allow-uid is reachable by every uid: connections that send no HELLO
    # once took every place waiting for one (the oldest closed to make room), so no client got in. Now a uid the
    # worker does not admit is answered at once and closed, and room is made at the cost of the uid holding the most
    # places: a flood by an admitted uid costs that uid its own connections
    allowed, other = users
    rdir = scratch_dirs("flood")
    monkeypatch.setenv("SHMRPC_RUNTIME_DIR", str(rdir))
    w = spawn_worker("--allow-uid", str(allowed[0]))
    path = str(rdir / f"{w.name}.attach")
    floods = [as_user(u, "flood", path, "6", rdir=rdir) for u in (other, other, allowed)]
    try:
        for f in floods:
            assert line(f) == "flooding"
        time.sleep(0.5)
        for _ in range(10):  # the worker's own uid, while three floods run
            with Client(w.name, timeout_s=10, connect_timeout_s=5) as c:
                np.testing.assert_array_equal(c.call("vector_add", x=np.ones(4), y=np.ones(4))["out"], 2.0)
        ok = as_user(allowed, "client", w.name, "--worker-uid", "0", rdir=rdir)
        assert line(ok).startswith("ready"), "the allowed uid could not connect during the flood"
        finish(ok, wait_s=30)
        made = [int(line(f, 30).split()[1]) for f in floods]
        assert min(made) > 100, made  # (the floods did run)
    finally:
        for f in floods:
            finish(f)
    assert w.stop() == 0, w.stderr

