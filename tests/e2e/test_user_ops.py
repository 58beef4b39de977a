"""Users' ops served by a real worker: loading (--ops), the op table, sizing without out_nbytes, errors
inside an op, bad modules, and the per-session KV cache of the example decoder layer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from wire import WAITING_OPS

from shmrpc.client import Client, InvalidRequestError, KernelError, Pipeline, Resident, ResourceError

from .conftest import WorkerProc

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

FAULTY = '''
from shmrpc.kernels.api import AttrSpec, OpSpec, register_op


def _rule(i, a):
    if a["mode"] == "rule":
        raise RuntimeError("a bug in the rule")
    return {"out": i["x"]}


def _impl(call):
    mode = call.attrs["mode"]
    if mode == "raise":
        raise RuntimeError("the user op failed on purpose")
    if mode == "scribble":
        call.inputs["x"][...] = 42
    if mode == "exit":
        raise SystemExit(5)
    if mode == "shape":
        return {"out": call.xp.zeros((1,), call.xp.float32)}
    return {"out": call.xp.multiply(call.inputs["x"], 2, out=call.dest("out"))}


register_op(OpSpec("{name}", inputs=("x",), outputs=("out",), attrs={"mode": AttrSpec("str", "ok")},
                   infer=_rule, numpy=_impl{code}))
'''


def _faulty(name: str, code: str) -> str:
    return FAULTY.replace("{name}", name).replace("{code}", code)


def _env(*paths: Path) -> dict[str, str]:
    old = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([*(str(p) for p in paths), *([old] if old else [])]))


def _module(tmp_path: Path, mod: str, text: str) -> Path:
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(text))
    return tmp_path


def _serve(name: str, *extra: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--no-mlock",
                           "--backend", "numpy", "--slots", "64K:2", "--lease", "1", *extra],
                          capture_output=True, text=True, env=env, timeout=60)


def _status(name: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", name, "--json"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return json.loads(out)


@pytest.fixture
def ops_worker(spawn_worker: Callable[..., WorkerProc], tmp_path: Path, worker_name: str) -> WorkerProc:
    mod = "faulty_" + worker_name.replace("-", "_")
    _module(tmp_path, mod, _faulty("t_double", ""))
    return spawn_worker("--ops", f"decoder_ops,{mod}", "--resident-limit", "1M", env=_env(EXAMPLES, tmp_path))


def test_users_ops_are_in_the_op_table_and_status_like_builtins(ops_worker: WorkerProc) -> None:
    with Client(ops_worker.name, timeout_s=20) as c:
        e = c.op_table["kv_attend"]
        assert e.code >= 0x1000 and not e.builtin and e.backends == ("numpy", "cupy")
        assert c.op_table["gemm"].code == 10 and c.op_table["gemm"].builtin
        np.testing.assert_array_equal(c.call("t_double", x=np.arange(4, dtype=np.float32))["out"], [0, 2, 4, 6])
    ops = _status(ops_worker.name)["ops"]
    assert not ops["kv_attend"]["builtin"] and ops["kv_attend"]["module"] == "decoder_ops"
    text = subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", ops_worker.name],
                          capture_output=True, text=True, timeout=30).stdout
    assert "users' ops:" in text and "kv_attend" in text and "t_double" in text


def test_outputs_wider_than_the_inputs_need_no_out_nbytes(worker: WorkerProc) -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 2048)).astype(np.float32)  # 64 KiB of output from 1 KiB... of x
    with Client(worker.name, timeout_s=20) as c:
        np.testing.assert_allclose(c.call("gemm", x=x, w=w)["out"], x @ w, rtol=1e-4, atol=1e-4)
        c.put("w", w)
        for _ in range(3):  # resident input: sized from the rule too; the answer is cached per signature
            np.testing.assert_allclose(c.call("gemm", x=x, w=Resident("w"))["out"], x @ w, rtol=1e-4, atol=1e-4)
        assert len(c._sizer) == 2
        p = Pipeline().then("gemm").then("gelu")
        assert c.call(p, x=x, w=w)["1.out"].shape == (4, 2048)
        with pytest.raises(KernelError) as e:  # refused by the plan query, then by the request itself
            c.call("gemm", x=x, w=w[:4])
        assert (e.value.op, e.value.tensor, e.value.field) == ("gemm", "w", "shape")


def test_errors_inside_a_users_op_are_kernel_errors_and_the_worker_goes_on(ops_worker: WorkerProc) -> None:
    x = np.ones(8, np.float32)
    with Client(ops_worker.name, timeout_s=20) as c:
        with pytest.raises(KernelError, match="failed on purpose") as e:
            c.call("t_double", x=x, mode="raise")
        assert (e.value.op, e.value.step) == ("t_double", 0)
        with pytest.raises(KernelError, match="shape rule says") as e:
            c.call("t_double", x=x, mode="shape")
        assert (e.value.tensor, e.value.field) == ("out", "shape")
        np.testing.assert_array_equal(c.call("t_double", x=x)["out"], 2.0)
    assert ops_worker.proc.poll() is None


def test_a_users_op_cannot_change_a_shared_tensor_or_end_the_worker(ops_worker: WorkerProc) -> None:
    """An op writing into an input it does not declare in `mutates` (here another client's shared resident tensor),
    calling sys.exit(), or whose shape rule raises: each is that request's KernelError naming the op, the shared
    tensor is as its owner put it, and the worker goes on."""
    w = np.arange(8, dtype=np.float32)
    with Client(ops_worker.name, timeout_s=20) as owner, Client(ops_worker.name, timeout_s=20) as other:
        owner.put("w", w, shared=True)
        with pytest.raises(KernelError, match="wrote into one of its inputs") as e:
            other.call("t_double", x=Resident("shared/w"), mode="scribble")
        assert (e.value.op, e.value.step, e.value.field) == ("t_double", 0, "inputs")
        with pytest.raises(KernelError, match="wrote into one of its inputs"):  # a pipeline's intermediate
            other.call(Pipeline().then("scale", a=1.0).then("t_double", mode="scribble"), x=w)
        np.testing.assert_array_equal(owner.call("echo", x=Resident("shared/w"))["out"], w)
        with pytest.raises(KernelError, match="op 't_double' failed: SystemExit: 5") as e:
            other.call("t_double", x=w, mode="exit")
        assert (e.value.op, e.value.step) == ("t_double", 0)
        with pytest.raises(KernelError, match="shape rule of op 't_double' raised RuntimeError: a bug in the rule "
                                              r"\(a bug in the op's module 'faulty_") as e:
            other.call("t_double", x=w, mode="rule")
        assert (e.value.op, e.value.step, e.value.field) == ("t_double", 0, "infer")
        np.testing.assert_array_equal(other.call("t_double", x=w)["out"], 2 * w)
    assert ops_worker.proc.poll() is None


def test_a_module_that_does_not_import_stops_the_start_with_one_line(worker_name: str, tmp_path: Path) -> None:
    r = _serve(worker_name, "--ops", "no_such_ops_module", env=_env(tmp_path))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "shmrpc serve: --ops no_such_ops_module: it does not import (module 'no_such_ops_module' not found; "
        "is it on PYTHONPATH?)"]
    _module(tmp_path, "raising_ops", "raise ImportError('needs libfoo')\n")
    r = _serve(worker_name, "--ops", "raising_ops", env=_env(tmp_path))
    assert r.returncode == 1
    assert r.stderr.strip() == "shmrpc serve: --ops raising_ops: importing it raised ImportError: needs libfoo"


def test_an_invalid_spec_or_a_code_clash_stops_the_start_naming_the_ops(worker_name: str, tmp_path: Path) -> None:
    _module(tmp_path, "badspec_ops", _faulty("t_bad", ", code=7"))
    r = _serve(worker_name, "--ops", "badspec_ops", env=_env(tmp_path))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("shmrpc serve: --ops badspec_ops: op 't_bad': code 7 is outside the users' range")
    _module(tmp_path, "clash_a", _faulty("t_a", ", code=0x7000"))
    _module(tmp_path, "clash_b", _faulty("t_b", ", code=0x7000"))
    r = _serve(worker_name, "--ops", "clash_a,clash_b", env=_env(tmp_path))
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1
    assert "--ops clash_b: op 't_b' (code 28672, module clash_b) and op 't_a' (code 28672, module clash_a)" in r.stderr
    r = _serve(worker_name, "--ops", "a,,b", env=_env(tmp_path))
    assert r.returncode == 2 and "is not a module name" in r.stderr


# ------------------------------------------------------------------ the KV cache (examples/decoder_ops.py)


def _attend(c: Client, pos: int, d: int = 16, heads: int = 2, **kw: object) -> np.ndarray:
    qkv = np.random.default_rng(pos).standard_normal((1, 3 * d)).astype(np.float32)
    return c.call("kv_attend", qkv=qkv, pos=np.array([pos], np.int32), kcache=kw.get("kcache", Resident("kc")),
                  vcache=kw.get("vcache", Resident("vc")), n_heads=heads)["out"]


def test_kv_cache_grows_in_place_and_its_bounds_are_typed_errors(ops_worker: WorkerProc) -> None:
    with Client(ops_worker.name, timeout_s=20) as c:
        c.put("kc", np.zeros((4, 16), np.float32))
        c.put("vc", np.zeros((4, 16), np.float32))
        outs = [_attend(c, t) for t in range(4)]
        assert all(o.shape == (1, 16) for o in outs)
        # the cache holds what the steps wrote: v rows are the qkv's last third
        before = _attend(c, 3)
        np.testing.assert_allclose(before, outs[3], rtol=1e-6)
        with pytest.raises(KernelError, match="outside this KV cache's 4 rows") as e:
            _attend(c, 4)
        assert e.value.field == "pos"
        with pytest.raises(KernelError, match="must be bound to one of your resident tensors"):
            _attend(c, 0, kcache=np.zeros((4, 16), np.float32))
        c.put("shared_kc", np.zeros((4, 16), np.float32), shared=True)
        with pytest.raises(InvalidRequestError, match="shared resident tensor cannot be updated"):
            _attend(c, 0, kcache=Resident("shared/shared_kc"))
        with pytest.raises(ResourceError):  # the worker runs with --resident-limit 1M
            c.put("kc_big", np.zeros((1 << 14, 16), np.float32))


CLIENT = '''
import sys, numpy as np
from shmrpc.client import Client
c = Client(sys.argv[1], timeout_s=20)
c.put("kc", np.zeros((64, 16), np.float32))
c.put("vc", np.zeros((64, 16), np.float32))
print(c.client_id, flush=True)
sys.stdin.read()  # killed while holding its session
'''


def test_a_killed_clients_kv_cache_is_freed(ops_worker: WorkerProc) -> None:
    p = subprocess.Popen([sys.executable, "-c", CLIENT, ops_worker.name], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        cid = int(p.stdout.readline()) if p.stdout else -1
        assert {f"{cid}/kc", f"{cid}/vc"} <= set(_status(ops_worker.name)["resident"])
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate(timeout=10)
    deadline = time.monotonic() + 20  # the worker sees the death through the client's pidfd: hang guard only
    while any(n.startswith(f"{cid}/") for n in _status(ops_worker.name)["resident"]):
        assert time.monotonic() < deadline, "the killed client's KV cache is still resident"
        time.sleep(0.05)


def test_the_example_decoder_layer_matches_numpy_from_two_processes(ops_worker: WorkerProc, tmp_path: Path) -> None:
    out = tmp_path / "decoder.json"
    r = subprocess.run([sys.executable, str(EXAMPLES / "decoder_layer.py"), "--worker", ops_worker.name,
                        "--procs", "2", "--sessions", "2", "--tokens", "6", "--d", "64", "--f", "256",
                        "--max-tokens", "8", "--inprocess", "numpy", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=_env(EXAMPLES))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["served"]["steps"] == 24 and res["served_one_session"]["steps"] == 6 and res["inprocess"]["steps"] == 6
    assert res["served"]["max_rel_err"] < 2e-2 and "rpc_overhead_p50_us" in res
    assert _status(ops_worker.name)["resident"] == {}  # weights and every session's caches went with their clients


def test_malformed_plan_queries_are_refused_and_the_worker_goes_on(worker: WorkerProc) -> None:
    from shmrpc.schema import messages as m
    from shmrpc.schema.control import ErrorReply
    from shmrpc.schema.errors import WIRE_CODES, UnknownOpError

    with Client(worker.name, timeout_s=20) as c:
        for rid, body in enumerate(({"action": "plan", "steps": 5},
                                    {"action": "plan", "steps": [["nope", {}, {}, {}]], "inputs": {}},
                                    {"action": "plan", "steps": [["gemm", {}, {}, {}]],
                                     "inputs": {"x": [[1 << 40] * 40, "float32"]}}), start=1_000_000):
            c._asking.add(rid)  # sent by hand, past the typed builder, as a hostile client could
            c._t.send(m.pack_json(m.MANAGE, {**body, "id": rid}))
            c._pump(time.monotonic() + 10, lambda rid=rid: rid in c._control or None in c._control)
            reply = c._control.pop(rid, None) or c._control.pop(None)
            c._asking.discard(rid)
            assert isinstance(reply, ErrorReply) and reply.field, reply
            assert reply.kind == "bad_message" or WIRE_CODES[reply.code] in (InvalidRequestError, KernelError, UnknownOpError)
        assert c.call("gemm", x=np.ones((2, 3), np.float32), w=np.ones((3, 5), np.float32))["out"].shape == (2, 5)
    assert worker.proc.poll() is None


WAITING = WAITING_OPS


def test_a_slow_users_op_does_not_stall_small_requests_and_is_counted_over_budget(
        spawn_worker: Callable[..., WorkerProc], tmp_path: Path, worker_name: str) -> None:
    mod = "waiting_" + worker_name.replace("-", "_")
    _module(tmp_path, mod, WAITING)
    w = spawn_worker("--ops", mod, "--threads", "1", env=_env(tmp_path))
    flag = tmp_path / "go"
    with Client(w.name, timeout_s=30) as slow, Client(w.name, timeout_s=30) as fast:
        fut = slow.submit("t_wait", x=np.ones(4, np.float32), path=str(flag))
        for i in range(20):  # built-in, small: answered on the loop thread while the users' op holds the executor
            assert fast.call("vector_add", x=np.full(4, float(i)), y=np.ones(4))["out"][0] == i + 1
        assert not fut.done()
        flag.touch()
        np.testing.assert_array_equal(fut.result()["out"], 1.0)
    counters = _status(w.name)["counters"]
    assert counters["over_budget"] == {"t_wait": 1}


def test_status_says_not_ready_while_the_worker_drains(spawn_worker: Callable[..., WorkerProc], tmp_path: Path,
                                                         worker_name: str) -> None:
    # `shmrpc status` is a readiness check (the container's health check): after SIGTERM the worker refuses new work
    # while it answers what is in flight, and status says so (exit 1) instead of "ready"
    mod = "waiting_" + worker_name.replace("-", "_")
    _module(tmp_path, mod, WAITING)
    w = spawn_worker("--ops", mod, "--metrics-port", "0", "--log-level", "INFO", env=_env(tmp_path))
    flag = tmp_path / "go"
    status = [sys.executable, "-m", "shmrpc.server", "status", "--name", w.name]
    assert subprocess.run([*status, "-q"], timeout=30).returncode == 0
    url = next(p for p in w.ready_line.split() if p.startswith("http://")).rstrip(")")

    def ready_gauge() -> str:  # what Prometheus reads (the not-ready alert): shmrpc_ready
        import urllib.request

        with urllib.request.urlopen(url, timeout=10) as r:
            return next(ln.split()[-1] for ln in r.read().decode().splitlines() if ln.startswith("shmrpc_ready "))

    assert ready_gauge() == "1.0"
    with Client(w.name, timeout_s=30) as c:
        fut = c.submit("t_wait", x=np.ones(4, np.float32), path=str(flag))
        deadline = time.monotonic() + 20
        while _status(w.name)["in_flight"] < 1:
            assert time.monotonic() < deadline, "the request never reached the worker"
        w.proc.send_signal(signal.SIGTERM)
        while subprocess.run([*status, "-q"], timeout=30).returncode == 0:  # (the loop takes the signal at its turn)
            assert time.monotonic() < deadline, "status stayed ready after SIGTERM"
        out = subprocess.run(status, capture_output=True, text=True, timeout=30)
        assert out.returncode == 1 and out.stdout.startswith("NOT READY: stopping\n") and "in flight 1" in out.stdout
        assert ready_gauge() == "0.0"
        flag.touch()
        np.testing.assert_array_equal(fut.result()["out"], 1.0)  # still answered
    assert w.proc.wait(30) == 0
    w.stop()
    assert f"worker {w.name} stopping: answering 1 requests in flight first" in w.stderr
