"""Does the device wait for a chunk graph's launch? The 256 MiB request's graph, launched on an idle stream and
launched behind a busy kernel, in process (no worker, no transport).

    python3 bench/gpu/graph_gap_probe.py [--reps 20] [--out FILE.json]

The request of ``bench/gpu_e2e.py --only graphs`` (``scale``, 256 MiB float32 in and out, registered host memory)
through ``CupyBackend.launch`` (``ChunkGraphs.start``: an event, the graph's launch, an event). Per rep, interleaved:
``idle``: launched on its idle stream, as the worker does; ``queued``: launched behind a kernel that keeps that stream
busy for 2 ms, so the host's launch is over before the device reaches the graph. Both report the device's time from the
first event to the last (``ChunkStarted.finish`` behind the backend's handle, the graph's ``last_s``), and ``idle`` the host's time in
``ChunkGraphs.start``. If the device starts the graph's work while the host still launches it, the two device times are
the same; if it waits for the launch, ``idle`` is longer by about the launch's host time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import cupy as cp
    from copy_probe import N_BYTES, registered  # (bench/gpu/, beside this program)

    from shmrpc import kernels

    a_in, keep_in = registered(cp, N_BYTES)
    a_out, keep_out = registered(cp, N_BYTES)
    x, o = a_in.view(np.float32), a_out.view(np.float32)
    x[:] = np.random.default_rng(0).standard_normal(x.size, dtype=np.float32)
    be = kernels.select_backend("cupy")
    plan = be.plan([kernels.StepSpec("scale", {"x": "x"}, {"out": "out"}, {"a": 2.0, "b": 1.0})],
                   {"x": kernels.TensorSpec((x.size,), "float32")}, ["out"])
    for _ in range(3):  # the plain run, then the graph's capture on its second sight
        be.run(plan, {"x": x}, {"out": o})
    spin = cp.RawKernel(_SPIN, "spin")
    clock_hz = cp.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1e3
    rows: dict[str, list[float]] = {"idle_device_s": [], "queued_device_s": [], "idle_host_start_s": [],
                                    "queued_host_start_s": []}
    h = be.launch(plan, {"x": x}, {"out": o})
    assert h is not None, "no launched graph"
    stream = h._started._g.stream  # the graph's own stream
    h.finish()
    for _ in range(args.reps):
        for mode in ("idle", "queued"):
            if mode == "queued":
                with stream:
                    spin((1,), (1,), (np.int64(2e-3 * clock_hz),))
            t0 = time.perf_counter()
            h = be.launch(plan, {"x": x}, {"out": o})
            assert h is not None
            t1 = time.perf_counter()
            h.finish()
            rows[f"{mode}_host_start_s"].append(t1 - t0)
            rows[f"{mode}_device_s"].append(h._started._g.last_s)
    ok = bool(np.array_equal(o, 2 * x + 1))
    med = {k: statistics.median(v) * 1e6 for k, v in rows.items()}
    print(f"256 MiB scale through the chunk graph, medians of {args.reps} reps, output checked: {ok}")
    print(f"  idle stream:   device first->last {med['idle_device_s']:8.1f} µs, host launch {med['idle_host_start_s']:6.1f} µs")
    print(f"  behind a 2 ms kernel: device      {med['queued_device_s']:8.1f} µs, host launch "
          f"{med['queued_host_start_s']:6.1f} µs")
    print(f"  the device waited for the launch: {med['idle_device_s'] - med['queued_device_s']:8.1f} µs")
    be.close()
    cp.cuda.runtime.hostUnregister(a_in.ctypes.data)
    cp.cuda.runtime.hostUnregister(a_out.ctypes.data)
    if args.out:
        from shmrpc.bench._report import write_probe

        write_probe({"mode": "graph-gap-probe", "reps": args.reps, "checked": ok, "median_us": med,
                     "raw_s": rows}, None, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
