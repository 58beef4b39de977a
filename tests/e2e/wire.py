"""Raw wire helpers for e2e tests: craft descriptors and ring real doorbells with hand-made bytes."""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import zmq

from shmrpc.client import Client
from shmrpc.schema import SCHEMA_HASH
from shmrpc.schema import messages as m
from shmrpc.schema.control import Hello
from shmrpc.schema.descriptor import RequestDesc, StepDesc, TensorRef, encode_request
from shmrpc.schema.header import HEADER, Header
from shmrpc.schema.naming import attach_path, endpoint, socket_path
from shmrpc.schema.proc import process_start_ticks

D = 4096  # descriptor area of every slot


def make_desc(op: str = "vector_add", tensors: tuple[TensorRef, ...] | None = None,
              outputs: tuple[str, ...] = ("out",), attrs: tuple[tuple[str, Any], ...] = (), code: int = 0) -> bytes:
    """A one-step request descriptor binding every tensor to the op parameter of the same name."""
    if tensors is None:
        tensors = (TensorRef("x", "float32", (4,), D, 16), TensorRef("y", "float32", (4,), D + 64, 16))
    ins = tuple((t.name, t.name) for t in tensors)
    return encode_request(RequestDesc((StepDesc(op, code, ins, (("out", "out"),), attrs),), tensors, outputs))


def raw_call(c: Client, payload: bytes | None = None, *, header: Callable[[Header], Header] | None = None,
             call: tuple[int, int, int, int] | None = None) -> None:
    """Write ``payload`` and a header (optionally edited) into one of c's slots, ring with a real CALL
    (optionally naming another slot), and raise the error the worker answers with."""
    rid = 777
    with c.loan(1024) as loan:
        s, mv = loan._s, loan._live()
        payload = make_desc() if payload is None else payload
        h = Header(rid, 0, len(payload), 0, s.generation)
        mv[16:16 + len(payload)] = payload
        HEADER.pack_into(mv, 0, *(header(h) if header else h))
        region, slot, _, gen = call or (s.region, s.index, rid, s.generation)
        s.in_flight = rid
        c._inflight.add(rid, s)
        c._t.send(m.pack_call(region, slot, rid, gen))
        loan._wait(rid, time.monotonic() + 10)
        loan._response(rid)


def worker_state(name: str) -> dict[str, Any]:
    """The worker's STATE (what ``shmrpc status --json`` prints), asked over a raw DEALER."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint(name))
        s.send(m.STATUS)
        assert s.poll(10_000), "no STATE from the worker"
        return m.unpack_json(s.recv())  # type: ignore[no-any-return]
    finally:
        s.close()
        ctx.term()


def wait_for_state(name: str, ready: Callable[[dict[str, Any]], bool], what: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Poll the worker's STATE until ``ready(state)``; the barrier between processes (never a sleep).

    ``timeout_s`` is a hang guard, not a claim about speed; ``what`` names the awaited state in the failure.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        state = worker_state(name)
        if ready(state):
            return state
        assert time.monotonic() < deadline, f"the worker never reached the state: {what} ({state})"
        time.sleep(0.002)
def hello_body(**changes: Any) -> dict[str, Any]:
    """A HELLO true to this process, with ``changes`` applied (a value of None drops the key)."""
    pid = os.getpid()
    body = Hello(m.PROTOCOL_VERSION, SCHEMA_HASH, pid, os.getuid(), process_start_ticks(pid)).to_json()
    for k, v in changes.items():
        if v is None:
            body.pop(k, None)
        else:
            body[k] = v
    return body


def attach_hello(name: str, hello: dict[str, Any] | bytes, timeout_s: float = 5.0) -> tuple[bytes, Any]:
    """Say ``hello`` (a body, or a whole raw packet) on worker ``name``'s attach socket by hand.

    Returns the reply frame and its JSON body; any region fds that came with it are closed.
    """
    frame = hello if isinstance(hello, bytes) else m.pack_json(m.HELLO, hello)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(timeout_s)
        s.connect(str(attach_path(name)))
        s.send(frame)
        reply, fds, _, _ = socket.recv_fds(s, m.ATTACH_MAX_NBYTES, 8)
    for fd in fds:
        os.close(fd)
    return reply, m.unpack_json(reply)


def slow_pipeline(n: int = 20) -> Any:
    """A pipeline of ``n`` identity steps: a request that stays in flight long enough to act on it."""
    from shmrpc.client import Pipeline

    p = Pipeline()
    for _ in range(n):
        p = p.then("scale", a=1.0)
    return p


def wait_in_flight(name: str) -> None:
    """Barrier: the worker reports a request in flight (so the next step acts on a running request)."""
    wait_for_state(name, lambda st: st["in_flight"] >= 1, "a request in flight")


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """Process ``pid`` (a worker) stopped (SIGSTOP) for the block, every thread of it, continued after it, even when
    the block fails."""
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_stopped(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def reap_killed(w: Any) -> None:
    """Wait for a SIGKILLed worker (a ``WorkerProc``) and remove the sockets it left."""
    w.proc.wait(10)
    for p in (socket_path(w.name), attach_path(w.name)):
        p.unlink(missing_ok=True)


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Return once every thread of ``pid`` is stopped (a signal is delivered after ``kill`` returns)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue  # a thread that just exited
        if states and all(st in "tT" for st in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.001)


#: A module of one users' op, ``t_wait``: it runs until the file its attribute ``path`` names exists (at most 20 s),
#: so a test decides when a request ends (and it is over its budget: counted in shmrpc_over_budget_total).
WAITING_OPS = '''
import os, time
from shmrpc.kernels.api import AttrSpec, OpSpec, register_op


def _wait(call):
    deadline = time.monotonic() + 20  # hang guard: the test creates the file
    while not os.path.exists(call.attrs["path"]) and time.monotonic() < deadline:
        time.sleep(0.005)
    return {"out": call.inputs["x"].copy()}


register_op(OpSpec("t_wait", inputs=("x",), outputs=("out",), attrs={"path": AttrSpec("str")},
                   infer=lambda i, a: {"out": i["x"]}, numpy=_wait, budget_s=1e-6))
'''
