"""The express path: a CALL for a slot whose last request ran inline from its primed entry is served straight
from that entry (``Worker._serve_express``), with the full path's checks and the full path's answers.

These tests arm a slot with a few identical requests, then send what the entry must not serve: a request whose
op fails on its data, a doorbell from another session naming the slot. Each gets the answer the full path
gives, and the slot's owner is served again right after.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import zmq

from shmrpc.client import Client, KernelError
from shmrpc.schema import messages as m
from shmrpc.schema.header import HEADER
from shmrpc.schema.naming import endpoint

from .conftest import WorkerProc
from .test_batching import _answered, _user_ops_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@pytest.mark.parametrize("lane", [None, "block", "spin"])
def test_a_failing_run_on_the_express_path_gets_its_own_typed_error(spawn_worker: Callable[..., WorkerProc],
                                                                    tmp_path: Path, lane: str | None) -> None:
    mod = f"t_express_ops_{tmp_path.name[-6:]}".replace("-", "_")
    w = spawn_worker("--metrics-port", "0", "--ops", mod, env=_user_ops_env(tmp_path, mod))
    with Client(w.name, timeout_s=30, lane=lane) as c, c.loan(4096) as req:
        x = req.array("x", (16,), np.float32)
        for i in range(20):  # the same descriptor every time: armed after the first, then served express
            x[...] = np.arange(16) + 0.5 + 100 * i
            np.testing.assert_array_equal(req.send("t_double_alone")["out"], 2 * (np.arange(16) + 0.5 + 100 * i))
        x[5] = 13.0  # the op raises on it
        with pytest.raises(KernelError) as e:
            req.send("t_double_alone")
        assert "13 is not allowed" in str(e.value) and e.value.op == "t_double_alone"
        x[5] = 1.0
        np.testing.assert_array_equal(req.send("t_double_alone")["out"], 2 * x)
    assert _answered(w, "t_double_alone") == 21
    assert _answered(w, "t_double_alone", "KernelRuntimeError") + _answered(w, "t_double_alone", "KernelError") == 1


def test_a_doorbell_from_another_session_for_an_armed_slot_is_refused(worker: WorkerProc) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint(worker.name))
        with Client(worker.name, timeout_s=10) as c, c.loan(1024) as req:
            req.array("x", (4,), np.float32)[...] = 1
            req.array("y", (4,), np.float32)[...] = 2
            for _ in range(5):
                np.testing.assert_array_equal(req.send("vector_add")["out"], 3)
            slot, mv = req._s, req._live()
            before = bytes(mv[:64])
            rid = HEADER.unpack_from(mv)[0]
            # the stranger rings the armed slot with the owner's generation and the request id in its header
            s.send(m.pack_call(slot.region, slot.index, rid, slot.generation))
            assert s.poll(5000)
            _, _, _, status = m.unpack_done(s.recv())
            assert status & m.NO_RESPONSE, "the stranger's doorbell must be refused"
            assert bytes(mv[:64]) == before, "and the slot left untouched"
            np.testing.assert_array_equal(req.send("vector_add")["out"], 3)
    finally:
        s.close()
        ctx.term()
