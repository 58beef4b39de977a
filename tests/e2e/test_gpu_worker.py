"""The CuPy worker end to end (GPU machine only): results against NumPy, pipelines on the device,
resident tensors, bad requests leave the CUDA context usable, an injected CUDA error is survived."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from shmrpc.client import Client, KernelError, Pipeline, Resident

if TYPE_CHECKING:
    from conftest import WorkerProc


def _gpu_reason() -> str | None:
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - any failure means no usable GPU here
        return f"no CuPy/GPU here ({type(e).__name__})"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.timeout(120),
              pytest.mark.skipif(_gpu_reason() is not None, reason=_gpu_reason() or "")]


def _cupy_worker(spawn_worker: Callable[..., WorkerProc]) -> WorkerProc:
    return spawn_worker("--backend", "cupy", slots="64K:16,1M:4,16M:2,80M:2", lease="4,1,1,1")


def test_ops_and_pipeline_on_gpu(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = _cupy_worker(spawn_worker)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((256, 512)).astype(np.float32)
    y = rng.standard_normal((256, 512)).astype(np.float32)
    with Client(w.name, timeout_s=60) as c:
        assert c.backend == "cupy"
        np.testing.assert_allclose(c.call("vector_add", x=x, y=y)["out"], x + y, rtol=1e-6)
        np.testing.assert_allclose(c.call("scale", x=x, a=2.0, b=-1.0)["out"], 2 * x - 1, rtol=1e-6)
        big = rng.standard_normal(12 << 20 >> 2).astype(np.float32)  # 12 MiB: the chunked, overlapped path
        np.testing.assert_allclose(c.call("scale", x=big, a=3.0)["out"], 3 * big, rtol=1e-6)
        xs = rng.standard_normal((64, 1024)).astype(np.float16)
        g = rng.standard_normal(1024).astype(np.float16)
        b = rng.standard_normal(1024).astype(np.float16)
        out = c.call(Pipeline().then("layernorm_gelu", inputs={"x": "x", "gamma": "gamma", "beta": "beta"})
                     .then("softmax"), x=xs, gamma=g, beta=b)["1.out"].astype(np.float64)
        np.testing.assert_allclose(out.sum(axis=-1), 1.0, rtol=1e-2)


def test_resident_weights_gemm(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = _cupy_worker(spawn_worker)
    rng = np.random.default_rng(8)
    wt = rng.standard_normal((512, 256)).astype(np.float32)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    with Client(w.name, timeout_s=60) as c:
        c.put("w", wt)
        got = c.call("gemm", x=x, w=Resident("w"))["out"]
        ref = x.astype(np.float64) @ wt.astype(np.float64)
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-3


def test_bad_request_keeps_context_usable(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = _cupy_worker(spawn_worker)
    with Client(w.name, timeout_s=60) as c:
        with pytest.raises(KernelError) as e:
            c.call("gemm", x=np.ones((4, 8), np.float32), w=np.ones((9, 4), np.float32))
        assert e.value.op == "gemm" and e.value.field == "shape"
        with pytest.raises(KernelError):
            c.call("vector_add", x=np.ones(4, np.float32), y=np.ones(4, np.float64))
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(4, np.float32), y=np.ones(4, np.float32))["out"], 2)


def test_injected_cuda_error_fails_one_request_then_recovers(spawn_worker: Callable[..., WorkerProc],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHMRPC_INJECT_FAULT", "cuda_error")
    w = _cupy_worker(spawn_worker)
    x = np.arange(1024, dtype=np.float32)
    with Client(w.name, timeout_s=60) as c:
        with pytest.raises(KernelError):
            c.call("scale", x=x, a=2.0)
        np.testing.assert_array_equal(c.call("scale", x=x, a=2.0)["out"], 2 * x)


def test_users_ops_and_the_decoder_example_on_a_cupy_worker(spawn_worker: Callable[..., WorkerProc],
                                                             tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    examples = Path(__file__).resolve().parents[2] / "examples"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(examples), os.environ.get("PYTHONPATH")])))
    w = spawn_worker("--backend", "cupy", "--ops", "decoder_ops", slots="64K:16,1M:4,16M:2", lease="4,1,0", env=env)
    with Client(w.name, timeout_s=60) as c:
        assert c.op_table["kv_attend"].backends == ("numpy", "cupy")
        x = np.random.default_rng(9).standard_normal((4, 256)).astype(np.float32)
        y = x.astype(np.float16)
        np.testing.assert_allclose(c.call("residual_add", x=x, y=y)["out"], x + y.astype(np.float32), rtol=1e-6)
    out = tmp_path / "model.json"
    r = subprocess.run([sys.executable, str(examples / "decoder_layer.py"), "--worker", w.name, "--procs", "2",
                        "--sessions", "2", "--tokens", "8", "--d", "256", "--f", "1024", "--max-tokens", "16",
                        "--inprocess", "cupy", "--out", str(out)], capture_output=True, text=True, timeout=100, env=env)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["served"]["max_rel_err"] < 2e-2 and res["inprocess"]["max_rel_err"] < 2e-2


def test_batched_gemm_and_repeated_small_calls_on_a_cupy_worker(spawn_worker: Callable[..., WorkerProc]) -> None:
    """Concurrent gemm requests of one plan run as one CuPy batch, each answer right in its own slot (three times:
    the gathered run, the capture of its graph, then the graph launched while the loop goes on); a small call
    repeated from one slot (the CUDA-graph path after its second sight) follows the data written each time."""
    from wire import stopped

    from .test_batching import _CALL_WIRE_NBYTES, _batches, wait_unread

    w = spawn_worker("--backend", "cupy", "--metrics-port", "0", slots="64K:16,1M:4", lease="8,1")
    rng = np.random.default_rng(7)
    with Client(w.name, timeout_s=60) as c:
        c.call("echo", x=np.zeros(1, np.float32))
        for r in range(3):
            # x and w of a request fit one 64 KiB slot: the lease's 8 of them hold all six while the worker is stopped
            xs = [rng.standard_normal((16, 64)).astype(np.float16) for _ in range(6)]
            ws = [rng.standard_normal((64, 64)).astype(np.float16) for _ in range(6)]
            if r == 0:
                c.call("gemm", x=xs[0], w=ws[0])  # the output size of this signature known (no plan query while stopped)
            with stopped(w.pid):
                futs = [c.submit("gemm", x=x, w=wt) for x, wt in zip(xs, ws)]
                wait_unread(len(xs) * _CALL_WIRE_NBYTES)
            for x, wt, f in zip(xs, ws, futs):
                got = f.result(timeout=60)["out"].astype(np.float32)
                want = x.astype(np.float32) @ wt.astype(np.float32)
                np.testing.assert_allclose(got, want, rtol=4e-3, atol=4e-3 * float(np.abs(want).max()), err_msg=f"round {r}")
            assert _batches(w, "gemm") == (r + 1, 6 * (r + 1))
        for _ in range(6):  # the same slot each time (one call at a time): captured on its second sight
            x = rng.standard_normal(16).astype(np.float32)
            np.testing.assert_allclose(c.call("scale", x=x, a=2.0, b=1.0)["out"], 2.0 * x + 1.0, rtol=1e-6)


@pytest.mark.parametrize("lane", [None, "block"])
def test_a_small_loan_sent_again_follows_its_data_through_the_graph_without_copies(
        spawn_worker: Callable[..., WorkerProc], lane: str | None) -> None:
    """A loan sent again from one slot (the worker's bound run; its graph, captured on the second sight, holds the
    kernels alone, on the slot's pages): every answer is of the data written just before, in place and not, over
    ZeroMQ and through the blocking lane; a softmax row of another shape in the same loan is right too."""
    w = spawn_worker("--backend", "cupy", slots="64K:4", lease="2")
    rng = np.random.default_rng(3)
    with Client(w.name, timeout_s=60, lane=lane) as c, c.loan(4096) as req:
        x = req.array("x", (4, 16), np.float32)
        for in_place in (False, True):
            for i in range(12):
                x[...] = rng.standard_normal(x.shape).astype(np.float32) * (i + 1)
                want = 2.0 * x + 1.0
                got = req.send("scale", a=2.0, b=1.0, in_place=in_place)["out"]
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=f"in place {in_place}, send {i}")
    with Client(w.name, timeout_s=60, lane=lane) as c, c.loan(4096) as req:
        x = req.array("x", (2, 40), np.float32)
        for i in range(8):
            x[...] = rng.standard_normal(x.shape).astype(np.float32) * (i + 1)
            f = x.astype(np.float64)
            e = np.exp(f - f.max(-1, keepdims=True))
            np.testing.assert_allclose(req.send("softmax")["out"], e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_a_large_repeated_request_is_answered_right_while_another_client_is_served(
        spawn_worker: Callable[..., WorkerProc]) -> None:
    """A large request seen before (its chunk graph captured) is launched and answered once the device is done;
    a second client's small calls are served meanwhile; every answer is checked."""
    import os
    import threading

    env = dict(os.environ, SHMRPC_CHUNK_THRESHOLD_BYTES="1M", SHMRPC_CHUNK_BYTES="256K")
    w = spawn_worker("--backend", "cupy", slots="64K:8,16M:2", lease="2,1", env=env)
    n = (3 << 20) // 4
    stop = threading.Event()
    small_ok: list[bool] = []

    def small_calls() -> None:
        with Client(w.name, timeout_s=60) as c2:
            while not stop.is_set():
                x = np.random.default_rng(len(small_ok)).standard_normal(16).astype(np.float32)
                small_ok.append(bool(np.allclose(c2.call("scale", x=x, a=2.0)["out"], 2.0 * x)))

    t = threading.Thread(target=small_calls)
    t.start()
    try:
        with Client(w.name, timeout_s=60) as c, c.loan(8 << 20) as req:
            x = req.array("x", n, np.float32)
            for i in range(8):  # the plain chunked run, the capture, then launches
                x[:] = (np.arange(n, dtype=np.float32) * (i + 1)) % 1000
                out = req.send("scale", a=3.0, b=1.0)["out"]
                np.testing.assert_array_equal(out, 3 * x + 1, err_msg=f"request {i}")
                del out
    finally:
        stop.set()
        t.join(60)
    assert small_ok and all(small_ok)


def test_launched_batches_stay_right_while_clients_leave_and_come_back(spawn_worker: Callable[..., WorkerProc]) -> None:
    """Eight clients (threads, each with its own Client and so its own region) call one gemm plan in loops, so that
    batches form and are launched; half of them close and connect again every 15 calls, so their regions are closed
    and made again, and with them the backend's registered ranges and what it remembered of their batch items
    (kernels/_cuda_gather.py, CheckedItems). Every answer is checked against NumPy, and batches ran."""
    import threading

    from .test_batching import _batches

    w = spawn_worker("--backend", "cupy", "--metrics-port", "0", slots="64K:16", lease="2")
    wrong: list[str] = []
    done = [0] * 8

    def calls(k: int) -> None:
        rng = np.random.default_rng(k)
        rounds, per = (6, 15) if k % 2 else (1, 90)
        try:
            for r in range(rounds):
                with Client(w.name, timeout_s=60) as c:
                    for i in range(per):
                        x = rng.standard_normal((16, 64)).astype(np.float16)
                        wt = rng.standard_normal((64, 64)).astype(np.float16)
                        got = c.call("gemm", x=x, w=wt)["out"].astype(np.float32)
                        want = x.astype(np.float32) @ wt.astype(np.float32)
                        if not np.allclose(got, want, rtol=4e-3, atol=4e-3 * float(np.abs(want).max())):
                            wrong.append(f"client {k}, connection {r}, call {i}")
                        done[k] += 1
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            wrong.append(f"client {k}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=calls, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not wrong, wrong[:5]
    assert done == [90] * 8
    assert _batches(w, "gemm")[0] > 0
