"""Resident tensors through the worker: put once, refer by name, drop, private vs shared, freed at disconnect."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pytest

from shmrpc.client import Client, InvalidRequestError, KernelError, Pipeline, Resident, ResourceError

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_put_use_drop(worker: WorkerProc) -> None:
    rng = np.random.default_rng(5)
    w = rng.standard_normal(1000).astype(np.float32)
    x = rng.standard_normal(1000).astype(np.float32)
    with Client(worker.name, timeout_s=10) as c:
        c.put("bias", w)
        assert c.resident()["bias"] == ((1000,), np.dtype(np.float32))
        np.testing.assert_array_equal(c.call("vector_add", x=x, y=Resident("bias"))["out"], x + w)
        p = Pipeline().then("scale", a=2.0).then("vector_add", inputs={"x": "0.out", "y": "y"})
        np.testing.assert_allclose(c.call(p, x=x, y=Resident("bias"))["1.out"], 2 * x + w, rtol=1e-6)
        c.drop("bias")
        assert "bias" not in c.resident()
        with pytest.raises(KernelError) as e:
            c.drop("bias")
        assert (e.value.tensor, e.value.field) == ("bias", "resident")
        with pytest.raises(InvalidRequestError):
            c.call("vector_add", x=x, y=Resident("bias"))


def test_private_names_are_private_and_dropped_at_disconnect(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as a, Client(worker.name, timeout_s=10) as b:
        a.put("w", np.ones(4, np.float32))
        a.put("pub", np.full(4, 3.0, np.float32), shared=True)
        assert "w" not in b.resident() and "shared/pub" in b.resident()
        np.testing.assert_array_equal(b.call("vector_add", x=np.ones(4, np.float32),
                                             y=Resident("shared/pub"))["out"], 4.0)
        with pytest.raises(InvalidRequestError):
            b.call("vector_add", x=np.ones(4, np.float32), y=Resident("w"))
    with Client(worker.name, timeout_s=10) as c:
        names = c.resident()
        # shared tensors go with the client that put them (docs/reliability.md, "Bounds")
        assert not any(k.endswith("/w") or k in ("w", "shared/pub") for k in names)


def test_output_kept_on_the_worker_feeds_the_next_request(worker: WorkerProc) -> None:
    x = np.arange(100, dtype=np.float32)
    with Client(worker.name, timeout_s=10) as c:
        assert c.call("scale", x=x, a=2.0, keep=("out",)) == {}  # nothing comes back: it stays on the worker
        assert c.resident()["out"] == ((100,), np.dtype(np.float32))
        np.testing.assert_array_equal(c.call("vector_add", x=x, y=Resident("out"))["out"], 3 * x)


def test_resident_limit_is_a_typed_error(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--resident-limit", "4K")
    with Client(w.name, timeout_s=10) as c:
        c.put("small", np.ones(512, np.float32))  # 2 KiB: fits
        with pytest.raises(ResourceError) as e:
            c.put("big", np.ones(1024, np.float32))  # 4 KiB more: over the limit
        assert "limit" in str(e.value) and e.value.op == "put"  # (the echo step a put travels as, before)
        assert set(c.resident()) == {"small"}
        np.testing.assert_array_equal(c.call("scale", x=np.ones(4), a=2.0)["out"], 2.0)


def test_a_resident_input_takes_calls_steady_path_and_follows_its_tensor(worker: WorkerProc) -> None:
    # call() with a Resident plans once per signature like arrays do (the key holds the tensor's name with the shape
    # and dtype the client recorded for it): new input values each call, the tensor's values as put last, another
    # plan when it is put again with another shape, the general path's error once it is dropped
    rng = np.random.default_rng(17)
    w1 = rng.standard_normal(64).astype(np.float32)
    with Client(worker.name, timeout_s=10) as c:
        c.put("w", w1)
        for _ in range(3):
            x = rng.standard_normal(64).astype(np.float32)
            np.testing.assert_array_equal(c.call("vector_add", x=x, y=Resident("w"))["out"], x + w1)
        keys = [k for k in c._plans if k[0] == "vector_add"]
        assert keys == [("vector_add", False, (), None, "x", (64,), np.dtype(np.float32),
                         "y", Resident, "w", ((64,), np.dtype(np.float32)))], keys
        assert c._kept, "the steady path keeps its loan"
        w2 = rng.standard_normal(64).astype(np.float32)
        c.put("w", w2)  # the same shape: the same plan, the worker reads the tensor as it is now
        np.testing.assert_array_equal(c.call("vector_add", x=x, y=Resident("w"))["out"], x + w2)
        assert len([k for k in c._plans if k[0] == "vector_add"]) == 1
        w3 = rng.standard_normal((4, 8)).astype(np.float64)
        c.put("w", w3)  # another shape and dtype: another plan
        x3 = rng.standard_normal((4, 8))
        np.testing.assert_array_equal(c.call("vector_add", x=x3, y=Resident("w"))["out"], x3 + w3)
        assert len([k for k in c._plans if k[0] == "vector_add"]) == 2
        # a pipeline naming it, and a resident next to an attribute
        p = Pipeline().then("scale", a=2.0).then("vector_add", inputs={"x": "0.out", "y": "y"})
        for _ in range(2):
            np.testing.assert_allclose(c.call(p, x=x3, y=Resident("w"))["1.out"], 2 * x3 + w3, rtol=1e-12)
        c.drop("w")
        with pytest.raises(InvalidRequestError) as ei:
            c.call("vector_add", x=x3, y=Resident("w"))
        assert ei.value.field == "resident" and ei.value.tensor == "w"
        np.testing.assert_array_equal(c.call("vector_add", x=x, y=x)["out"], 2 * x)  # the client goes on


def test_a_shared_resident_another_client_put_is_found_then_served_steadily(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as a, Client(worker.name, timeout_s=10) as b:
        a.put("pub", np.full(8, 3.0, np.float32), shared=True)
        x = np.arange(8, dtype=np.float32)
        for _ in range(3):  # the first call looks the tensor up (the general path), the next ones plan once
            np.testing.assert_array_equal(b.call("vector_add", x=x, y=Resident("shared/pub"))["out"], x + 3)
        assert [k[8:] for k in b._plans if k[0] == "vector_add"] == [
            (Resident, "shared/pub", ((8,), np.dtype(np.float32)))]
        # a replaced with another shape: b's record is stale; the worker refuses the call that sends it over the
        # resident's spec (before the op's shape rule sees the stale shape), b looks the tensor up and sends the call
        # again, so the call meets the tensor as it is now: served where the new shape fits (before, that call failed,
        # and every later one too when its error was the op's)
        x16 = np.arange(16, dtype=np.float32)
        a.put("pub", np.full(16, 5.0, np.float32), shared=True)
        for _ in range(2):
            np.testing.assert_array_equal(b.call("vector_add", x=x16, y=Resident("shared/pub"))["out"], x16 + 5)
        assert b._specs["shared/pub"] == ((16,), np.dtype(np.float32))
        a.put("pub", np.full(8, 6.0, np.float32), shared=True)
        with pytest.raises(KernelError) as ei:  # the tensor's new shape meets an input it does not fit: the op's error
            b.call("vector_add", x=x16, y=Resident("shared/pub"))
        assert ei.value.field == "shape" and ei.value.tensor == "y"
        np.testing.assert_array_equal(b.call("vector_add", x=x, y=Resident("shared/pub"))["out"], x + 6)
        a.drop("shared/pub")
        with pytest.raises(KernelError) as ei:  # dropped: refused over the resident, not sent again
            b.call("vector_add", x=x, y=Resident("shared/pub"))
        assert ei.value.field == "resident" and ei.value.tensor == "y"
        assert "shared/pub" not in b._specs


def test_a_future_over_a_stale_resident_record_has_it_looked_up_again(worker: WorkerProc) -> None:
    # the same through submit() (a planned signature, then the general path of a list input): the future that the
    # worker refuses over the resident's spec makes the client forget its record
    with Client(worker.name, timeout_s=10) as a, Client(worker.name, timeout_s=10) as b:
        a.put("pub", np.full(8, 3.0, np.float32), shared=True)
        x = np.arange(8, dtype=np.float32)
        for _ in range(2):
            np.testing.assert_array_equal(b.submit("vector_add", x=x, y=Resident("shared/pub")).result()["out"], x + 3)
        for new, n in ((5.0, 16), (7.0, 4)):
            a.put("pub", np.full(n, new, np.float32), shared=True)
            send = (lambda v: list(v)) if n == 4 else (lambda v: v)  # the second time a list: the general path
            with pytest.raises(KernelError) as ei:
                b.submit("vector_add", x=send(np.arange(len(x), dtype=np.float32)), y=Resident("shared/pub")).result()
            assert ei.value.field == "resident" and ei.value.tensor == "y"
            x = np.arange(n, dtype=np.float32)
            np.testing.assert_array_equal(b.submit("vector_add", x=x, y=Resident("shared/pub")).result()["out"],
                                          x + new)


def test_a_kept_output_replaced_with_another_shape_is_used_at_its_new_shape(worker: WorkerProc) -> None:
    # a call's keep= that replaces a resident with another shape updates the client's record of it: the next call
    # naming it is served at once, with the new tensor's values (before, that call sent the old shape and failed)
    x4, x8 = np.arange(4, dtype=np.float32), np.arange(8, dtype=np.float32)
    with Client(worker.name, timeout_s=10) as c:
        for via_submit in (False, True):
            assert c.call("scale", x=x4, a=2.0, keep=("out",)) == {}
            np.testing.assert_array_equal(c.call("vector_add", x=x4, y=Resident("out"))["out"], 3 * x4)
            if via_submit:
                assert c.submit("scale", x=x8, a=3.0, keep=("out",)).result(10) == {}
            else:
                assert c.call("scale", x=x8, a=3.0, keep=("out",)) == {}
            for _ in range(2):
                np.testing.assert_array_equal(c.call("vector_add", x=x8, y=Resident("out"))["out"], 4 * x8)
            c.drop("out")


def test_a_resident_tensor_needs_a_name(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as c:
        for shared in (False, True):  # "" and "shared/": nothing a later request could name
            with pytest.raises(InvalidRequestError) as e:
                c.put("", np.ones(4, np.float32), shared=shared)
            assert e.value.field == "keep" and e.value.tensor == ("shared/" if shared else "")
        assert c.resident() == {}
        c.put("w", np.ones(4, np.float32))
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(4, np.float32), y=Resident("w"))["out"], 2.0)
