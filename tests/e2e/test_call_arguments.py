"""What a call's keywords may be: an array where the op takes an attribute, or a keyword the op does not take, is
refused with a typed error naming it (it once went out as a tensor no step read, and the op ran without it: a wrong
answer and no error); a NumPy scalar is an attribute; an attribute of the wrong kind is refused before it is sent.
Separate worker and client processes, the real region and socket; the worker serves on after every refusal.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from support.metrics import samples

from shmrpc.client import AsyncClient, Client, InvalidRequestError, KernelError, Pipeline

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

X = np.arange(4, dtype=np.float32)


def _serves(c: Client) -> None:
    np.testing.assert_allclose(c.call("scale", x=X, a=3.0, b=1.0)["out"], 3 * X + 1)


async def _async_call(c: Client, a: Any) -> Any:
    return await AsyncClient(c).call("scale", x=X, a=a)


@pytest.mark.parametrize("how", ["call", "call_general", "submit", "async"])
def test_an_array_for_an_attribute_is_refused_naming_it(worker: WorkerProc, how: str) -> None:
    with Client(worker.name, timeout_s=10) as c:
        for a in (np.array(2.0), np.array([2.0]), np.array(2.0, np.float32)):
            with pytest.raises(InvalidRequestError) as e:
                if how == "call":
                    c.call("scale", x=X, a=a)
                elif how == "call_general":  # a list input: the general path, not the steady one
                    c.call("scale", x=X.tolist(), a=a)
                elif how == "submit":
                    c.submit("scale", x=X, a=a).result()
                else:
                    asyncio.run(_async_call(c, a))
            assert e.value.field == "a" and "attribute 'a' of op 'scale' was given an array" in str(e.value)
        _serves(c)


def test_a_keyword_the_op_does_not_take_is_refused(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        with pytest.raises(InvalidRequestError) as e:
            c.call("vector_add", x=X, y=X, y2=X)
        assert e.value.field == "y2" and "reads no input 'y2'" in str(e.value)
        with pytest.raises(InvalidRequestError) as e:  # a pipeline whose steps read no "z"
            c.call(Pipeline().then("scale", a=2.0), x=X, z=X)
        assert e.value.field == "z"
        with pytest.raises(InvalidRequestError) as e:  # its inputs named: the caller's, not a step's output ("0.out")
            c.call(Pipeline().then("scale", a=2.0).then("vector_add", inputs={"x": "0.out", "y": "y"}), x=X, y=X, z=X)
        assert e.value.field == "z" and "(its inputs: ['x', 'y'])" in str(e.value), str(e.value)
        with c.loan(4096) as req:  # a loan's array that the op does not read
            req.array("x", 4, "float32")[:] = X
            req.array("a", 1, "float32")[:] = 5
            with pytest.raises(InvalidRequestError) as e:
                req.send("scale")
            assert e.value.field == "a"
        _serves(c)


def test_numpy_scalars_are_attributes(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        for a in (np.float32(2.5), np.float16(2.5), np.int64(2), np.float64(2.5)):
            np.testing.assert_allclose(c.call("scale", x=X, a=a, b=np.float32(1))["out"], float(a) * X + 1)
            np.testing.assert_allclose(c.submit("scale", x=X, a=a).result()["out"], float(a) * X)
        p = Pipeline().then("scale", a=np.float32(3.0))
        np.testing.assert_allclose(c.call(p, x=X)["0.out"], 3 * X)
        w = np.random.default_rng(5).standard_normal((256, 8)).astype(np.float32)
        q, ref = c.call("quantize_int4", w=w, group_size=np.int32(64)), c.call("quantize_int4", w=w, group_size=64)
        assert q.keys() == ref.keys() and all(np.array_equal(q[k], ref[k]) for k in q)
        assert q["scales"].shape != c.call("quantize_int4", w=w, group_size=128)["scales"].shape  # (it took 64)
        with c.loan(4096) as req:
            req.array("x", 4, "float32")[:] = X
            np.testing.assert_allclose(req.send("scale", a=np.float32(4.0))["out"], 4 * X)


def test_an_attribute_of_the_wrong_kind_is_refused_by_the_client(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        for name, kwargs, kind in (("scale", {"x": X, "a": "two"}, "a float"),
                                   ("scale", {"x": X, "a": True}, "a float"),
                                   ("quantize_int4", {"w": np.ones((256, 8), np.float32), "group_size": 128.0},
                                    "an int")):
            with pytest.raises(InvalidRequestError) as e:
                c.call(name, **kwargs)
            assert e.value.field in kwargs and f"takes {kind}" in str(e.value), str(e.value)
        np.testing.assert_allclose(c.call("scale", x=X, a=2)["out"], 2 * X)  # an int for a float travels as one
        _serves(c)


def test_a_refused_pipeline_is_counted_as_a_pipeline(spawn_worker: Callable[..., WorkerProc]) -> None:
    worker = spawn_worker("--metrics-port", "0")
    p = Pipeline().then("scale", a=2.0).then("vector_add", inputs={"x": "0.out", "y": "y"})
    with Client(worker.name, timeout_s=10) as c:
        with pytest.raises(KernelError) as e:  # the second step's shapes disagree: refused while planning
            c.call(p, x=X, y=np.ones(5, np.float32))
        assert e.value.op == "vector_add" and e.value.step == 1  # the error still names the failing step
        np.testing.assert_allclose(c.call(p, x=X, y=X)["1.out"], 3 * X)
    got = samples(worker.ready_line)
    assert got.get('shmrpc_requests_total{op="pipeline",status="KernelError"}') == 1
    assert got.get('shmrpc_requests_total{op="pipeline",status="ok"}') == 1
    assert not any(k.startswith('shmrpc_requests_total{op="vector_add"') for k in got)


def test_out_nbytes_must_be_a_byte_count(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        for bad in (-1, 1.5, "64"):
            for how in ("call", "call_general", "submit"):
                with pytest.raises(InvalidRequestError) as e:
                    if how == "submit":
                        c.submit("scale", x=X, a=2.0, out_nbytes=bad).result()
                    else:
                        c.call("scale", x=X if how == "call" else X.tolist(), a=2.0, out_nbytes=bad)
                assert e.value.field == "out_nbytes"
        np.testing.assert_allclose(c.call("scale", x=X, a=2.0, out_nbytes=X.nbytes)["out"], 2 * X)
        _serves(c)


def test_a_0d_input_gives_a_0d_output(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        for op in ("gelu", "scale", "echo"):
            x = np.array(1.5, np.float32)
            out = c.call(op, x=x)["out"]
            assert out.shape == () and out.dtype == np.float32, (op, out.shape)
        f = 1.5
        assert abs(float(c.call("gelu", x=np.array(f))["out"]) - 0.5 * f * (1 + np.tanh(np.sqrt(2 / np.pi) * (
            f + 0.044715 * f**3)))) < 1e-12
