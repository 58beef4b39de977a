"""Real calls through a worker process: results against NumPy, zero copy, futures, several processes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from support.protocol_doc import golden_blocks

from shmrpc.client import Client, KernelError, Pipeline
from shmrpc.schema import messages as m
from shmrpc.schema.header import unpack_from

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

PROCS = str(Path(__file__).with_name("procs.py"))


def test_ops_match_numpy(worker: WorkerProc) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 33)).astype(np.float32)
    y = rng.standard_normal((64, 33)).astype(np.float32)
    with Client(worker.name, timeout_s=10) as c:
        assert set(c.op_table) >= {"echo", "vector_add", "scale"}
        np.testing.assert_array_equal(c.call("echo", x=x)["out"], x)
        np.testing.assert_array_equal(c.call("vector_add", x=x, y=y)["out"], x + y)
        np.testing.assert_allclose(c.call("scale", x=x, a=-1.5, b=0.25)["out"], -1.5 * x + 0.25, rtol=1e-6)
        x64 = x.astype(np.float64)
        np.testing.assert_allclose(c.call("scale", x=x64, a=3)["out"], 3 * x64)


def test_pipeline_matches_numpy(worker: WorkerProc) -> None:
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal(1000).astype(np.float32), rng.standard_normal(1000).astype(np.float32)
    p = (Pipeline().then("scale", a=2.0, b=1.0)
         .then("vector_add", inputs={"x": "0.out", "y": "y"})
         .then("scale", a=0.5))
    with Client(worker.name, timeout_s=10) as c:
        out = c.call(p, x=x, y=y)
    assert list(out) == ["2.out"]
    np.testing.assert_allclose(out["2.out"], 0.5 * ((2 * x + 1) + y), rtol=1e-6)


def test_zero_copy_in_place_changes_the_clients_own_view(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c, c.loan(4096) as req:
        x = req.array("x", (256,), np.float32)
        x[:] = np.arange(256, dtype=np.float32)
        out = req.send("scale", a=2.0, b=1.0, in_place=True)["out"]
        # the worker wrote into the very memory this process wrote: no copy either way
        np.testing.assert_array_equal(x, 2 * np.arange(256, dtype=np.float32) + 1)
        assert np.shares_memory(out, x)
        # echo is an alias: the output is the input's bytes
        e = req.send("echo")["out"]
        assert np.shares_memory(e, x)
        del out, e, x


def test_loan_outputs_are_views_and_resend_works(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c, c.loan(8192) as req:
        x = req.array("x", 100, np.float64)
        y = req.array("y", 100, np.float64)
        x[:], y[:] = 1.0, 2.0
        for i in range(3):
            x[:] = i
            out = req.send("vector_add")["out"]
            np.testing.assert_array_equal(out, i + 2.0)
        del x, y, out


def test_each_send_hands_out_its_own_views_of_the_outputs(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        free = len(c._slots.free)
        with c.loan(8192) as req:
            req.array("x", 16, np.float32)[...] = 1
            req.array("y", 16, np.float32)[...] = 2
            a = req.send("vector_add")["out"]
            a.shape = (4, 4)  # the caller's own view: changing it changes no later answer
            b = req.send("vector_add")["out"]
            assert a is not b and b.shape == (16,) and np.shares_memory(a, b)
            np.testing.assert_array_equal(b, 3)
        assert len(c._slots.free) == free - 1, "the loan's views are alive: its slot stays taken"
        del a, b
        c.call("echo", x=np.zeros(1, np.float32))  # the next take finds the slot back
        assert len(c._slots.free) + len(c._kept) == free  # (the call keeps its loan for the next call)


def test_view_cannot_outlive_its_slot(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        kept = c.call("echo", x=np.full(16, 7.0), copy=False)["out"]
        # every later call must use another slot while `kept` lives: its bytes never change
        for i in range(20):
            c.call("echo", x=np.full(16, float(i)))
        np.testing.assert_array_equal(kept, 7.0)
        del kept


def test_submit_several_in_flight(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        futs = [c.submit("vector_add", x=np.full(8, i, np.int64), y=np.full(8, 10, np.int64)) for i in range(4)]
        assert [int(f.result()["out"][0]) for f in futs] == [10, 11, 12, 13]
        # more futures than leased small slots: the client borrows or waits, never mixes results
        futs = [c.submit("scale", x=np.full(8, float(i)), a=2.0) for i in range(12)]
        assert [float(f.result()["out"][0]) for f in futs] == [2.0 * i for i in range(12)]


def test_large_request_borrows_a_larger_slot(worker: WorkerProc) -> None:
    x = np.random.default_rng(3).standard_normal(300_000)  # 2.4 MB: needs the 4M class, not leased
    with Client(worker.name, timeout_s=10) as c:
        np.testing.assert_array_equal(c.call("echo", x=x)["out"], x)
        np.testing.assert_allclose(c.call("scale", x=x, a=2.0, in_place=True)["out"], 2 * x)


def test_kernel_error_names_op_step_tensor_and_worker_goes_on(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        with pytest.raises(KernelError) as e:
            c.call("vector_add", x=np.ones(4), y=np.ones(5))
        assert (e.value.op, e.value.step, e.value.tensor, e.value.field) == ("vector_add", 0, "y", "shape")
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(4), y=np.ones(4))["out"], 2.0)


def test_four_client_processes_at_once(worker: WorkerProc) -> None:
    seeds = [11, 12, 13, 14]
    print("seeds", seeds)
    procs = [subprocess.Popen([sys.executable, PROCS, "calls", worker.name, str(s), "100"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for s in seeds]
    results = {}
    for p in procs:
        out, err = p.communicate(timeout=50)
        assert p.returncode == 0, err
        r = json.loads(out)
        results[r["seed"]] = r["bad"]
    assert results == {s: 0 for s in seeds}


def test_worker_answers_the_documented_call_with_the_documented_bytes(worker: WorkerProc) -> None:
    """docs/protocol.md "One call, byte by byte": its request, rung in a real slot, gets its response bytes."""
    g = golden_blocks()
    desc, resp = g["request-descriptor"], g["response-descriptor"]
    h = unpack_from(g["request-header"])
    with Client(worker.name, timeout_s=10) as c, c.loan(1024) as loan:
        s, mv = loan._s, loan._live()
        assert s.generation == h.generation == 1  # a fresh lease of a private region starts at generation 1
        mv[4096:4112] = np.arange(1, 5, dtype=np.float32).tobytes()
        mv[16:16 + len(desc)] = desc
        mv[:16] = g["request-header"]  # NOTE: order is important here: the header last, then the doorbell
        s.in_flight = h.request_id
        c._inflight.add(h.request_id, s)
        c._t.send(m.pack_call(s.region, s.index, h.request_id, h.generation))
        c._pump(time.monotonic() + 10, lambda: s.in_flight is None)
        assert s.status == 0
        assert bytes(mv[:16]) == g["response-header"]
        assert bytes(mv[16:16 + len(resp)]) == resp
        np.testing.assert_array_equal(np.frombuffer(mv[4160:4176], np.float32), [2, 4, 6, 8])
        del mv
