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


# ------------------------------------------------------------------ what an op's own code may raise, on every path

ABRUPT = '''
import asyncio, math, os, sys
from shmrpc.kernels.api import AttrSpec, KernelInputError, OpSpec, register_op


class LibraryStop(BaseException):
    """A library's own BaseException."""


RAISE = {"exit": lambda: sys.exit("my rule gave up"), "kbd": KeyboardInterrupt, "gen": GeneratorExit,
         "cancel": asyncio.CancelledError, "custom": lambda: LibraryStop("stop here")}


def _go(mode, where):
    at, _, kind = mode.partition(":")
    if at != where:
        return
    if kind == "surrogate":  # a file name decoded with surrogateescape: not UTF-8
        raise RuntimeError("cannot open " + os.fsdecode(b"w\\xff.bin"))
    if kind == "huge":  # texts far larger than the slot's descriptor area
        raise KernelInputError("m" * 100_000, tensor="t" * 100_000, field="f" * 100_000)
    if kind in RAISE:
        raise RAISE[kind]()


def _rule(i, a):
    _go(a["mode"], "rule")
    return {"out": i["x"]}


def _cost(i, o, a):
    _go(a["mode"], "cost")
    return {"cost:none": None, "cost:nan": math.nan, "cost:str": "many", "cost:neg": -5}.get(a["mode"], 1)


def _impl(call):
    _go(call.attrs["mode"], "op")
    return {"out": call.xp.multiply(call.inputs["x"], 2, out=call.dest("out"))}


MODE = {"mode": AttrSpec("str", "ok")}
# {p}_inl: a cost rule, so its small requests run on the loop thread; {p}_exe: none, so the executor runs them;
# {p}_bat: batchable, so a worker whose backend joins batches parks its requests and runs them as a batch
register_op(OpSpec("{p}_inl", inputs=("x",), outputs=("out",), attrs=MODE, infer=_rule, numpy=_impl, cost=_cost))
register_op(OpSpec("{p}_exe", inputs=("x",), outputs=("out",), attrs=MODE, infer=_rule, numpy=_impl))
register_op(OpSpec("{p}_bat", inputs=("x",), outputs=("out",), attrs=MODE, infer=_rule, numpy=_impl, cost=_cost,
                   batch=True))
'''

#: mode -> (the error's field, a piece of its message); every one is that request's KernelError naming the op
ABRUPT_CASES = {
    "rule:exit": ("infer", "raised SystemExit: my rule gave up"),
    "rule:kbd": ("infer", "raised KeyboardInterrupt"),
    "rule:gen": ("infer", "raised GeneratorExit"),
    "rule:cancel": ("infer", "raised CancelledError"),
    "rule:custom": ("infer", "raised LibraryStop: stop here"),
    "rule:surrogate": ("infer", r"cannot open w\udcff.bin"),
    "rule:huge": ("f" * 256, "m" * 1000),
    "op:exit": ("", "failed: SystemExit: my rule gave up"),
    "op:kbd": ("", "failed: KeyboardInterrupt"),
    "op:gen": ("", "failed: GeneratorExit"),
    "op:cancel": ("", "failed: CancelledError"),
    "op:custom": ("", "failed: LibraryStop: stop here"),
    "op:surrogate": ("", r"cannot open w\udcff.bin"),
    "op:huge": ("f" * 256, "m" * 1000),
}
COST_CASES = {
    "cost:exit": "cost rule of op '{op}' raised SystemExit: my rule gave up",
    "cost:kbd": "cost rule of op '{op}' raised KeyboardInterrupt",
    "cost:custom": "cost rule of op '{op}' raised LibraryStop: stop here",
    "cost:none": "cost rule of op '{op}' returned None; it must give a number of FLOPs >= 0",
    "cost:nan": "returned nan",
    "cost:str": "returned 'many'",
    "cost:neg": "returned -5",
}


def _abrupt(tmp_path: Path, worker_name: str) -> tuple[str, dict[str, str]]:
    p = "abr_" + worker_name.replace("-", "_")
    _module(tmp_path, p, ABRUPT.replace("{p}", p))
    return p, _env(tmp_path)


def _expect_kernel_error(c: Client, op: str, mode: str, field: str, text: str, **kw: object) -> None:
    with pytest.raises(KernelError) as e:
        c.call(op, x=kw.pop("x", np.ones(8, np.float32)), mode=mode, **kw)  # type: ignore[arg-type]
    assert e.value.op == op, (mode, e.value)
    assert e.value.field == field and text in e.value.message, (mode, e.value)
    if mode.startswith("op:"):
        assert e.value.step == 0
    if field == "f" * 256:
        assert e.value.tensor == "t" * 256


def test_base_exceptions_and_unencodable_errors_in_a_users_op_are_kernel_errors_on_every_path(
        spawn_worker: Callable[..., WorkerProc], tmp_path: Path, worker_name: str) -> None:
    """sys.exit(), KeyboardInterrupt, GeneratorExit, CancelledError or a library's own BaseException raised by a users'
    op's shape rule, cost rule or body, on the loop thread (an op with a cost rule) and in the executor (one without),
    and an error whose message holds a lone surrogate or whose tensor and field are larger than the slot: each is
    that request's KernelError naming the op (field "infer" for the rule, "cost" for the cost rule), cut to fit and
    escaped; the worker goes on serving right answers, a plan query (a large submit) is answered too, and SIGTERM
    stops the worker with status 0 (nothing was left in flight)."""
    p, env = _abrupt(tmp_path, worker_name)
    w = spawn_worker("--ops", p, env=env)
    x = np.arange(8, dtype=np.float32)
    big = np.ones(20_000, np.float32)  # over 64 KiB: submit() asks the worker for the outputs' sizes first
    with Client(w.name, timeout_s=10) as c:
        for op in (f"{p}_inl", f"{p}_exe"):
            for mode, (field, text) in ABRUPT_CASES.items():
                _expect_kernel_error(c, op, mode, field, text)
                np.testing.assert_array_equal(c.call(op, x=x)["out"], 2 * x)
            for mode in ("rule:exit", "rule:surrogate", "rule:custom"):  # the plan query's answer, then the call's
                with pytest.raises(KernelError) as e:
                    c.submit(op, x=big, mode=mode).result(timeout=10)
                assert (e.value.op, e.value.field) == (op, "infer"), e.value
            np.testing.assert_array_equal(c.submit(op, x=big).result(timeout=10)["out"], 2 * big)
        op = f"{p}_inl"
        for mode, text in COST_CASES.items():
            _expect_kernel_error(c, op, mode, "cost", text.replace("{op}", op))
        np.testing.assert_array_equal(c.call(op, x=x)["out"], 2 * x)
    assert w.proc.poll() is None
    assert w.stop() == 0, w.stderr
    assert "unexpected" not in w.stderr and "Traceback" not in w.stderr, w.stderr


def test_base_exceptions_and_unencodable_errors_in_a_batch_are_each_requests_kernel_error(
        spawn_worker: Callable[..., WorkerProc], tmp_path: Path, worker_name: str) -> None:
    """The same in requests a worker runs as one batch (a batchable users' op, a backend that joins batches): each
    failing request gets its KernelError naming the op, the others their right answers, and SIGTERM stops it."""
    p, env = _abrupt(tmp_path, worker_name)
    w = spawn_worker("--ops", p, "--max-batch", "4", lease="8,1,0,0", env=dict(env, SHMRPC_NUMPY_BATCH_JOINT="1"))
    op = f"{p}_bat"
    x = np.arange(8, dtype=np.float32)
    with Client(w.name, timeout_s=10) as c:
        for mode in ("op:exit", "op:kbd", "op:custom", "op:surrogate", "op:huge", "rule:exit", "cost:none"):
            field, text = ABRUPT_CASES.get(mode, ("cost", "returned None"))
            _expect_kernel_error(c, op, mode, field, text)
            futs = [c.submit(op, x=x + i, mode=mode if i % 2 else "ok") for i in range(4)]  # parked in one turn
            for i, f in enumerate(futs):
                if i % 2:
                    with pytest.raises(KernelError) as e:
                        f.result(timeout=10)
                    assert e.value.op == op and e.value.field == field, (mode, e.value)
                else:
                    np.testing.assert_array_equal(f.result(timeout=10)["out"], 2 * (x + i))
    assert w.stop() == 0, w.stderr
    assert "unexpected" not in w.stderr, w.stderr


WARMUP_EXITS = '''
import sys
from shmrpc.kernels.api import OpSpec, TensorSpec, register_op


def _rule(i, a):
    {rule}
    return {"out": i["x"]}


def _impl(call):
    {body}
    return {"out": call.inputs["x"] * 2}


register_op(OpSpec("{name}", inputs=("x",), outputs=("out",), infer=_rule, numpy=_impl,
                   example={"x": TensorSpec((4,), "float32")}))
'''


@pytest.mark.parametrize(("rule", "body", "says"), [
    ("sys.exit('no')", "pass", "the shape rule of op '{name}' raised SystemExit: no"),
    ("sys.exit()", "pass", "the shape rule of op '{name}' raised SystemExit"),
    ("pass", "raise KeyboardInterrupt", "failed its warm-up run on its `example` inputs: op '{name}' failed: "
                                        "KeyboardInterrupt"),
    ("pass", "raise GeneratorExit('done')", "failed its warm-up run on its `example` inputs: op '{name}' failed: "
                                            "GeneratorExit: done"),
], ids=["rule-exit-message", "rule-exit", "body-keyboard-interrupt", "body-generator-exit"])
def test_a_base_exception_at_warm_up_stops_the_start_with_one_line_and_status_1(
        rule: str, body: str, says: str, tmp_path: Path, worker_name: str) -> None:
    name = "wx_" + worker_name.replace("-", "_")
    _module(tmp_path, name, WARMUP_EXITS.replace("{rule}", rule).replace("{body}", body).replace("{name}", name))
    r = _serve(worker_name, "--ops", name, env=_env(tmp_path))
    lines = [ln for ln in r.stderr.splitlines() if " INFO " not in ln]
    assert r.returncode == 1 and r.stdout == "" and len(lines) == 1, r
    assert lines[0].startswith("shmrpc serve: ") and says.replace("{name}", name) in lines[0], r


def test_an_entry_point_that_calls_sys_exit_stops_the_start_with_one_line_and_status_1(
        tmp_path: Path, worker_name: str) -> None:
    """An installed package's entry-point function (here a dist-info directory on PYTHONPATH) that calls sys.exit()
    stops `serve` with exit status 1 and one line naming it; before, serve exited 0 and said nothing."""
    pkg = "epx_" + worker_name.replace("-", "_")
    (tmp_path / pkg).mkdir()
    (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / pkg / "ops.py").write_text("import sys\n\n\ndef register():\n    sys.exit()\n")
    info = tmp_path / f"{pkg}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {pkg}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[shmrpc.ops]\n{pkg} = {pkg}.ops:register\n")
    r = _serve(worker_name, env=_env(tmp_path))
    lines = [ln for ln in r.stderr.splitlines() if " INFO " not in ln]
    assert r.returncode == 1 and r.stdout == "", r
    assert lines == [f"shmrpc serve: entry point {pkg} (shmrpc.ops) {pkg}.ops:register: calling it raised SystemExit"]


REUSE = '''
from shmrpc.kernels.api import OpSpec, register_op, registered

GELU = registered()["gelu"]
register_op(OpSpec("{name}", inputs=("x",), outputs=("out",), infer=GELU.infer, numpy=GELU.numpy, cupy=GELU.cupy))
register_op(OpSpec("{name}_coded", code=0x6001, inputs=("x",), outputs=("out",), infer=GELU.infer, numpy=GELU.numpy))
'''


def test_a_users_op_reusing_a_builtin_implementation_is_served_as_a_users_op(
        spawn_worker: Callable[..., WorkerProc], tmp_path: Path, worker_name: str) -> None:
    """A users' op whose implementation is a built-in's (numpy=registered()["gelu"].numpy) is registered as a users'
    op, with a derived or an explicit code; before, the start was refused ("a built-in op needs an explicit code")."""
    name = "reuse_" + worker_name.replace("-", "_")
    _module(tmp_path, name, REUSE.replace("{name}", name))
    w = spawn_worker("--ops", name, env=_env(tmp_path))
    x = np.linspace(-3, 3, 64, dtype=np.float32)
    with Client(w.name, timeout_s=20) as c:
        want = c.call("gelu", x=x)["out"]
        for op in (name, f"{name}_coded"):
            entry = c.op_table[op]
            assert entry.code >= 0x1000 and not entry.builtin
            np.testing.assert_array_equal(c.call(op, x=x)["out"], want)
        assert c.op_table[f"{name}_coded"].code == 0x6001
    ops = _status(w.name)["ops"]
    assert ops[name]["module"] == name and not ops[name]["builtin"]
    assert w.stop() == 0, w.stderr


STRING_PARAMS = '''
from shmrpc.kernels.api import OpSpec, register_op

register_op(OpSpec("{name}", inputs=("x_in"), outputs=("out",), infer=lambda i, a: {"out": i["x_in"]},
                   numpy=lambda c: {"out": c.inputs["x_in"]}))
'''


def test_inputs_given_as_one_string_stop_the_start_with_one_line(tmp_path: Path, worker_name: str) -> None:
    """inputs=("x_in") (the comma left out) is refused at start, naming the op and the fix; before, the string was
    split into the inputs 'x', '_', 'i', 'n' and the worker started with an op no call could satisfy."""
    name = "strp_" + worker_name.replace("-", "_")
    _module(tmp_path, name, STRING_PARAMS.replace("{name}", name))
    r = _serve(worker_name, "--ops", name, env=_env(tmp_path))
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr.strip().splitlines() == [
        f"shmrpc serve: --ops {name}: op '{name}': inputs must be a tuple of names, not the string 'x_in' (for one "
        "name write inputs=('x_in',), with the comma)"]


RESERVED_ATTR = '''
from shmrpc.kernels.api import AttrSpec, OpSpec, register_op

register_op(OpSpec("{name}", inputs=("x",), outputs=("out",), attrs={"copy": AttrSpec("bool", False)},
                   infer=lambda i, a: {"out": i["x"]}, numpy=lambda c: {"out": c.inputs["x"] * (2 if c.attrs["copy"] else 1)}))
'''


def test_an_op_attribute_named_like_a_clients_keyword_stops_the_start_with_one_line(
        tmp_path: Path, worker_name: str) -> None:
    """An attribute named copy (or keep, in_place, timeout_s, out_nbytes ...) would be taken by Client.call as its own
    option (a wrong answer, no error) while submit() passed it to the op: the start is refused naming it."""
    name = "rkw_" + worker_name.replace("-", "_")
    _module(tmp_path, name, RESERVED_ATTR.replace("{name}", name))
    r = _serve(worker_name, "--ops", name, env=_env(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and r.stdout == "" and len(lines) == 1, r
    assert lines[0].startswith(f"shmrpc serve: --ops {name}: op '{name}': attribute 'copy' is named like a keyword of "
                               "the client's own (Client.call, submit, Loan.send, Pipeline.then)"), r


@pytest.mark.parametrize("label", ["put", "pipeline", "unknown"])
def test_an_op_named_like_a_metrics_label_stops_the_start_with_one_line(label: str, tmp_path: Path,
                                                                         worker_name: str) -> None:
    """A users' op named put, pipeline or unknown would be counted with the worker's uploads, multi-step requests
    or unparsable ones (shmrpc_requests_total, status counters): the start is refused naming it."""
    mod = "lbl_" + worker_name.replace("-", "_")
    _module(tmp_path, mod, _faulty(label, ""))
    r = _serve(worker_name, "--ops", mod, env=_env(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and r.stdout == "" and len(lines) == 1, r
    assert lines[0] == (f"shmrpc serve: --ops {mod}: op '{label}': the worker's metrics count requests of another kind "
                        f"under '{label}' (names no op may have: pipeline, put, unknown); give it another name"), r


@pytest.mark.parametrize("value", ["", " ", "a,"], ids=["empty", "blank", "trailing-comma"])
def test_an_empty_ops_value_is_a_usage_error(value: str, tmp_path: Path, worker_name: str) -> None:
    """--ops "$UNSET" is a usage error (exit status 2, one line), as --ops " " is; before, an empty value started
    the worker without the users' ops it was meant to load, and said nothing."""
    r = _serve(worker_name, "--ops", value, env=_env(tmp_path))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and r.stdout == "" and len(lines) == 1, r
    assert lines[0].startswith("shmrpc serve: --ops: ") and "is not a module name" in lines[0], r
