"""Where a 64 B round trip over ZeroMQ goes: shmrpc's loan against a bare pyzmq DEALER/ROUTER echo, stamped on both sides.

    python bench/zmq_trace.py [--calls 10000] [--rounds 2] [--out FILE.json]

Both run a server in a child process and a client in this process, with ``time.perf_counter`` stamps
(CLOCK_MONOTONIC: comparable between the processes), ``--rounds`` times each, interleaved:

* shmrpc: a NumPy worker (its loop's wait, ``_on_call`` and ``_send`` stamped) and a ``Client`` sending a
  64 B in-place ``vector_add`` loan over the ZeroMQ doorbell (its ``Connection.send`` and the receive that
  got the DONE stamped);
* pyzmq: a ROUTER echo (``recv_multipart`` / ``send_multipart``, as the bench's zmq peer) and a DEALER client
  sending 64 B (stamped around its send and its receive).

A server's "sent" is stamped as its send is called: stamped after it, a server descheduled right after its send
(a loaded machine) would make the client's receive come "before" it. So the send's own time counts in the next
interval ("... sent to the client's receive"), on both transports alike. The client's send is stamped after it returns
("client: socket send"): a client preempted inside its send while the server runs (two busy cores) makes the next
interval ("sent to the worker's wake-up", "sent to the server's receive") negative; their sum is the time from the
send's call to the wake-up.

Prints the median of each interval over the last half of the calls, per round, and writes them to
``--out``. The stamps cost a little themselves on both: compare the two, not these with untraced runs.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
from lane_trace import SERVE_STAMPED  # bench/ is this script's directory, first on sys.path

_WORKER = '''
import json, sys, threading, time
from shmrpc.server import _poll
from shmrpc.server._loop import Worker
from shmrpc.server.config import WorkerConfig
pc = time.perf_counter
T = {"wake": [], "oncall": [], "sent": []}
o_poll = _poll.LoopPoll.poll
def poll(self, *a):
    r = o_poll(self, *a)
    T["wake"].append(pc())
    return r
_poll.LoopPoll.poll = poll
o_on, o_send = Worker._on_call, Worker._send
def on(self, *a, **k):
    T["oncall"].append(pc())
    return o_on(self, *a, **k)
def send(self, *a):
    T["sent"].append(pc())
    return o_send(self, *a)
Worker._on_call, Worker._send = on, send
w = Worker(WorkerConfig(name=sys.argv[1], backend="numpy", mlock=False))
''' + SERVE_STAMPED

_ECHO = '''
import json, sys, threading, time
import zmq
pc = time.perf_counter
T = {"got": [], "sent": []}
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind("ipc://" + sys.argv[1])
n = int(sys.argv[3])
print("ready", flush=True)
for _ in range(n):
    ident, frame = sock.recv_multipart(copy=False)
    T["got"].append(pc())
    T["sent"].append(pc())
    sock.send_multipart([ident, frame], copy=False)
with open(sys.argv[2], "w") as f:
    json.dump(T, f)
print("done", flush=True)
'''

_SHM_PARTS = ("client: send() entry to the socket send", "client: socket send", "sent to the worker's wake-up",
              "worker: wake-up to _on_call", "worker: _on_call to DONE sent", "DONE sent to the client's receive",
              "client: received to send() return", "round trip")
_ZMQ_PARTS = ("client: socket send", "sent to the server's receive", "server: received to sent",
              "server sent to the client's receive", "round trip")


def _med(parts: dict[str, list[float]]) -> dict[str, float]:
    return {k: round(statistics.median(v) * 1e6, 2) for k, v in parts.items() if v}


def run_shmrpc(calls: int, tmp: str) -> dict[str, float]:
    from shmrpc.client import Client, _connection

    name = f"ztrace-{os.getpid()}-{secrets.token_hex(3)}"
    stamps = os.path.join(tmp, f"{name}.json")
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, name, stamps], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    pc, last = time.perf_counter, {}
    conn = _connection.Connection
    # the receives: _recv_all, and in trees since c2dd247 also _recv_woken (a lone waiter's first after a wake-up)
    o_send, o_recvs = conn.send, {n: getattr(conn, n) for n in ("_recv_all", "_recv_woken") if hasattr(conn, n)}

    def send(self: Any, frame: bytes) -> None:
        last["send"] = pc()
        o_send(self, frame)
        last["sent"] = pc()

    def stamped(orig: Any) -> Any:
        def recv(self: Any) -> list[bytes]:
            got = orig(self)
            if got:
                last["got"] = pc()
            return got
        return recv

    conn.send = send  # type: ignore[method-assign]
    for n, orig in o_recvs.items():
        setattr(conn, n, stamped(orig))
    rows = []
    try:
        assert worker.stdout is not None and worker.stdin is not None
        assert worker.stdout.readline().strip() == "ready", "the worker did not start"
        with Client(name, timeout_s=30) as c, c.loan(4096) as req:
            req.array("x", (16,), np.float32)[...] = 1
            req.array("y", (16,), np.float32)[...] = 0
            for _ in range(500):
                req.send("vector_add", in_place=True)
            for _ in range(calls):
                t0 = pc()
                req.send("vector_add", in_place=True)
                rows.append((t0, last["send"], last["sent"], last["got"], pc()))
            worker.stdin.write("\n")
            worker.stdin.flush()
            assert worker.stdout.readline().strip() == "done"
        with open(stamps) as f:
            w = json.load(f)
    finally:
        conn.send = o_send  # type: ignore[method-assign]
        for n, orig in o_recvs.items():
            setattr(conn, n, orig)
        worker.wait(30)
    wake, on, sent = w["wake"], w["oncall"], w["sent"]
    parts: dict[str, list[float]] = {k: [] for k in _SHM_PARTS}
    for t0, s, sd, got, t1 in rows[len(rows) // 2:]:
        # NOTE: this request's _on_call is the first after the client began its send (every earlier one came before
        # the previous answer); not after the send returned: on a loaded machine the worker may take the CALL first
        i = bisect.bisect_left(on, s)
        k = bisect.bisect_left(sent, on[i]) if i < len(on) else len(sent)
        if k >= len(sent):
            continue
        j = bisect.bisect_right(wake, on[i]) - 1
        for key, v in zip(_SHM_PARTS, (s - t0, sd - s, wake[j] - sd, on[i] - wake[j], sent[k] - on[i],
                                       got - sent[k], t1 - got, t1 - t0)):
            parts[key].append(v)
    return _med(parts)


def run_pyzmq(calls: int, tmp: str) -> dict[str, float]:
    import zmq

    addr = os.path.join(tmp, f"echo-{secrets.token_hex(3)}")
    stamps = addr + ".json"
    warm = 500
    server = subprocess.Popen([sys.executable, "-c", _ECHO, addr, stamps, str(calls + warm)],
                              stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    payload = np.zeros(64, np.uint8)
    pc, rows = time.perf_counter, []
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "ready", "the echo server did not start"
        sock.connect(f"ipc://{addr}")
        for _ in range(warm):
            sock.send(payload, copy=False)
            sock.recv(copy=False)
        for _ in range(calls):
            t0 = pc()
            sock.send(payload, copy=False)
            t1 = pc()
            sock.recv(copy=False)
            rows.append((t0, t1, pc()))
        assert server.stdout.readline().strip() == "done"
        with open(stamps) as f:
            s = json.load(f)
    finally:
        sock.close()
        ctx.term()
        server.wait(30)
    got, sent = s["got"][warm:], s["sent"][warm:]
    parts: dict[str, list[float]] = {k: [] for k in _ZMQ_PARTS}
    for i in range(len(rows) // 2, len(rows)):
        t0, t1, t2 = rows[i]
        for key, v in zip(_ZMQ_PARTS, (t1 - t0, got[i] - t1, sent[i] - got[i], t2 - sent[i], t2 - t0)):
            parts[key].append(v)
    return _med(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=10000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res: dict[str, list[dict[str, float]]] = {"shmrpc": [], "pyzmq": []}
    with tempfile.TemporaryDirectory(prefix="shmrpc-ztrace-") as tmp:
        for _ in range(args.rounds):
            res["shmrpc"].append(run_shmrpc(args.calls, tmp))
            res["pyzmq"].append(run_pyzmq(args.calls, tmp))
    for kind, parts in (("shmrpc loan over ZeroMQ", _SHM_PARTS), ("pyzmq DEALER/ROUTER echo", _ZMQ_PARTS)):
        rounds = res["shmrpc" if kind.startswith("shmrpc") else "pyzmq"]
        print(f"{kind} (median µs, per round)")
        for k in parts:
            print(f"  {k:<42} " + " ".join(f"{r.get(k, float('nan')):8.2f}" for r in rounds))
    if args.out:
        from shmrpc.bench._report import write_probe

        write_probe({"mode": "zmq-trace", "calls": args.calls, "rounds": args.rounds, "median_us": res},
                    None, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
