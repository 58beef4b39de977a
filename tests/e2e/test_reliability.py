"""Reliability: a client racing its own request, backpressure, and clients killed at each point of a call.

* Races: a thread keeps writing random bytes into the slot (tensors and descriptor area) while
  the request is in flight; the worker never crashes, answers each call with a success or a
  typed error, and another client's slot is byte-identical afterwards. (A doorbell for a slot
  the client does not lease: ``test_validation.py::test_slot_of_another_client_is_refused_and_untouched``.)
* Backpressure: ``on_busy="wait"`` waits for a slot and then succeeds; a wait that runs out
  raises :class:`BusyError`; more requests than slots all complete with the right answers.
* Client death (SIGKILL) before the doorbell, while the worker computes, while the client reads
  the response: every slot comes back within 2 s, zeroed, and a bystander client's calls all succeed.

Multi-process tests print their seed (the suite's, fixed; ``SHMRPC_TEST_SEED`` to try another).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from support import fuzz, seeds
from wire import WAITING_OPS, stopped, wait_for_state, worker_state

from shmrpc.client import BusyError, Client, RequestError, Timeout
from shmrpc.schema.control import Acquire

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

HERE = Path(__file__).resolve().parent
PROCS = str(HERE / "procs.py")
PROCS_REL = str(HERE / "procs_reliability.py")




# ------------------------------------------------------------ races


def test_writing_into_the_slot_after_the_doorbell_never_hurts_the_worker(worker: WorkerProc) -> None:
    seed = seeds.SEED
    print("seed", seed)
    rng = np.random.default_rng(seed)
    noise = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    outcomes: dict[str, int] = {}
    with Client(worker.name, timeout_s=10) as a, Client(worker.name, timeout_s=10) as b:
        canary = b.loan(50_000)
        cv = np.frombuffer(canary._s.buf, np.uint8)
        cv[:] = rng.integers(0, 256, cv.size, dtype=np.uint8)
        before = cv.copy()
        with a.loan(60_000) as req:
            x = req.array("x", 7000, np.float32)
            slot = np.frombuffer(req._s.buf, np.uint8)
            stop = threading.Event()

            def racer(buf: np.ndarray) -> None:
                r = np.random.default_rng(seed + 1)
                while not stop.is_set():
                    lo = int(r.integers(16, buf.size - 4096))  # descriptor area and tensors; not the header
                    n = int(r.integers(1, 4096))
                    buf[lo:lo + n] = noise[:n]

            t0 = time.monotonic()
            n_calls = 0
            while time.monotonic() - t0 < 3.0 and n_calls < 400:
                x[:] = 1.0
                stop.clear()
                th = threading.Thread(target=racer, args=(slot,))
                th.start()
                try:
                    out = req.send("scale", a=2.0, timeout_s=5)["out"]
                    kind = "ok"
                    del out
                except RequestError as e:  # typed: the worker refused what it read, or the answer was mangled
                    kind = type(e).__name__
                finally:
                    stop.set()
                    th.join()
                outcomes[kind] = outcomes.get(kind, 0) + 1
                n_calls += 1
                assert worker.proc.poll() is None
            del x, slot
        print("outcomes", outcomes)
        assert sum(outcomes.values()) == n_calls
        assert outcomes.get("InternalError", 0) == 0
        np.testing.assert_array_equal(cv, before)  # nothing written outside a's slot
        del cv
        canary.release()
        np.testing.assert_array_equal(a.call("scale", x=np.ones(5), a=3.0)["out"], 3.0)
        np.testing.assert_array_equal(b.call("scale", x=np.ones(5), a=3.0)["out"], 3.0)


def test_response_changed_in_the_slot_is_a_typed_error(worker: WorkerProc, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client reads the response from shared memory too: a shape that no longer matches its bytes, or an
    output name the request did not ask for (as a process writing into the slot after the DONE could leave
    them), is a RequestError naming the field."""
    from shmrpc.client import _loan

    real = _loan._decode

    def mangled(payload: bytes) -> Any:
        r = real(payload)
        t = r.outputs[0]
        return dataclasses.replace(r, outputs=(t._replace(shape=(t.shape[0] + 1,)),))

    with Client(worker.name, timeout_s=10) as c, c.loan(4096) as req:
        req.array("x", 64, np.float32)[...] = 1.0
        np.testing.assert_array_equal(req.send("echo")["out"], 1.0)
        # the client checks a response's bytes once and remembers them as checked (the client's table, and the
        # loan's last response); these patches change what the same bytes decode to, so both memories are emptied
        # with each (changed bytes are a new key anyway)
        monkeypatch.setattr(_loan, "_decode", mangled)
        c._out_checks.clear()
        req._out_views = None
        with pytest.raises(RequestError) as e:
            req.send("echo")
        assert e.value.field == "shape" and e.value.tensor == "out"
        monkeypatch.setattr(_loan, "_decode", lambda payload: dataclasses.replace(
            real(payload), outputs=tuple(t._replace(name="tuo") for t in real(payload).outputs)))
        c._out_checks.clear()
        req._out_views = None
        with pytest.raises(RequestError) as e:  # a renamed output: not what the request asked for
            req.send("echo")
        assert e.value.field == "outputs"
        monkeypatch.setattr(_loan, "_decode", real)
        np.testing.assert_array_equal(req.send("echo")["out"], 1.0)  # the loan and the worker carry on


# ------------------------------------------------------------ backpressure


def test_on_busy_wait_waits_for_a_slot_then_succeeds(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker(slots="64K:2,1M:1", lease="1,0")
    with Client(w.name, timeout_s=10) as a, Client(w.name, timeout_s=10, on_busy="wait") as b:
        la = a.loan(200_000)  # a borrows the only 1M slot

        def release_once_b_waits() -> None:  # ordered by the worker's state: b's ACQUIRE is queued
            try:
                wait_for_state(w.name, lambda st: st["pending_acquires"] >= 1, "b's ACQUIRE queued")
            finally:
                la.release()

        releaser = threading.Thread(target=release_once_b_waits)
        releaser.start()
        try:
            out = b.call("echo", x=np.arange(100_000, dtype=np.int32))["out"]
        finally:
            releaser.join(60)
        np.testing.assert_array_equal(out, np.arange(100_000, dtype=np.int32))


def test_on_busy_wait_that_runs_out_raises_busy(spawn_worker: Callable[..., WorkerProc]) -> None:
    """The client raises BusyError (not Timeout) when no slot frees within the call's timeout."""
    w = spawn_worker(slots="64K:2,1M:1", lease="1,0")
    with Client(w.name, timeout_s=10) as a, Client(w.name, timeout_s=0.5, on_busy="wait") as b:
        with a.loan(200_000):
            t0 = time.monotonic()
            with pytest.raises(BusyError) as e:
                b.call("echo", x=np.zeros(100_000, np.uint8))
            waited = time.monotonic() - t0
        assert not isinstance(e.value, Timeout)
        assert 0.4 < waited < 10, waited  # it waited out its 0.5 s, and did not hang
        np.testing.assert_array_equal(b.call("echo", x=np.ones(100_000, np.uint8), timeout_s=5)["out"], 1)


def test_every_slot_wait_that_runs_out_raises_busy(spawn_worker: Callable[..., WorkerProc]) -> None:
    """Threads beyond the two a client lets wait at the worker, and a wait the worker never answers (stopped), end
    in BusyError too, the latter soon after the deadline (not a second later)."""
    w = spawn_worker(slots="64K:2,1M:1", lease="1,0")
    with Client(w.name, timeout_s=10) as a, Client(w.name, timeout_s=0.5, on_busy="wait") as b:
        with a.loan(200_000):
            errors: list[BaseException] = []

            def run() -> None:
                try:
                    b.call("echo", x=np.zeros(100_000, np.uint8))
                except BaseException as e:  # noqa: BLE001 (checked below)
                    errors.append(e)

            threads = [threading.Thread(target=run) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert len(errors) == 4, errors
            assert all(type(e) is BusyError and e.field == "nbytes" for e in errors), errors
            os.kill(w.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(BusyError) as e:
                    b.call("echo", x=np.zeros(100_000, np.uint8))
                waited = time.monotonic() - t0
            finally:
                os.kill(w.pid, signal.SIGCONT)
            assert e.value.field == "nbytes" and not isinstance(e.value, Timeout)
            assert 0.4 < waited < 1.3, waited  # the deadline and a short grace for the worker's BUSY
        np.testing.assert_array_equal(b.call("echo", x=np.ones(100_000, np.uint8), timeout_s=5)["out"], 1)


def test_a_wait_for_a_slot_its_own_request_holds_ends_when_that_request_is_answered(
        spawn_worker: Callable[..., WorkerProc], tmp_path: Path, worker_name: str) -> None:
    """A call needing the client's only large slot, held by its own request in flight, goes out once that request
    is answered, though another request of the client stays in flight (until 2026-12-05 it waited for fewer
    requests in flight than it had counted, which that request kept from happening: BusyError at its deadline)."""
    mod = "waiting_" + worker_name.replace("-", "_")
    (tmp_path / f"{mod}.py").write_text(WAITING_OPS)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    w = spawn_worker("--ops", mod, slots="64K:6,1M:1", lease="4,1", env=env)
    flag = tmp_path / "go"
    with Client(w.name, timeout_s=10, on_busy="wait") as c, Client(w.name, timeout_s=10) as a, \
            a.loan(200_000), a.loan(200_000):  # a's own large slot, and the pool's: c has only its own
        flag.touch()  # the signatures known first: no questions to a stopped worker below
        np.testing.assert_array_equal(c.call("t_wait", x=np.ones(8, np.float32), path=str(flag))["out"], 1.0)
        np.testing.assert_array_equal(c.call("echo", x=np.ones(200_000, np.uint8))["out"], 1)
        flag.unlink()
        got: list[Any] = []

        def large() -> None:
            try:
                got.append(c.call("echo", x=np.full(200_000, 7, np.uint8), timeout_s=3)["out"])
            except BaseException as e:  # noqa: BLE001 (checked below)
                got.append(e)

        big = threading.Thread(target=large)
        with stopped(w.pid):
            held = c.submit("echo", x=np.full(300_000, 5, np.uint8))  # in flight in c's large slot
            big.start()
            time.sleep(0.2)  # it found that slot busy with a request of its own, and asked the pool
            waiting = c.submit("t_wait", x=np.full(8, 3.0, np.float32), path=str(flag))  # in flight until the flag
        try:
            np.testing.assert_array_equal(held.result(10)["out"], 5)
            del held
            big.join(10)
            assert not big.is_alive()
            assert not waiting.done()
        finally:
            flag.touch()
        np.testing.assert_array_equal(waiting.result(10)["out"], 3.0)
        assert len(got) == 1 and not isinstance(got[0], BaseException), got
        np.testing.assert_array_equal(got[0], 7)


def test_a_late_grant_goes_back_with_release(spawn_worker: Callable[..., WorkerProc]) -> None:
    """A GRANT arriving after its ACQUIRE gave up is matched by id and given back, not kept or dropped."""
    w = spawn_worker(slots="64K:2,1M:1", lease="1,0")
    with Client(w.name, timeout_s=10) as a, Client(w.name, timeout_s=10) as b:
        la = a.loan(200_000)  # a borrows the only 1M slot
        with pytest.raises(Timeout):  # b stops waiting long before the worker would give up its ACQUIRE
            b._ask(Acquire(200_000, wait_s=60), time.monotonic() + 0.3)
        wait_for_state(w.name, lambda st: st["pending_acquires"] == 1, "b's ACQUIRE queued")
        la.release()
        wait_for_state(w.name, lambda st: st["pending_acquires"] == 0, "b's ACQUIRE granted")
        # b reads the late GRANT with its next reply, and gives the slot back at once
        np.testing.assert_array_equal(b.call("echo", x=np.arange(4))["out"], np.arange(4))
        wait_for_state(w.name, lambda st: not any(s[3] for c in st["clients"] for s in c["slots"]),
                       "no borrowed slot left")
        with a.loan(200_000):  # the 1M slot is free again
            pass


def test_more_callers_than_slots_all_complete(spawn_worker: Callable[..., WorkerProc]) -> None:
    """6 threads x 20 calls through one Client, and a second Client at once, on 4 slots: nothing dropped."""
    w = spawn_worker(slots="64K:4", lease="2")
    seed = seeds.SEED + 100
    print("seed", seed)
    errors: list[BaseException] = []
    done: list[int] = []

    def run(c: Client, k: int) -> None:
        rng = np.random.default_rng(seed + k)
        try:
            for _ in range(20):
                x = rng.standard_normal(int(rng.integers(1, 3000))).astype(np.float32)
                np.testing.assert_array_equal(c.call("scale", x=x, a=2.0, b=-1.0)["out"],
                                              x * np.float32(2.0) - np.float32(1.0))
                done.append(k)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with Client(w.name, timeout_s=30) as c1, Client(w.name, timeout_s=30) as c2:
        threads = [threading.Thread(target=run, args=(c1 if k < 6 else c2, k)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert len(done) == 8 * 20


def test_more_futures_than_slots_all_complete(spawn_worker: Callable[..., WorkerProc]) -> None:
    """Regression (found by this test): answered futures give their slots to new submits."""
    w = spawn_worker(slots="64K:1", lease="1")
    with Client(w.name, timeout_s=3) as c:
        xs = [np.full(10, float(i)) for i in range(4)]
        futs = [c.submit("scale", x=x, a=2.0) for x in xs]  # more futures than slots
        for x, f in zip(xs, futs):
            np.testing.assert_array_equal(f.result()["out"], 2 * x)


# ------------------------------------------------------------ client death at each point of a call


def _slots_of(name: str, pid: int) -> int:
    return sum(len(c["slots"]) for c in worker_state(name)["clients"] if c["pid"] == pid)


def _new_lease(name: str, want: int, within_s: float) -> tuple[float, bool]:
    """Connect raw sessions until one is leased ``want`` slots; (seconds it took, all its slots zero)."""
    t0 = time.monotonic()
    while True:
        s = fuzz.RawSession(name, timeout_s=5)
        try:
            if len(s.lease) >= want:
                zero = True
                for r, i, _ in s.lease:
                    v = s.slot(r, i)
                    zero &= not any(bytes(v))
                    v.release()
                return time.monotonic() - t0, zero
        finally:
            s.close()
        if time.monotonic() - t0 > within_s:
            return time.monotonic() - t0, False
        time.sleep(0.05)


@pytest.mark.parametrize("point", ["before", "computing", "reading"])
def test_client_killed_at_each_point_gives_every_slot_back_zeroed(spawn_worker: Callable[..., WorkerProc],
                                                                   point: str) -> None:
    # two clients' worth of slots: the victim's lease and the bystander's
    w = spawn_worker(slots="64K:8,8M:6", lease="4,3")
    seed = seeds.SEED + 200
    print("seed", seed, "point", point)
    bystander = subprocess.Popen([sys.executable, PROCS, "calls", w.name, str(seed), "300"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    victim = subprocess.Popen([sys.executable, PROCS_REL, point, w.name], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None
        line = victim.stdout.readline()
        assert line.startswith("ready"), line
        n_slots = int(line.split()[1])
        assert n_slots == 7 and _slots_of(w.name, victim.pid) == 7
        if point == "computing":
            t0 = time.monotonic()  # the doorbells may still be on their way: wait until the worker computes
            while worker_state(w.name)["in_flight"] == 0:
                assert time.monotonic() - t0 < 2, "the victim's requests never got in flight"
                time.sleep(0.005)
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        victim.wait(10)
        while worker_state(w.name)["slots_leased"] > 7 or _slots_of(w.name, victim.pid):  # only the bystander's left
            assert time.monotonic() - t0 < 2.0, f"the victim's slots were not all back within 2 s: {worker_state(w.name)}"
            time.sleep(0.02)
        took, zero = _new_lease(w.name, n_slots, 2.0)
        assert took < 2.0, f"the victim's {n_slots} slots were not all back within 2 s"
        assert zero, "a reclaimed slot was not zeroed"
        out, err = bystander.communicate(timeout=60)
        assert bystander.returncode == 0, err[-2000:]
        assert json.loads(out.strip().splitlines()[-1])["bad"] == 0
    finally:
        for p in (victim, bystander):
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)
    assert w.proc.poll() is None
    assert w.stop() == 0, w.stderr[-2000:]
