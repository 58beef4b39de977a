"""The worker's receive path on the wire: a message of several frames (or an empty one) is refused with a reply
naming the frame count, the worker goes on serving, and requests still count in a scrape before their answer."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import numpy as np
import pytest
import zmq

from shmrpc.client import Client
from shmrpc.schema.control import ErrorReply, decode
from shmrpc.schema.naming import endpoint

from .conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


@pytest.mark.parametrize("frames", [[b"C", b"extra"], [b"C", b"x", b"y"]], ids=["two", "three"])
def test_a_message_of_several_frames_is_refused_and_the_worker_goes_on(worker: WorkerProc, frames: list[bytes]) -> None:
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint(worker.name))
        s.send_multipart(frames)
        assert s.poll(10_000), "no reply to a message of several frames"
        reply = decode(s.recv())
        assert isinstance(reply, ErrorReply)
        assert reply.field == "frames" and f"had {len(frames)}" in reply.message
        s.close()
    finally:
        ctx.term()
    with Client(worker.name, timeout_s=10) as c:
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(4), y=np.ones(4))["out"], 2.0)


def test_every_answered_request_is_in_the_next_scrape(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--metrics-port", "0")
    url = next(p for p in w.ready_line.split() if p.startswith("http://")).rstrip(")")
    x = np.arange(8, dtype=np.float32)
    with Client(w.name, timeout_s=10) as c, c.loan(4096) as req:
        req.array("x", (8,), np.float32)[...] = x
        req.array("y", (8,), np.float32)[...] = x
        for i in range(1, 6):
            req.send("vector_add", in_place=True)
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = resp.read().decode()
            assert f'shmrpc_requests_total{{op="vector_add",status="ok"}} {float(i)}' in body
            assert "shmrpc_requests_in_flight 0.0" in body
