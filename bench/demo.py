"""`make demo`: a worker plus clients, results checked against NumPy, p50/p99 latencies.

Starts `shmrpc serve` (backend auto: CuPy with a GPU, else NumPy) as a separate process,
calls it from this process (echo, vector_add, scale, a pipeline, the zero-copy loan path),
then from several client processes at once, prints what it saw, stops the worker with
SIGTERM and checks that nothing is left in /dev/shm.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid

import numpy as np

from shmrpc.client import Client, Pipeline
from shmrpc.schema.naming import region_prefix

SLOTS = "64K:32,1M:8,16M:4"


def _pct(samples: list[float]) -> str:
    a = np.asarray(samples) * 1e6
    return f"p50 {np.percentile(a, 50):7.1f} us   p99 {np.percentile(a, 99):7.1f} us   (n={len(a)})"


def _timed(fn, n: int) -> list[float]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _client_proc(name: str, seed: int, n: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal(1024).astype(np.float32), rng.standard_normal(1024).astype(np.float32)
    with Client(name, timeout_s=10) as c:
        ok = all(np.array_equal(c.call("vector_add", x=x, y=y)["out"], x + y) for _ in range(n))
        lat = _timed(lambda: c.call("vector_add", x=x, y=y), n)
    q.put((os.getpid(), ok, lat))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    name = f"demo-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--slots", SLOTS,
           "--backend", args.backend, "--log-level", "WARNING"]
    from shmrpc.server.checks import StartupError, check_memlock  # the demo runs beside the worker

    try:
        check_memlock(64 << 20)
    except StartupError as e:
        print(f"note: {e}\n      running the demo worker with --no-mlock")
        cmd.append("--no-mlock")
    print("$", " ".join(cmd[2:]).replace("shmrpc.server", "shmrpc"))
    worker = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    rc = 1
    try:
        ready = worker.stdout.readline() if worker.stdout else ""  # a client fails at once when no worker is there
        print(ready, end="")
        if "ready" not in ready:
            raise SystemExit(f"the worker did not start (exit status {worker.wait(30)})")
        with Client(name, timeout_s=10, connect_timeout_s=30) as c:
            print(f"connected to worker {name} (pid {c.worker_pid}, backend {c.backend}); ops: {', '.join(sorted(c.op_table))}")
            rng = np.random.default_rng(0)
            x, y = rng.standard_normal(4096).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
            checks = {
                "echo": np.array_equal(c.call("echo", x=x)["out"], x),
                "vector_add": np.allclose(c.call("vector_add", x=x, y=y)["out"], x + y),
                "scale": np.allclose(c.call("scale", x=x, a=2.0, b=0.5)["out"], 2 * x + 0.5, rtol=1e-6),
                "pipeline scale->vector_add": np.allclose(
                    c.call(Pipeline().then("scale", a=3.0).then("vector_add", inputs={"x": "0.out", "y": "y"}),
                           x=x, y=y)["1.out"], 3 * x + y, rtol=1e-6),
            }
            with c.loan(x.nbytes) as req:
                v = req.array("x", x.shape, x.dtype)
                v[:] = x
                req.send("scale", a=2.0, in_place=True)
                checks["zero-copy loan, scale in place"] = np.allclose(v, 2 * x)  # our own view changed
                del v
            for k, ok in checks.items():
                print(f"  {k:32s} {'ok' if ok else 'WRONG'}")
            small = np.zeros(16, np.float32) + 1
            print("in-process latency, echo 64 B (call, copy in/out):", _pct(_timed(lambda: c.call("echo", x=small),
                                                                                   args.calls)))
            with c.loan(64) as req:
                req.array("x", 16, np.float32)[:] = 1
                print("in-process latency, echo 64 B (zero-copy loan): ", _pct(_timed(lambda: req.send("echo"),
                                                                                    args.calls)))
        q: mp.Queue = mp.get_context("spawn").Queue()  # type: ignore[type-arg]
        procs = [mp.get_context("spawn").Process(target=_client_proc, args=(name, i, args.calls, q))
                 for i in range(args.clients)]
        for p in procs:
            p.start()
        results = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        all_lat: list[float] = []
        for pid, ok, lat in results:
            print(f"client process {pid}: {args.calls} vector_add 4 KiB {'ok' if ok else 'WRONG'}   {_pct(lat)}")
            all_lat += lat
        print(f"{args.clients} processes at once, all calls:           {_pct(all_lat)}")
        rc = 0 if all(checks.values()) and all(ok for _, ok, _ in results) else 1
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)
    left = [f for f in os.listdir("/dev/shm") if f.startswith(region_prefix(name))]
    print(f"worker exited with {worker.returncode}; left in /dev/shm: {left or 'nothing'}")
    return rc if worker.returncode == 0 and not left else 1


if __name__ == "__main__":
    sys.exit(main())
