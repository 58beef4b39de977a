"""``shmrpc serve --devices`` (a supervisor of one worker per device) and the client's Pool, with NumPy workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from wire import reap_killed, stopped, wait_for_state

from shmrpc.client import Client, Pipeline, Pool, RequestError, Resident, WorkerGoneError
from shmrpc.schema.naming import device_worker_name, device_workers, socket_path
from shmrpc.schema.proc import read_stat
from shmrpc.server.lockfile import WorkerLock
from shmrpc.server.procs import pid_alive

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

SLOTS, LEASE = "64K:16,1M:4,4M:2,64M:1", "4,1,0,0"  # as tests/e2e/conftest.py: one worker per device


class _Supervisor:
    def __init__(self, prefix: str, devices: str) -> None:
        self.prefix = prefix
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shmrpc.server", "serve", "--name", prefix, "--devices", devices, "--slots", SLOTS,
             "--lease", LEASE, "--backend", "numpy", "--no-mlock", "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # the workers' ready lines, then the supervisor's
            if line.startswith(f"shmrpc supervisor {prefix} ready"):
                break
        else:
            pytest.fail(f"supervisor did not start: {self.proc.communicate(timeout=10)}")

    def worker_pid(self, device: int) -> int:
        return int(wait_for_state(device_worker_name(self.prefix, device), lambda st: True, "state")["pid"])

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        try:
            self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            _end_hung(self.proc)  # nothing left running for the next test to trip on
            raise
        return self.proc.returncode


def _children(pid: int) -> list[int]:
    """The live children of ``pid``."""
    found = []
    for entry in os.listdir("/proc"):
        fields = read_stat(int(entry)) if entry.isdigit() else None
        if fields and len(fields) > 1 and fields[1] == str(pid) and fields[0] not in ("Z", "X"):
            found.append(int(entry))
    return found


def _end_hung(sup: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """End a supervisor that did not exit: its workers first (SIGTERM, then SIGKILL), then it."""
    workers = _children(sup.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in filter(pid_alive, workers):
            os.kill(pid, sig)
        deadline = time.monotonic() + 10
        while any(map(pid_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
    sup.kill()
    sup.communicate(timeout=10)


@pytest.fixture
def supervisor(worker_name: str) -> Iterator[_Supervisor]:
    s = _Supervisor(worker_name, "0,1")
    yield s
    assert s.stop() == 0
    assert device_workers(worker_name) == []  # both workers exited cleanly: no sockets left


def test_sighup_stops_a_supervisor_as_sigterm_does(worker_name: str) -> None:
    # SIGHUP's default action ended the supervisor at once, its workers left to the parent-death signal
    s = _Supervisor(worker_name, "0,1")
    assert s.stop(signal.SIGHUP) == 0
    assert device_workers(worker_name) == []  # both workers drained and exited: no sockets left


def _slow(n: int = 20) -> Pipeline:
    p = Pipeline()
    for _ in range(n):
        p = p.then("scale", a=1.0)
    return p


def test_supervisor_names_one_worker_per_device(supervisor: _Supervisor) -> None:
    assert device_workers(supervisor.prefix) == [f"{supervisor.prefix}-0", f"{supervisor.prefix}-1"]
    for d in (0, 1):
        with Client(device_worker_name(supervisor.prefix, d), timeout_s=10) as c:
            np.testing.assert_array_equal(c.call("echo", x=np.arange(3.0))["out"], np.arange(3.0))


def _health_check() -> str:
    """The container's HEALTHCHECK command (deploy/Dockerfile), as sh runs it."""
    text = (Path(__file__).resolve().parents[2] / "deploy" / "Dockerfile").read_text()
    cmd = text.split("\nHEALTHCHECK ", 1)[1].split("\n\n", 1)[0]
    return cmd.split(" CMD ", 1)[1].replace("\\\n", " ")


def test_the_containers_health_check_sees_a_supervisors_workers(supervisor: _Supervisor) -> None:
    # under --devices (which the Dockerfile suggests) the workers are NAME-<device>: the health check asked for NAME,
    # which no worker is, and the container stayed unhealthy; it now asks NAME's workers too
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    for name, ready in ((supervisor.prefix, 0), (supervisor.prefix + "-1", 0), (supervisor.prefix + "x", 1)):
        got = subprocess.run(["sh", "-c", _health_check()], env={**env, "SHMRPC_NAME": name}, capture_output=True,
                             text=True, timeout=60)
        assert got.returncode == ready, (name, got.stdout, got.stderr)
    out = subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", supervisor.prefix, "--devices",
                          "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and sorted(json.loads(out.stdout)) == [f"{supervisor.prefix}-0", f"{supervisor.prefix}-1"]


def test_pool_spreads_calls_and_places_residents(supervisor: _Supervisor) -> None:
    with Pool(supervisor.prefix, timeout_s=30) as pool:
        assert sorted(pool.live) == [f"{supervisor.prefix}-0", f"{supervisor.prefix}-1"]
        futs = [pool.submit("vector_add", x=np.full(4, float(i)), y=np.ones(4)) for i in range(40)]
        for i, f in enumerate(futs):
            np.testing.assert_array_equal(f.result()["out"], i + 1.0)
        calls = [s["calls"] for s in pool.stats().values()]
        assert min(calls) >= 5, pool.stats()  # both workers took a share
        pool.put("bias", np.full(4, 10.0))  # on every worker
        for _ in range(6):
            np.testing.assert_array_equal(pool.call("vector_add", x=np.ones(4), y=Resident("bias"))["out"], 11.0)
        one = f"{supervisor.prefix}-1"
        pool.put("only", np.full(4, 5.0), worker=one)  # on one named worker: calls using it go there
        before = pool.stats()[one]["calls"]
        for _ in range(5):
            np.testing.assert_array_equal(pool.call("vector_add", x=np.ones(4), y=Resident("only"))["out"], 6.0)
        assert pool.stats()[one]["calls"] == before + 5
        pool.drop("only")
        pool.drop("bias")


def test_pool_call_is_the_chosen_clients_own_call(worker: WorkerProc) -> None:
    # Pool.call runs the member client's call() in the caller's thread: no future, no receiver thread, the client's
    # kept slot; `copy` is call()'s argument (through submit() it reached the worker as an attribute of the op)
    x, y = np.arange(8, dtype=np.float32), np.full(8, 2, np.float32)
    with Pool(workers=[worker.name], timeout_s=30) as pool:
        c = pool._members[worker.name].client
        assert c is not None
        for i in range(3):
            np.testing.assert_array_equal(pool.call("vector_add", x=x + i, y=y)["out"], x + i + 2)
        assert not c._inflight.snapshot()["receiving"] and len(c._kept) == 1
        view = pool.call("scale", x=x, a=3.0, copy=False)["out"]
        assert view.base is not None and c._kept == []  # a view of the slot: the loan is not kept
        np.testing.assert_allclose(pool.call("scale", x=x, a=5.0)["out"], 5 * x)
        np.testing.assert_allclose(view, 3 * x)  # the view's slot was not the next call's
        with pytest.raises(RequestError) as ei:  # a refused call: its own typed error, the pool's count back to 0
            pool.call("vector_add", x=x, y=np.zeros(3, np.float32))
        assert ei.value.field == "shape"
        assert pool.stats()[worker.name] == {"live": True, "pending": 0, "calls": 6}
        np.testing.assert_array_equal(pool.submit("vector_add", x=x, y=y).result()["out"], x + 2)  # beside submit()
        np.testing.assert_array_equal(pool.call("vector_add", x=x, y=y)["out"], x + 2)
        assert pool.stats()[worker.name]["pending"] == 0


def test_futures_of_a_dead_worker_fail_as_such_when_a_callback_closes_the_client(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    # the Pool's done-callback closes a member client at its first WorkerGoneError; the client's other futures must
    # still say the worker went (they said "the Client was closed before the answer came")
    worker = spawn_worker()
    with Pool(workers=[worker.name], timeout_s=30, rejoin_s=60) as pool:
        pool.submit("vector_add", x=np.ones(4), y=np.ones(4)).result()  # (submit() asks the outputs' size first)
        with stopped(worker.pid):  # the requests reach the socket and wait there
            futs = [pool.submit("vector_add", x=np.full(4, float(i)), y=np.ones(4)) for i in range(3)]
            os.kill(worker.pid, signal.SIGKILL)
        for f in futs:
            with pytest.raises(WorkerGoneError):
                f.result(timeout=10)
        assert pool.live == []
    reap_killed(worker)


def test_pool_survives_a_worker_death_and_the_worker_rejoins(supervisor: _Supervisor) -> None:
    with Pool(supervisor.prefix, timeout_s=60, rejoin_s=0.2) as pool:
        pool.put("bias", np.full(4, 1.0))
        victim = f"{supervisor.prefix}-0"
        pid = supervisor.worker_pid(0)
        c0 = pool._members[victim].client
        assert c0 is not None
        pending = c0.submit(_slow(), x=np.ones(3_500_000))
        wait_for_state(victim, lambda st: st["in_flight"] >= 1, "a request in flight")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerGoneError):
            pending.result()
        for _ in range(10):  # new calls go to the other worker
            np.testing.assert_array_equal(pool.call("vector_add", x=np.ones(4), y=Resident("bias"))["out"], 2.0)
        assert victim not in pool.live
        deadline = time.monotonic() + 60  # the supervisor restarts it; the pool finds it again
        while victim not in pool.live:
            assert time.monotonic() < deadline, "the restarted worker never rejoined the pool"
            pool.call("echo", x=np.ones(2))
            time.sleep(0.05)
        assert socket_path(victim).exists()
        with Client(victim, timeout_s=10) as c:
            assert "bias" not in c.resident()  # its residents are the pool client's, not this one's
        np.testing.assert_array_equal(  # the rejoined worker got the resident tensor again
            pool._members[victim].client.call("vector_add", x=np.ones(4), y=Resident("bias"))["out"], 2.0)  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_sigterm_as_the_supervisor_restarts_a_worker_stops_it_in_bounded_time(worker_name: str) -> None:
    # SIGTERM at every line the supervisor runs from the restart of a killed worker on (procs_supervisor.py):
    # each window of the restart and the stop, among them the main thread's locked ones, gets a signal.
    sup = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("procs_supervisor.py")), "serve", "--name", worker_name,
         "--devices", "0", "--slots", SLOTS, "--lease", LEASE, "--backend", "numpy", "--no-mlock",
         "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert sup.stdout is not None
        for line in sup.stdout:
            if line.startswith(f"shmrpc supervisor {worker_name} ready"):
                break
        else:
            pytest.fail(f"supervisor did not start: {sup.communicate(timeout=10)}")
        os.kill(int(wait_for_state(f"{worker_name}-0", lambda st: True, "state")["pid"]), signal.SIGKILL)
        out, err = sup.communicate(timeout=15)  # a stop bounded at stop_timeout_s (30 s) would be a bug here too
    except subprocess.TimeoutExpired:
        _end_hung(sup)
        pytest.fail("the supervisor did not exit within 15 s of SIGTERM during a worker's restart")
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.communicate(timeout=10)
    assert "storm" in err and "restarting in" in out, (out, err)
    assert sup.returncode == 0, err
    # The restarted worker, stopped before it removed what the killed one left, may have left that: the next
    # worker of the name removes it (and would refuse to start if the restarted one still ran).
    with WorkerLock.acquire(device_worker_name(worker_name, 0)):
        pass
    assert device_workers(worker_name) == []
