"""Where the worker's express path spends its time on one lane request: ``_on_call`` of a captured CALL, in process.

    python bench/express_parts.py [--calls 20000] [--rounds 5] [--out FILE.json]

Starts a NumPy worker in this process (its loop on a thread) and a client process that sends 64 B in-place
``vector_add`` loan requests through a spinning lane until the slot's express entry is armed; then stops the client
(SIGSTOP) and the loop, and calls the loop's ``_on_call`` for the captured CALL over and over, the request's header
and descriptor written back into the slot before each call (that write is timed alone and taken off), the client's
awake word set far ahead so that no eventfd is written (as for a spinning client). Variants leave one part out, a stub
in its place: the run itself (the bound ``vector_add``), the metrics' observation, the answer into the lane's page.
``scan`` is the lane scan that finds a new call_seq (the lane's ``seen`` set back before each). Prints the medians over
rounds, µs per call, and writes them to ``--out``. A probe of one machine's Python: compare its rows with each other
and with another tree's run of it, not with round trips.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_CLIENT = """
import sys, numpy as np
from shmrpc.client import Client
with Client(sys.argv[1], timeout_s=30, lane="spin") as c, c.loan(4096) as req:
    req.array("x", (16,), np.float32)[...] = 1
    req.array("y", (16,), np.float32)[...] = 0
    for _ in range(300):
        req.send("vector_add", in_place=True)
    print("armed", flush=True)
    sys.stdin.readline()
"""


def _per_call_us(f: Callable[[], None], calls: int) -> float:
    pc = time.perf_counter
    t0 = pc()
    for _ in range(calls):
        f()
    return (pc() - t0) / calls * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from shmrpc.server._loop import Worker
    from shmrpc.server.config import WorkerConfig

    name = f"parts-{os.getpid()}-{secrets.token_hex(3)}"
    w = Worker(WorkerConfig(name=name, backend="numpy", mlock=False))
    w.start()
    seen: dict[str, Any] = {}
    on_call = Worker._on_call

    def spy(self: Worker, identity: bytes, frame: bytes, stopping: bool, lane: int = 0) -> None:
        ex = self._express.get(frame[2:8])
        if lane and ex is not None:
            seen.update(identity=identity, frame=frame, lane=lane, key=frame[2:8], req=bytes(ex.view[:ex.end]))
        on_call(self, identity, frame, stopping, lane)

    Worker._on_call = spy  # type: ignore[method-assign]
    loop = threading.Thread(target=w.serve_forever, daemon=True)
    loop.start()
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert client.stdout is not None and client.stdin is not None
        assert client.stdout.readline().strip() == "armed", "the client did not start"
        Worker._on_call = on_call  # type: ignore[method-assign]
        w.stop()
        loop.join(10)
        os.kill(client.pid, signal.SIGSTOP)
        identity, frame, seq, key, req = seen["identity"], seen["frame"], seen["lane"], seen["key"], seen["req"]
        express = w._express
        ex = express[key]
        view, n, s = ex.view, len(req), ex.slot
        lanes = w._lanes
        assert lanes is not None
        lane = lanes.by_identity[identity]
        lane._client_awake.value = 1 << 62  # the client says it polls: the answer writes no eventfd

        def restore() -> None:
            view[:n] = req

        def once() -> None:
            view[:n] = req
            w._on_call(identity, frame, False, seq)
            s.in_flight = False

        def scan() -> None:
            lane.seen = 0
            lanes.scan()

        stub_stages = {"h2d": 0.0, "kernel": 0.0, "d2h": 0.0, "total": 0.0}
        no_run = dataclasses.replace(ex, primed=dataclasses.replace(ex.primed, bound=lambda: stub_stages))
        variants: dict[str, tuple[Callable[[], None], Callable[[], None], Callable[[], None]]] = {
            "express path, whole": (once, lambda: None, lambda: None),
            "without the run (vector_add)": (once, lambda: express.__setitem__(key, no_run),
                                             lambda: express.__setitem__(key, ex)),
            "without the metrics' observation": (once, lambda: setattr(w.metrics, "observe", lambda *a: None),
                                                 lambda: delattr(w.metrics, "observe")),
            "without the answer into the lane": (once, lambda: setattr(lanes, "answer", lambda *a: None),
                                                 lambda: delattr(lanes, "answer")),
            "the header and descriptor written back (taken off above)": (restore, lambda: None, lambda: None),
            "scan of a new call_seq": (scan, lambda: None, lambda: None),
        }
        hits = w._primed.hits
        got: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):
            for label, (f, setup, undo) in variants.items():
                setup()
                try:
                    for _ in range(500):
                        f()
                    got[label].append(_per_call_us(f, args.calls))
                finally:
                    undo()
        assert w._primed.hits - hits >= 4 * args.rounds * (args.calls + 500), "a call left the express path"
        med = {k: statistics.median(v) for k, v in got.items()}
        base = med["the header and descriptor written back (taken off above)"]
        out = {k: round(v - base, 3) if k.startswith(("express", "without")) else round(v, 3) for k, v in med.items()}
        for k, v in out.items():
            print(f"{k:<58} {v:7.2f} µs")
        if args.out:
            from shmrpc.bench._report import write_probe

            write_probe({"mode": "express-parts", "calls": args.calls, "rounds": args.rounds, "median_us": out,
                         "rounds_us": {k: [round(x, 3) for x in v] for k, v in got.items()}}, None, args.out)
    finally:
        os.kill(client.pid, signal.SIGCONT)
        if client.stdin is not None:
            client.stdin.write("\n")
            client.stdin.flush()
        client.wait(10)
        w.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
