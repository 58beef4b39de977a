"""Where a large request's time goes in the worker's shape, in one process (issue #15).

256 MiB in + 256 MiB out (``scale`` float32, out of place) through ``CupyBackend.run`` on memfd
mappings registered as the worker's region is, next to the two-stream duplex copy of the same
memory measured just before each round. The run happens

    caller            on the calling thread (what bench/gpu_e2e.py --only copies measured)
    executor+poll     on an executor thread, while the calling thread does what the worker's loop does:
                      zmq poll with a timeout on a socket and a wake pipe, woken by the executor's write
    executor+poll0    the same with the loop polling without sleeping (``serve --spin-us``)
    executor+python   the same while the loop thread runs Python between polls of 1 ms (a busy loop)

each with the chunk pipeline issued from Python (plain) and as one CUDA graph (graph: the second
sight of the same views captures it), modes interleaved per round; medians of the rounds' medians.
Every mode's output is checked against 2*x + 1 in full once.

With ``--chunk-sweep 2M,4M,8M/1M``: the graph path also with those chunk settings (caller and
executor+poll; "8M/1M": 8 MiB chunks ramping from 1 MiB at both ends): a graph issues no Python
per chunk, so smaller (first and last) chunks may fill and drain the pipeline faster.

    python bench/gpu/copy_probe.py [--rounds 3] [--reps 8] [--chunk-sweep 2M,4M] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import platform
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq

N_BYTES = 256 << 20


def registered(cp: Any, n: int) -> tuple[np.ndarray, mmap.mmap]:
    """``n`` bytes of a memfd mapping, prefaulted and cudaHostRegister'ed (as the worker's region)."""
    fd = os.memfd_create("shmrpc-probe", os.MFD_CLOEXEC)
    os.ftruncate(fd, n)
    mm = mmap.mmap(fd, n)
    os.close(fd)
    a = np.frombuffer(mm, np.uint8, n)
    a[:] = 1
    cp.cuda.runtime.hostRegister(a.ctypes.data, n, 1)
    return a, mm


def duplex(cp: Any, a_in: np.ndarray, a_out: np.ndarray, d_in: Any, d_out: Any) -> float:
    """GB/s of one H2D and one D2H of the whole buffers at once on two streams (median of 8)."""
    rt = cp.cuda.runtime
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    n = a_in.nbytes
    ts = []
    for _ in range(10):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        rt.memcpyAsync(d_in.data.ptr, a_in.ctypes.data, n, rt.memcpyHostToDevice, s1.ptr)
        rt.memcpyAsync(a_out.ctypes.data, d_out.data.ptr, n, rt.memcpyDeviceToHost, s2.ptr)
        s1.synchronize()
        s2.synchronize()
        ts.append(time.perf_counter() - t0)
    return 2 * n / float(np.median(ts[2:])) / 1e9


class Loop:
    """The worker loop's shape: a ROUTER socket and a wake pipe polled with a timeout; work done on an executor."""

    def __init__(self, timeout_ms: int, python_between: bool) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(f"inproc://probe-{id(self)}")
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.wake_r, zmq.POLLIN)
        self.timeout_ms = timeout_ms
        self.python_between = python_between
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="probe-op")

    def call(self, fn: Any) -> Any:
        """Submit ``fn`` to the executor and poll until it writes the wake pipe, as the loop waits for DONE."""
        out: list[Any] = []

        def task() -> None:
            out.append(fn())
            os.write(self.wake_w, b"x")

        self.pool.submit(task)
        while True:
            events = dict(self.poller.poll(self.timeout_ms))
            if self.wake_r in events:
                os.read(self.wake_r, 4096)
                return out[0]
            if self.python_between:
                x = 0
                for i in range(2000):  # what a loop turn costs in Python: checks, bookkeeping
                    x += i

    def close(self) -> None:
        self.pool.shutdown()
        self.sock.close(0)
        self.ctx.term()
        os.close(self.wake_r)
        os.close(self.wake_w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--chunk-sweep", default="", help="more chunk settings for the graph path, e.g. 2M,8M/1M")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import cupy as cp

    from shmrpc import kernels
    from shmrpc.kernels import _cuda_chunks

    a_in, keep_in = registered(cp, N_BYTES)
    a_out, keep_out = registered(cp, N_BYTES)
    d_in, d_out = cp.empty(N_BYTES, cp.uint8), cp.ones(N_BYTES, cp.uint8)
    x, o = a_in.view(np.float32), a_out.view(np.float32)
    x[:] = np.random.default_rng(0).standard_normal(x.size, dtype=np.float32)
    want = 2 * x + 1
    be = kernels.select_backend("cupy")
    graphs = be._chunk_graphs  # type: ignore[attr-defined]
    limit = max(graphs.limit, 8)  # one graph per chunk setting of the sweep
    plan = be.plan([kernels.StepSpec("scale", {"x": "x"}, {"out": "out"}, {"a": 2.0, "b": 1.0})],
                   {"x": kernels.TensorSpec((x.size,), "float32")}, ["out"])
    loops = {"caller": None, "executor+poll": Loop(1000, False), "executor+poll0": Loop(0, False),
             "executor+python": Loop(1, True)}
    default_chunk = f"{_cuda_chunks.CHUNK_BYTES >> 20}M"
    modes = [(where, path, default_chunk) for where in loops for path in ("plain", "graph")]
    modes += [(where, "graph", c) for c in filter(None, args.chunk_sweep.split(",")) for where in ("caller", "executor+poll")]
    checked: dict[str, bool] = {}
    meds: dict[str, list[float]] = {}
    stages: dict[str, dict[str, float]] = {}
    ceilings: list[float] = []

    def run_once() -> dict[str, float]:
        return be.run(plan, {"x": x}, {"out": o})  # type: ignore[no-any-return]

    for r in range(args.rounds):
        ceilings.append(duplex(cp, a_in, a_out, d_in, d_out))
        for where, path, chunk in modes:
            graphs.limit = limit if path == "graph" else 0
            size, _, first = chunk.partition("/")
            _cuda_chunks.CHUNK_BYTES = _cuda_chunks.parse_bytes(size)
            _cuda_chunks.CHUNK_MIN_BYTES = _cuda_chunks.parse_bytes(first or size)
            loop = loops[where]
            call = run_once if loop is None else (lambda lp=loop: lp.call(run_once))
            label = f"{where} {path} {chunk}"
            for _ in range(2):  # the plain run once; a graph's first and second sight (captured there)
                call()
            if label not in checked:
                o[:] = 0
                t = call()
                checked[label] = bool(np.array_equal(o, want)) and ("graph" in t) == (path == "graph")
                if path == "plain":
                    stages[label] = {k: v for k, v in t.items()}
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                call()
                ts.append(time.perf_counter() - t0)
            meds.setdefault(label, []).append(float(np.median(ts)))
        print(f"round {r + 1}: duplex {ceilings[-1]:.1f} GB/s; " + ", ".join(
            f"{k} {2 * N_BYTES / v[-1] / 1e9:.1f}" for k, v in meds.items()), flush=True)
    ceiling = float(np.median(ceilings))
    rows = []
    print("\n| where the run is | path | chunk | 256 MiB in+out | ms per request | duplex (same memory, same rounds) | "
          "ratio | output checked |\n|---|---|---|---|---|---|---|---|")
    for label, v in meds.items():
        med = float(np.median(v))
        gbps = 2 * N_BYTES / med / 1e9
        where, path, chunk = label.rsplit(" ", 2)
        rows.append({"where": where, "path": path, "chunk": chunk, "median_s": med, "round_medians_s": v, "gbps_both_ways": gbps,
                     "ratio": gbps / ceiling, "checked": checked[label], "stages_plain": stages.get(label)})
        print(f"| {where} | {path} | {chunk} | {gbps:.1f} GB/s | {med * 1e3:.2f} | {ceiling:.1f} GB/s | {gbps / ceiling:.2f} | "
              f"{checked[label]} |")
    graphs.limit = limit
    print(f"chunk graphs: {len(graphs)} held, {graphs.captures} captures, {graphs.launches} launches, last error {graphs.last_error!r}")
    for lp in loops.values():
        if lp is not None:
            lp.close()
    be.close()
    cp.cuda.runtime.hostUnregister(a_in.ctypes.data)
    cp.cuda.runtime.hostUnregister(a_out.ctypes.data)
    if args.out:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
        doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "command": " ".join(sys.argv),
               "commit": os.environ.get("SHMRPC_COMMIT", "unknown"), "python": platform.python_version(),
               "cpu_count": os.cpu_count(), "gpu": gpu, "cupy": cp.__version__,
               "what": "256 MiB in + 256 MiB out, scale float32, memfd mappings registered; modes interleaved per round",
               "duplex_gbps_rounds": ceilings, "duplex_gbps": ceiling, "rows": rows,
               "chunk_graphs": {"captures": graphs.captures, "launches": graphs.launches, "last_error": graphs.last_error}}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "probe-loop"
    sys.exit(main())
