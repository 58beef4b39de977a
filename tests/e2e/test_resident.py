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
        assert e.value.field == "resident"
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
        assert "limit" in str(e.value)
        assert set(c.resident()) == {"small"}
        np.testing.assert_array_equal(c.call("scale", x=np.ones(4), a=2.0)["out"], 2.0)
