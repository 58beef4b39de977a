"""Dynamic batching on a real worker: requests of one batchable plan that queue up while the loop is busy run
as one batch, each answered in its own slot with its own result or its own typed error.

Batches are made to form deterministically: the worker is stopped (SIGSTOP), several requests are sent (from
several slots of one client over ZeroMQ, or from several client processes over their lanes), the test waits
until every doorbell is where the worker will find it in one turn (the worker's socket buffer, or the lanes'
pages), then continues the worker (SIGCONT). ``shmrpc_batch_size{op}`` tells which batches ran.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from sockq import wait_unread
from support.metrics import samples
from wire import stopped

from shmrpc.client import Client, KernelError
from shmrpc.schema import messages as m

from .conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

#: One CALL on the wire: ZMTP's flags and length bytes, then the frame.
_CALL_WIRE_NBYTES = 2 + m.CALL_STRUCT.size

USER_OPS = '''
from shmrpc.kernels.api import OpSpec, register_op


def _rule(i, a):
    return {"out": i["x"]}


def _impl(call):
    x = call.inputs["x"]
    if (x == 13.0).any():  # the marked input
        raise ValueError("13 is not allowed here")
    return {"out": call.xp.multiply(x, 2, out=call.dest("out"))}


register_op(OpSpec("t_bdouble", inputs=("x",), outputs=("out",), infer=_rule, numpy=_impl, batch=True,
                   elementwise=True, inplace=True))
register_op(OpSpec("t_double_alone", inputs=("x",), outputs=("out",), infer=_rule, numpy=_impl,
                   elementwise=True, inplace=True))
'''


def _samples(w: WorkerProc) -> dict[str, float]:
    return samples(w.ready_line)


def _batches(w: WorkerProc, op: str) -> tuple[int, int]:
    """(batches run, requests in them) for ``op``, from the worker's metrics."""
    s = _samples(w)
    return int(s.get(f'shmrpc_batch_size_count{{op="{op}"}}', 0)), int(s.get(f'shmrpc_batch_size_sum{{op="{op}"}}', 0))


def _answered(w: WorkerProc, op: str, status: str = "ok") -> int:
    return int(_samples(w).get(f'shmrpc_requests_total{{op="{op}",status="{status}"}}', 0))


def _joint() -> dict[str, str]:
    """The environment of a worker whose NumPy backend joins batches: it runs a batch item by item unless
    asked (kernels/_backend_numpy.py), and a worker parks requests for a batch only when its backend joins."""
    return dict(os.environ, SHMRPC_NUMPY_BATCH_JOINT="1")


def _user_ops_env(tmp_path: Path, mod: str) -> dict[str, str]:
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(USER_OPS))
    old = os.environ.get("PYTHONPATH", "")
    return dict(_joint(), PYTHONPATH=os.pathsep.join([str(tmp_path), *([old] if old else [])]))


def _submit_stopped(w: WorkerProc, c: Client, op: str, xs: list[np.ndarray], **kw: object) -> list[dict]:
    """Send one request per array while the worker is stopped, continue it once all wait in its socket."""
    c.call("echo", x=np.zeros(1, np.float32))  # the ZeroMQ handshake is done (libzmq holds messages until then)
    with stopped(w.pid):
        futs = [c.submit(op, x=x, in_place=True, **kw) for x in xs]  # type: ignore[arg-type]
        wait_unread(len(xs) * _CALL_WIRE_NBYTES)
    outs = []
    for f in futs:
        try:
            outs.append(f.result(timeout=30))
        except Exception as e:  # noqa: BLE001 - the caller checks which failed
            outs.append({"error": e})
    return outs


@pytest.mark.parametrize("extra", [(), ("--inline-max", "0")], ids=["inline", "executor"])
def test_requests_queued_together_run_as_one_batch(spawn_worker: Callable[..., WorkerProc],
                                                   extra: tuple[str, ...]) -> None:
    w = spawn_worker("--metrics-port", "0", *extra, lease="8,1,0,0", env=_joint())
    rng = np.random.default_rng(12)
    xs = [rng.standard_normal(16).astype(np.float32) for _ in range(6)]
    with Client(w.name, timeout_s=30) as c:
        c.call("scale", x=xs[0], a=3.0, b=1.0, in_place=True)  # served alone: not a batch
        assert _batches(w, "scale") == (0, 0)
        outs = _submit_stopped(w, c, "scale", xs, a=3.0, b=1.0)
        for x, out in zip(xs, outs):
            np.testing.assert_allclose(out["out"], 3.0 * x + 1.0, rtol=1e-6)
        assert _batches(w, "scale") == (1, 6)
        assert _answered(w, "scale") == 7
        # the next lone request is served alone again
        np.testing.assert_allclose(c.call("scale", x=xs[1], a=2.0, in_place=True)["out"], 2.0 * xs[1], rtol=1e-6)
        assert _batches(w, "scale") == (1, 6)


def test_batch_wait_holds_a_lone_request_for_the_rest_of_its_batch(spawn_worker: Callable[..., WorkerProc]) -> None:
    """--batch-wait-us: after a batch of 3, requests that arrive one by one are held (the loop spinning) until 3
    are parked, and run as one batch; a lone one is held for the whole wait, then runs alone; every answer right."""
    wait_s = 0.01  # the most the setting allows: a test thread sends three requests well within it
    w = spawn_worker("--metrics-port", "0", "--batch-wait-us", str(int(wait_s * 1e6)), lease="8,1,0,0",
                     env=_joint())
    rng = np.random.default_rng(21)
    xs = [rng.standard_normal(16).astype(np.float32) for _ in range(7)]
    with Client(w.name, timeout_s=30) as c:
        outs = _submit_stopped(w, c, "scale", xs[:3], a=3.0, b=1.0)
        assert _batches(w, "scale") == (1, 3)
        futs = [c.submit("scale", x=x, a=3.0, b=1.0, in_place=True) for x in xs[3:6]]  # one by one, not stopped
        outs += [f.result(timeout=30) for f in futs]
        for x, out in zip(xs, outs):
            np.testing.assert_allclose(out["out"], 3.0 * x + 1.0, rtol=1e-6)
        assert _batches(w, "scale") == (2, 6), "the three requests sent one by one ran as one batch"
        t0 = time.monotonic()
        out = c.call("scale", x=xs[6], a=3.0, b=1.0, in_place=True)["out"]  # alone: held for the whole wait
        held = time.monotonic() - t0
        np.testing.assert_allclose(out, 3.0 * xs[6] + 1.0, rtol=1e-6)
        assert held >= 0.8 * wait_s and _batches(w, "scale") == (2, 6), held
        assert _answered(w, "scale") == 7


def test_one_batch_per_plan_and_at_most_max_batch(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--metrics-port", "0", "--max-batch", "3", lease="8,1,0,0", env=_joint())
    rng = np.random.default_rng(3)
    small = [rng.standard_normal(16).astype(np.float32) for _ in range(4)]
    wide = [rng.standard_normal(32).astype(np.float32) for _ in range(2)]
    with Client(w.name, timeout_s=30) as c:
        # arrival order: s w s s w s  ->  plan (16,): batch of 3, then a lone one; plan (32,): batch of 2
        xs = [small[0], wide[0], small[1], small[2], wide[1], small[3]]
        outs = _submit_stopped(w, c, "gelu", xs)
        for x, out in zip(xs, outs):
            ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
            np.testing.assert_allclose(out["out"], ref, rtol=1e-5, atol=1e-6)
        assert _batches(w, "gelu") == (2, 5)
        assert _answered(w, "gelu") == 6


def test_max_batch_1_never_batches(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--metrics-port", "0", "--max-batch", "1", lease="8,1,0,0", env=_joint())
    xs = [np.full(16, i, np.float32) for i in range(5)]
    with Client(w.name, timeout_s=30) as c:
        outs = _submit_stopped(w, c, "vector_add", xs, y=np.ones(16, np.float32))
        for x, out in zip(xs, outs):
            np.testing.assert_array_equal(out["out"], x + 1)
        assert _batches(w, "vector_add") == (0, 0)
        assert _answered(w, "vector_add") == 5


def test_a_backend_that_does_not_join_runs_each_request_as_it_comes(spawn_worker: Callable[..., WorkerProc]
                                                                    ) -> None:
    w = spawn_worker("--metrics-port", "0", lease="8,1,0,0")  # the NumPy backend's default: item by item
    xs = [np.full(16, i, np.float32) for i in range(5)]
    with Client(w.name, timeout_s=30) as c:
        outs = _submit_stopped(w, c, "vector_add", xs, y=np.ones(16, np.float32))
        for x, out in zip(xs, outs):
            np.testing.assert_array_equal(out["out"], x + 1)
        assert _batches(w, "vector_add") == (0, 0)  # queued together, yet never parked for a batch
        assert _answered(w, "vector_add") == 5


def test_a_bad_request_in_a_batch_fails_alone(spawn_worker: Callable[..., WorkerProc], tmp_path: Path,
                                              worker_name: str) -> None:
    mod = "batchops_" + worker_name.replace("-", "_")
    w = spawn_worker("--metrics-port", "0", "--ops", mod, lease="8,1,0,0", env=_user_ops_env(tmp_path, mod))
    xs = [np.arange(16, dtype=np.float32) + 20 * (i + 1) for i in range(5)]
    xs[2][5] = 13.0  # the marked input: this request's op raises
    with Client(w.name, timeout_s=30) as c:
        outs = _submit_stopped(w, c, "t_bdouble", xs)
        for i, (x, out) in enumerate(zip(xs, outs)):
            if i == 2:
                err = out["error"]
                assert isinstance(err, KernelError) and "13 is not allowed" in str(err)
                assert (err.op, err.step) == ("t_bdouble", 0)
            else:
                assert "out" in out, out
                np.testing.assert_array_equal(out["out"], 2 * x)
        assert _batches(w, "t_bdouble") == (1, 5)
        assert _answered(w, "t_bdouble") == 4 and _answered(w, "t_bdouble", "KernelError") == 1
        # an op that does not say batch=True never batches
        outs = _submit_stopped(w, c, "t_double_alone", xs[:2] + xs[3:])
        for x, out in zip(xs[:2] + xs[3:], outs):
            np.testing.assert_array_equal(out["out"], 2 * x)
        assert _batches(w, "t_double_alone") == (0, 0)
        assert _answered(w, "t_double_alone") == 4
    assert w.proc.poll() is None


LANE_CLIENT = '''
import sys
import numpy as np
from shmrpc.client import Client
from shmrpc.client._lane import ClientLane

name, k = sys.argv[1], int(sys.argv[2])
c = Client(name, timeout_s=30, lane="block")
assert c._t.lane is not None, "no lane granted"
ring = ClientLane.ring


def rung(self, frame, request_id, *rest):  # the doorbell is in the lane's page: say so (the test waits for it)
    ring(self, frame, request_id, *rest)
    print("rung", flush=True)


ClientLane.ring = rung
x = np.full(16, k, np.float32)
print("ready", flush=True)
sys.stdin.readline()
out = c.call("vector_add", x=x, y=np.ones(16, np.float32), in_place=True)["out"]
print("out", " ".join(str(v) for v in out.tolist()), flush=True)
c.close()
'''


def test_lane_requests_of_several_clients_batch_too(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--metrics-port", "0", env=_joint())
    procs = [subprocess.Popen([sys.executable, "-c", LANE_CLIENT, w.name, str(k)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for k in range(4)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        with stopped(w.pid):
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            for p in procs:  # each doorbell is in its lane's page before the worker continues
                assert p.stdout is not None and p.stdout.readline().strip() == "rung"
        for k, p in enumerate(procs):
            out, _ = p.communicate(timeout=60)
            assert p.returncode == 0
            values = re.findall(r"^out (.*)$", out, re.M)
            assert values and [float(v) for v in values[0].split()] == [k + 1.0] * 16
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    assert _batches(w, "vector_add") == (1, 4)
    assert _answered(w, "vector_add") == 4


def test_launched_runs_beside_batches_answer_every_request(spawn_worker: Callable[..., WorkerProc]) -> None:
    """The loop's launched path (a large request launched and answered when done, batches launched and their
    followers parked meanwhile), run through NumPy's joint mode: a large request of one client and small
    batchable calls of four others, all at once, every answer checked."""
    import threading

    w = spawn_worker("--metrics-port", "0", env=_joint(), slots="64K:16,4M:2", lease="2,1")
    stop = threading.Event()
    wrong: list[str] = []
    answered = [0] * 4

    def small(k: int) -> None:
        with Client(w.name, timeout_s=60, lane="block" if k % 2 else None) as c:
            rng = np.random.default_rng(k)
            while not stop.is_set():
                x = rng.standard_normal(16).astype(np.float32)
                out = c.call("scale", x=x, a=float(k + 2))["out"]
                if not np.array_equal(out, x * np.float32(k + 2)):
                    wrong.append(f"client {k}")
                answered[k] += 1

    threads = [threading.Thread(target=small, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        n = (1 << 20) // 4 + 3  # 1 MiB in, 1 MiB out: more than the loop runs itself
        with Client(w.name, timeout_s=60) as c, c.loan(3 << 20) as req:
            x = req.array("x", n, np.float32)
            for i in range(20):
                x[:] = np.arange(n, dtype=np.float32) * (i + 1) % 977
                out = req.send("scale", a=3.0, b=1.0)["out"]
                np.testing.assert_array_equal(out, x * np.float32(3.0) + np.float32(1.0), err_msg=f"request {i}")
                del out
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not wrong and all(answered)
