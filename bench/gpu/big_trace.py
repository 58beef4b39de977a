"""Where a large request's time goes outside the worker's own span: timestamps on both sides, CuPy worker.

    python bench/gpu/big_trace.py [--reps 20] [--mib 256] [--lanes zmq,block,spin] [--out FILE.json]

The request of ``bench/gpu_e2e.py --only graphs`` (256 MiB float32 in, or ``--mib``; ``scale`` out of place, the loan
sent again; its chunk graph launched by the loop), over ZeroMQ, then through the blocking lane, then the spinning
lane, each with a fresh worker (a child process whose loop is instrumented, ``SERVE_STAMPED`` of
``bench/lane_trace.py``). Stamps (``time.perf_counter``, CLOCK_MONOTONIC: comparable between the processes):
the client's ``send`` entry, its ring (ZeroMQ send or lane ring), the DONE routed (from the socket or the
lane's page), ``send``'s return; the worker's ``_on_call`` entry, the launch (``_await_launched``
entry), the device found done (``_finish_launched`` entry), the DONE (``_send`` or ``Lanes.answer`` entry), and
each poll's entry and return with its timeout. Prints the median of each interval over the reps and writes
them to ``--out``: what the client sees against the worker's metric (``_on_call`` to DONE) is the gap the
duplex ratio of ``gpu_e2e.py`` pays. (The trials of 2026-12-01, a pulse patched into the worker and a client
pre-wake, ran with this program at ce63eb0, ``--trials``; the PULSE is built into the worker since, and they went.)
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
from math import nan

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from lane_trace import SERVE_STAMPED  # noqa: E402  (bench/, beside this directory)

_WORKER = '''
import json, sys, threading, time
from shmrpc.server import _lanes, _poll
from shmrpc.server._loop import Worker
from shmrpc.server.config import DEFAULT_LEASE, WorkerConfig
from shmrpc.schema.layout import parse_geometry
pc = time.perf_counter
T = {"oncall": [], "launched": [], "found": [], "done": [], "poll_in": [], "poll_out": [], "poll_ms": []}
P = _poll.LoopPoll
o_poll, o_on, o_aw, o_fin, o_send, o_ans = (P.poll, Worker._on_call, Worker._await_launched, Worker._finish_launched,
                                            Worker._send, _lanes.Lanes.answer)
def poll(self, timeout=None, *a):
    T["poll_in"].append(pc()); T["poll_ms"].append(-1 if timeout is None else timeout)
    try:
        return o_poll(self, timeout, *a)
    finally:
        T["poll_out"].append(pc())
def on(self, *a, **k):
    T["oncall"].append(pc())
    return o_on(self, *a, **k)
def aw(self, *a):
    if not T["launched"] or T["launched"][-1] < T["oncall"][-1]:
        T["launched"].append(pc())
    return o_aw(self, *a)
def fin(self):
    if self._launched is not None:
        T["found"].append(pc())
    return o_fin(self)
def send(self, identity, frame):
    if frame[:1] == b"D":
        T["done"].append(pc())
    return o_send(self, identity, frame)
def ans(self, *a):
    T["done"].append(pc())
    return o_ans(self, *a)
P.poll, Worker._on_call, Worker._await_launched, Worker._finish_launched = poll, on, aw, fin
T["graph_start_s"], T["graph_device_s"], T["else_in"], T["launch_in"], T["start_in"] = [], [], [], [], []
from shmrpc.server import _dispatch
o_else0, o_dlaunch = Worker._run_elsewhere, _dispatch.Dispatcher.launch
def else0(self, *a):
    T["else_in"].append(pc())
    return o_else0(self, *a)
def dlaunch(self, *a):
    T["launch_in"].append(pc())
    return o_dlaunch(self, *a)
Worker._run_elsewhere, _dispatch.Dispatcher.launch = else0, dlaunch
try:  # the chunk graph's launch on the host (ChunkGraphs.start) and its time on the device (the last run's)
    from shmrpc.kernels import _cuda_graph as G
    o_start = G.ChunkGraphs.start
    def start(self, *a):
        t = pc()
        T["start_in"].append(t)
        h = o_start(self, *a)
        T["graph_start_s"].append(pc() - t)
        if h is not None and h._g.last_s:
            T["graph_device_s"].append(h._g.last_s)
        return h
    G.ChunkGraphs.start = start
except ImportError:  # no CuPy
    pass
Worker._send, _lanes.Lanes.answer = send, ans
w = Worker(WorkerConfig(name=sys.argv[1], backend=sys.argv[4], mlock=False,
                        geometry=parse_geometry(f"64K:4,{2 * int(sys.argv[5]) + 8}M:1"),
                        lease=DEFAULT_LEASE[:2]))
''' + SERVE_STAMPED


def trace(lane: str | None, reps: int, backend: str, mib: int = 256) -> dict[str, float]:
    from shmrpc.client import Client, _connection, _inflight, _lane
    from shmrpc.schema import messages as m

    name = f"btrace-{os.getpid()}-{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory(prefix="shmrpc-btrace-") as tmp:
        stamps = os.path.join(tmp, "worker.json")
        worker = subprocess.Popen([sys.executable, "-c", _WORKER, name, stamps, "0", backend, str(mib)],
                                  stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        rows, woke = [], []
        try:
            assert worker.stdout is not None and worker.stdin is not None
            assert worker.stdout.readline().strip() == "ready", "the worker did not start"
            pc, last = time.perf_counter, {}
            o_send, o_ring = _connection.Connection.send, _lane.ClientLane.ring

            def send(self: object, frame: bytes, *a: object) -> object:
                if frame[:1] == m.CALL:
                    last["ring"] = pc()
                return o_send(self, frame, *a)  # type: ignore[arg-type]

            def ring(self: object, *a: object) -> None:
                last["ring"] = pc()
                o_ring(self, *a)  # type: ignore[arg-type]

            o_answered = _inflight.Inflight._answered

            def answered(self: object, *a: object) -> object:  # the DONE routed, from the socket or the lane
                woke.append(pc())
                return o_answered(self, *a)  # type: ignore[arg-type]

            _connection.Connection.send, _lane.ClientLane.ring = send, ring  # type: ignore[method-assign]
            _inflight.Inflight._answered = answered  # type: ignore[method-assign]
            try:
                n = (mib << 20) // 4
                with Client(name, timeout_s=60, lane=lane) as c, c.loan(2 * mib << 20) as req:
                    req.array("x", n, np.float32)[:] = 1.0
                    for _ in range(3):  # the chunk graph is captured on the request's second sight
                        req.send("scale", a=2.0, b=1.0)
                    for _ in range(reps):
                        t0 = pc()
                        req.send("scale", a=2.0, b=1.0)
                        rows.append((t0, last["ring"], pc()))
                    worker.stdin.write("\n")
                    worker.stdin.flush()
                    assert worker.stdout.readline().strip() == "done"
            finally:
                _connection.Connection.send, _lane.ClientLane.ring = o_send, o_ring
                _inflight.Inflight._answered = o_answered  # type: ignore[method-assign]
            with open(stamps) as f:
                w = json.load(f)
        finally:
            worker.wait(60)
    parts: dict[str, list[float]] = {k: [] for k in (
        "client: send to ring", "ring to the worker's _on_call", "_on_call to launched", "launched to found done",
        "found done to DONE", "DONE to the client routing it", "client: routed to send's return",
        "worker: _on_call to DONE (its metric's span)", "worker: its poll before the CALL, returned to _on_call",
        "worker: DONE to its next poll", "round trip", "worker: _on_call to _run_elsewhere",
        "worker: _run_elsewhere to Dispatcher.launch", "worker: Dispatcher.launch to ChunkGraphs.start")}
    polls_before: list[float] = []
    for t0, r, t1 in rows:
        i = bisect.bisect_left(w["oncall"], r)
        j = bisect.bisect_left(w["done"], w["oncall"][i]) if i < len(w["oncall"]) else len(w["done"])
        if i >= len(w["oncall"]) or j >= len(w["done"]):
            continue
        on, done = w["oncall"][i], w["done"][j]
        k = bisect.bisect_left(w["launched"], on)  # none on the NumPy backend (its large runs go to the executor)
        la = w["launched"][k] if k < len(w["launched"]) and w["launched"][k] < done else on
        k = bisect.bisect_left(w["found"], la)
        fo = w["found"][k] if k < len(w["found"]) and w["found"][k] <= done else done
        wk = woke[bisect.bisect_left(woke, done)]
        pb = bisect.bisect_left(w["poll_out"], on) - 1
        pn = bisect.bisect_left(w["poll_in"], done)
        polls_before.append(w["poll_ms"][pb])
        later = []  # the launch's steps after _on_call, where this request took them
        for key in ("else_in", "launch_in", "start_in"):
            k = bisect.bisect_left(w[key], later[-1] if later else on)
            later.append(w[key][k] if k < len(w[key]) and w[key][k] < done else nan)
        for k, v in zip(parts, (r - t0, on - r, la - on, fo - la, done - fo, wk - done, t1 - wk, done - on,
                                on - w["poll_out"][pb], w["poll_in"][pn] - done if pn < len(w["poll_in"]) else nan,
                                t1 - t0, later[0] - on,
                                later[1] - later[0], later[2] - later[1])):
            if v == v:  # not nan
                parts[k].append(v)
    med = {k: round(statistics.median(v) * 1e6, 1) for k, v in parts.items() if v}
    med["worker: timeout of its poll before the CALL (ms, median)"] = statistics.median(polls_before)
    for k, label in (("graph_start_s", "worker: ChunkGraphs.start (the graph's launch) on the host"),
                     ("graph_device_s", "worker: the chunk graph's last run on the device")):
        if w[k]:
            med[label] = round(statistics.median(w[k][-reps:]) * 1e6, 1)
    return med


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--backend", default="cupy", help="the worker's backend (numpy: to try this program without a GPU)")
    ap.add_argument("--mib", type=int, default=256, help="MiB in and MiB out per request (default 256)")
    ap.add_argument("--lanes", default="zmq,block,spin", help="the paths to trace")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out: dict[str, dict[str, float]] = {}
    for lane in [None if p == "zmq" else p for p in args.lanes.split(",")]:
        label = lane or "zmq"
        med = trace(lane, args.reps, args.backend, args.mib)
        out[label] = med
        print(f"== {label}: medians of {args.reps} requests, µs", flush=True)
        for k, v in med.items():
            print(f"  {k:<58} {v:9.1f}", flush=True)
    if args.out:
        from shmrpc.bench._report import write_probe

        write_probe({"mode": "big-trace", "reps": args.reps, "backend": args.backend, "mib": args.mib, "median_us": out},
                    None, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
