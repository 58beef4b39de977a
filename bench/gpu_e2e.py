"""GPU worker benchmarks through the real request path, each next to its ceiling.

1. 256 MiB in + 256 MiB out through the GPU (`scale`, out of place), client-observed round trip, GB/s
   both ways; ceiling: two-stream duplex copy between a pinned host buffer and the device, same run.
2. The same with the region not registered (`--no-register`): what pinning buys.
3. Tiny request (64 B in, 64 B out, `scale` on the GPU): p50/p99 vs a bare pyzmq DEALER/ROUTER ping-pong.
4. Requests per second from 8 client processes sending small `gemm` calls, against 1 client.
5. With ``--chunk-sweep 2M,8M,16M/1M``: section 1 once per chunk setting ("16M/1M": chunks of
   16 MiB ramping from 1 MiB at both ends; "8M": all chunks 8 MiB, no ramp) (and per pipeline of
   ``--pipelines stages,streams``, streams of ``--chunk-streams``), each through a worker
   started with SHMRPC_CHUNK_BYTES / SHMRPC_CHUNK_MIN_BYTES / SHMRPC_CHUNK_PIPELINE /
   SHMRPC_CHUNK_STREAMS set, each next to the duplex ceiling measured just before it, and
   the worker's own mean time per request (its status counters) beside the client's.

6. ``--only copies``: in this process, no worker: the duplex copy and ``backend.run`` of the
   256 MiB ``scale`` on three kinds of page-locked host memory (cudaHostAlloc; a memfd mapping,
   as the worker's region, and an anonymous mapping, both cudaHostRegister'ed), the run once
   per pipeline and chunk setting of ``--chunk-sweep``: what the backend reaches on the very
   memory it copies, without the request path; last, the default setting again while another
   Python thread of the process spins (what a busy loop thread costs the run through the GIL).

7. ``--only graphs``: section 1 through workers with chunk graphs off (``SHMRPC_CUDA_LARGE_GRAPHS=0``)
   and on (the default: launched by the loop and answered when done; over ZeroMQ, and through a blocking and a
   spinning lane; each also with ``SHMRPC_CUDA_LAUNCH_BATCHES=0``: run by an executor thread), interleaved ``--rounds`` times, each next to the duplex ceiling measured just
   before it and the worker's own mean per request; ``--only gemmab``: section 4's 8 client processes
   through workers with CUDA graphs off (``SHMRPC_CUDA_GRAPHS=0``) and on, interleaved, with clients
   sending through ``Client.call`` and through one kept slot each (``--gemm-clients call,loan``).

    python bench/gpu_e2e.py --out bench/results/gpu-e2e-DATE.json
    python bench/gpu_e2e.py --only graphs,gemmab --rounds 2 --reps 12 --seconds 4 --out bench/results/gpu-graphs-e2e-DATE.json
    python bench/gpu_e2e.py --only sweep --chunk-sweep 2M,4M,8M,16M --out bench/results/gpu-chunks-DATE.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import zmq

from shmrpc.client import Client

SLOTS = "64K:64,1M:16,16M:8,80M:4,520M:1"


def start(name: str, *extra: str, env: dict[str, str] | None = None, slots: str = SLOTS) -> subprocess.Popen:  # type: ignore[type-arg]
    p = subprocess.Popen([sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--slots", slots,
                          "--backend", "cupy", "--log-level", "WARNING", *extra], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})})
    line = p.stdout.readline() if p.stdout else ""
    if "ready" not in line:
        raise SystemExit(f"worker did not start: {line}")
    return p


def stop(p: subprocess.Popen) -> None:  # type: ignore[type-arg]
    p.send_signal(signal.SIGTERM)
    p.communicate(timeout=60)


def _worker_duration(name: str, op: str) -> tuple[int, float] | None:
    """(count, sum_s) of the worker's duration counter for ``op`` (``shmrpc status``), or None."""
    st = subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", name, "--json"],
                        capture_output=True, text=True)
    try:
        d = json.loads(st.stdout)["counters"]["duration"][op]
        return int(d["count"]), float(d["sum_s"])
    except (ValueError, KeyError, TypeError):
        return None


def big(name: str, reps: int, lane: str | None = None) -> dict[str, float]:
    n = (256 << 20) // 4
    with Client(name, timeout_s=60, lane=lane) as c, c.loan(512 << 20) as req:
        x = req.array("x", n, np.float32)
        x[:] = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
        out = req.send("scale", a=2.0, b=1.0)["out"]
        ok = bool(np.allclose(out[:1 << 20], 2 * x[:1 << 20] + 1, rtol=1e-6))
        del out
        for _ in range(2):  # a repeated request: the chunk graph is captured on its second sight
            req.send("scale", a=2.0, b=1.0)
        before = _worker_duration(name, "scale")
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            req.send("scale", a=2.0, b=1.0)
            times.append(time.perf_counter() - t0)
        after = _worker_duration(name, "scale")
        last = req.send("scale", a=2.0, b=1.0)["out"]
        ok = ok and bool(np.array_equal(last, 2 * x + 1))
        del last, x
    med = float(np.median(times))
    res = {"median_s": med, "gbps_both_ways": 2 * (256 << 20) / med / 1e9, "correct": ok, "reps": reps}
    if before and after and after[0] > before[0]:
        res["worker_mean_s"] = (after[1] - before[1]) / (after[0] - before[0])  # the timed requests only
    return res


def duplex_ceiling() -> dict[str, float]:
    import cupy as cp

    n = 256 << 20
    h_in = cp.cuda.alloc_pinned_memory(n)
    h_out = cp.cuda.alloc_pinned_memory(n)
    a_in = np.frombuffer(h_in, np.uint8, n)
    a_out = np.frombuffer(h_out, np.uint8, n)
    a_in[:] = 1
    d_in, d_out = cp.empty(n, cp.uint8), cp.ones(n, cp.uint8)
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    res = {}
    for label in ("h2d", "d2h", "duplex"):
        times = []
        for _ in range(10):
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            if label in ("h2d", "duplex"):
                d_in.set(a_in, stream=s1)
            if label in ("d2h", "duplex"):
                d_out.get(stream=s2, out=a_out)
            s1.synchronize()
            s2.synchronize()
            times.append(time.perf_counter() - t0)
        med = float(np.median(times[2:]))
        res[f"{label}_gbps"] = (2 if label == "duplex" else 1) * n / med / 1e9
    return res


def tiny(name: str, n: int) -> dict[str, float]:
    with Client(name, timeout_s=10) as c, c.loan(64) as req:
        req.array("x", 16, np.float32)[:] = 1
        for _ in range(200):
            req.send("scale", a=2.0)
        lat = []
        for _ in range(n):
            t0 = time.perf_counter()
            req.send("scale", a=2.0)
            lat.append(time.perf_counter() - t0)
    a = np.asarray(lat) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)), "n": n}


def bare_zmq(n: int) -> dict[str, float]:
    ctx = zmq.Context()
    ep = f"ipc:///tmp/shmrpc-bench-{uuid.uuid4().hex[:8]}.sock"
    r = ctx.socket(zmq.ROUTER)
    r.bind(ep)

    def serve() -> None:
        for _ in range(n + 200):
            ident, msg = r.recv_multipart()
            r.send_multipart([ident, msg])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    d = ctx.socket(zmq.DEALER)
    d.connect(ep)
    payload = b"x" * 64
    lat = []
    for i in range(n + 200):
        t0 = time.perf_counter()
        d.send(payload)
        d.recv()
        if i >= 200:
            lat.append(time.perf_counter() - t0)
    t.join(5)
    d.close(0)
    r.close(0)
    ctx.term()
    a = np.asarray(lat) * 1e6
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99)), "n": n,
            "note": "server in a thread of the same process (the bench harness's peer uses a process)"}


def _gemm_client(name: str, seconds: float, q: object, loan: bool = False) -> None:
    """One client process sending gemm 16x256 @ 256x256 float16 (x and w with every request) until ``seconds``
    pass: through ``Client.call`` (copies into a slot of its lease), or with ``loan`` through one slot it keeps
    (x and w written into it before every send: the same slot, so the same host addresses, every time)."""
    rng = np.random.default_rng(os.getpid())
    x = rng.standard_normal((16, 256)).astype(np.float16)
    w = rng.standard_normal((256, 256)).astype(np.float16)
    n = 0
    with Client(name, timeout_s=30) as c:
        if loan:
            with c.loan(1 << 20) as req:
                xa, wa = req.array("x", x.shape, np.float16), req.array("w", w.shape, np.float16)
                xa[:] = x
                wa[:] = w
                req.send("gemm")
                t_end = time.perf_counter() + seconds
                while time.perf_counter() < t_end:
                    xa[:] = x
                    wa[:] = w
                    req.send("gemm")
                    n += 1
        else:
            c.call("gemm", x=x, w=w)
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                c.call("gemm", x=x, w=w)
                n += 1
    q.put(n)  # type: ignore[attr-defined]


def rps(name: str, procs: int, seconds: float, loan: bool = False) -> float:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_gemm_client, args=(name, seconds, q, loan)) for _ in range(procs)]
    for p in ps:
        p.start()
    total = sum(q.get(timeout=seconds + 120) for _ in ps)
    for p in ps:
        p.join(30)
    return total / seconds


def chunk_sweep(sizes: list[str], pipelines: list[str], streams: int, reps: int) -> list[dict[str, object]]:
    """Section 1 through one worker per (pipeline, chunk size), each next to a duplex ceiling measured just before."""
    rows: list[dict[str, object]] = []
    for pipeline in pipelines:
        for size in sizes:
            ceiling = duplex_ceiling()["duplex_gbps"]
            chunk, _, first = size.partition("/")
            env = {"SHMRPC_CHUNK_BYTES": chunk, "SHMRPC_CHUNK_MIN_BYTES": first or chunk, "SHMRPC_CHUNK_PIPELINE": pipeline,
                   "SHMRPC_CHUNK_STREAMS": str(streams)}
            name = f"gpu-{uuid.uuid4().hex[:6]}"
            w = start(name, env=env, slots="64K:4,520M:1")
            try:
                r = big(name, reps)
            finally:
                stop(w)
            row = {"pipeline": pipeline, "chunk": size, "streams": streams, "gbps_both_ways": r["gbps_both_ways"],
                   "median_s": r["median_s"], "correct": r["correct"], "duplex_ceiling_gbps": ceiling,
                   "ratio": r["gbps_both_ways"] / ceiling, "worker_mean_s": r.get("worker_mean_s")}
            rows.append(row)
            wm = r.get("worker_mean_s")
            print(f"| {pipeline} | {size} | {streams} | {r['gbps_both_ways']:.1f} GB/s | {ceiling:.1f} GB/s | "
                  f"{row['ratio']:.2f} | {r['median_s'] * 1e3:.2f} / {wm * 1e3 if wm else float('nan'):.2f} ms | "
                  f"{r['correct']} |", flush=True)
    return rows


def graphs_ab(reps: int, rounds: int, graph_chunks: list[str], paths: list[str] | None = None) -> list[dict[str, object]]:
    """Section 7: the 256 MiB request through a worker with chunk graphs off and on (the default chunks, and
    each setting of ``graph_chunks``: "8M/1M" = 8 MiB chunks ramping from 1 MiB at both ends), interleaved."""
    rows: list[dict[str, object]] = []
    off = {"SHMRPC_CUDA_LAUNCH_BATCHES": "0"}  # the graph run and waited for by an executor thread
    variants: list[tuple[str, dict[str, str]]] = [("plain", {"SHMRPC_CUDA_LARGE_GRAPHS": "0"}), ("graph", {}),
                                                  ("graph, executor", off), ("graph, blocking lane", {}),
                                                  ("graph, blocking lane, executor", off), ("graph, spinning lane", {}),
                                                  ("graph, spinning lane, executor", off)]
    for size in graph_chunks:
        chunk, _, first = size.partition("/")
        variants.append((f"graph {size}", {"SHMRPC_CHUNK_BYTES": chunk, "SHMRPC_CHUNK_MIN_BYTES": first or chunk}))
    if paths:
        unknown = set(paths) - {label for label, _ in variants}
        if unknown:
            raise SystemExit(f"--graph-paths: no such path {sorted(unknown)}")
        variants = [v for v in variants if v[0] in paths]
    for r in range(rounds):
        for label, env in variants:
            ceiling = duplex_ceiling()["duplex_gbps"]
            name = f"gpu-{uuid.uuid4().hex[:6]}"
            w = start(name, env=env, slots="64K:4,520M:1")
            try:
                res = big(name, reps, "block" if "blocking lane" in label else "spin" if "spinning lane" in label else None)
            finally:
                stop(w)
            row = {"round": r, "path": label, "env": env, "duplex_ceiling_gbps": ceiling, **res,
                   "ratio": res["gbps_both_ways"] / ceiling}
            rows.append(row)
            wm = res.get("worker_mean_s")
            print(f"| {r + 1} | {label} | {res['gbps_both_ways']:.1f} GB/s | {ceiling:.1f} GB/s | {row['ratio']:.2f} | "
                  f"{res['median_s'] * 1e3:.2f} / {wm * 1e3 if wm else float('nan'):.2f} ms | {res['correct']} |", flush=True)
    return rows


def gemm_ab(seconds: float, rounds: int, modes: list[str]) -> list[dict[str, object]]:
    """Section 7: 8 client processes of gemm 16x256x256 float16 through workers with CUDA graphs off and on,
    per client mode ("call": Client.call; "loan": one kept slot each)."""
    rows: list[dict[str, object]] = []
    for r in range(rounds):
        for mode in modes:
            for label, env in (("plain", {"SHMRPC_CUDA_GRAPHS": "0"}), ("graph", {})):
                name = f"gpu-{uuid.uuid4().hex[:6]}"
                w = start(name, "--log-level", "INFO", env=env)  # the backend logs its graph counts at close
                try:
                    total = rps(name, 8, seconds, loan=mode == "loan")
                    wd = _worker_duration(name, "gemm")
                finally:
                    stop(w)
                wmean = wd[1] / wd[0] if wd and wd[0] else None
                rows.append({"round": r, "clients": mode, "path": label, "env": env, "requests_per_s_8_clients": total,
                             "worker_mean_s": wmean})
                print(f"| {r + 1} | {mode} | {label} | {total:.0f} requests/s | "
                      f"{wmean * 1e6 if wmean else float('nan'):.1f} us |", flush=True)
    return rows


def _host_memory(kind: str, n: int) -> tuple[np.ndarray, object]:
    """``n`` page-locked bytes of ``kind`` ("hostalloc", "memfd", "anon"), prefaulted; returns (array, keepalive)."""
    import mmap

    import cupy as cp

    if kind == "hostalloc":
        mem = cp.cuda.alloc_pinned_memory(n)
        a = np.frombuffer(mem, np.uint8, n)
        a[:] = 1
        return a, mem
    if kind == "memfd":
        fd = os.memfd_create("shmrpc-bench", os.MFD_CLOEXEC)
        os.ftruncate(fd, n)
        mm = mmap.mmap(fd, n)
        os.close(fd)
    else:
        mm = mmap.mmap(-1, n)
        if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(mm, np.uint8, n)
    a[:] = 1
    cp.cuda.runtime.hostRegister(a.ctypes.data, n, 1)
    return a, mm


def _duplex(a_in: np.ndarray, a_out: np.ndarray) -> float:
    """GB/s of one H2D and one D2H of the same size at once, on two streams (median of 8)."""
    import cupy as cp

    n = a_in.nbytes
    d_in, d_out = cp.empty(n, cp.uint8), cp.ones(n, cp.uint8)
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    rt = cp.cuda.runtime
    times = []
    for _ in range(10):
        cp.cuda.Device().synchronize()
        t0 = time.perf_counter()
        rt.memcpyAsync(d_in.data.ptr, a_in.ctypes.data, n, rt.memcpyHostToDevice, s1.ptr)
        rt.memcpyAsync(a_out.ctypes.data, d_out.data.ptr, n, rt.memcpyDeviceToHost, s2.ptr)
        s1.synchronize()
        s2.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * n / float(np.median(times[2:])) / 1e9


def _spin(stop: threading.Event) -> None:
    """Pure Python work until ``stop``: a thread that wants the GIL all the time."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def copies(sizes: list[str], pipelines: list[str], reps: int, memories: list[str]) -> list[dict[str, object]]:
    """Section 6: duplex copy and backend.run of the 256 MiB scale per memory kind and chunk setting, in process."""
    import cupy as cp

    from shmrpc import kernels
    from shmrpc.kernels import _cuda_chunks

    n = 256 << 20
    defaults = (_cuda_chunks.CHUNK_PIPELINE, f"{_cuda_chunks.CHUNK_BYTES >> 20}M/{_cuda_chunks.CHUNK_MIN_BYTES >> 20}M")
    rows: list[dict[str, object]] = []
    for path in ("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/kernel/mm/transparent_hugepage/shmem_enabled"):
        try:
            print(path.rsplit("/", 1)[1], open(path).read().strip())
        except OSError:
            pass
    be = kernels.select_backend("cupy")
    plan = be.plan([kernels.StepSpec("scale", {"x": "x"}, {"out": "out"}, {"a": 2.0, "b": 1.0})],
                   {"x": kernels.TensorSpec((n // 4,), "float32")}, ["out"])
    print("| memory | pipeline | chunk | backend.run in+out | duplex copy (same memory, just before) | ratio |\n"
          "|---|---|---|---|---|---|", flush=True)
    for kind in memories:
        a_in, keep_in = _host_memory(kind, n)
        a_out, keep_out = _host_memory(kind, n)
        x, o = a_in.view(np.float32), a_out.view(np.float32)
        settings = [(p, sz, False) for p in pipelines for sz in sizes]
        if kind == "memfd":
            settings.append((defaults[0], defaults[1], True))
        for pipeline, size, spin in settings:
            ceiling = _duplex(a_in, a_out)
            chunk, _, first = size.partition("/")
            _cuda_chunks.CHUNK_PIPELINE, _cuda_chunks.CHUNK_BYTES = pipeline, _cuda_chunks.parse_bytes(chunk)
            _cuda_chunks.CHUNK_MIN_BYTES = _cuda_chunks.parse_bytes(first or chunk)
            be.run(plan, {"x": x}, {"out": o})
            stop = threading.Event()
            spinner = threading.Thread(target=_spin, args=(stop,), daemon=True)
            if spin:
                spinner.start()
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                be.run(plan, {"x": x}, {"out": o})
                ts.append(time.perf_counter() - t0)
            stop.set()
            if spin:
                spinner.join()
            gbps = 2 * n / float(np.median(ts)) / 1e9
            label = f"{size}{' + a spinning thread' if spin else ''}"
            rows.append({"memory": kind, "pipeline": pipeline, "chunk": size, "spinning_thread": spin,
                         "gbps_both_ways": gbps, "duplex_gbps": ceiling, "ratio": gbps / ceiling})
            print(f"| {kind} | {pipeline} | {label} | {gbps:.1f} GB/s | {ceiling:.1f} GB/s | {gbps / ceiling:.2f} |",
                  flush=True)
        if kind != "hostalloc":
            cp.cuda.runtime.hostUnregister(a_in.ctypes.data)
            cp.cuda.runtime.hostUnregister(a_out.ctypes.data)
        del x, o, a_in, a_out, keep_in, keep_out
    be.close()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiny", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--chunk-sweep", default="", help="chunk sizes, e.g. 2M,4M,8M,16M (section 5)")
    ap.add_argument("--pipelines", default="stages,streams", help="chunk pipelines of the sweep")
    ap.add_argument("--chunk-streams", type=int, default=4, help="streams of the 'streams' pipeline in the sweep")
    ap.add_argument("--memories", default="hostalloc,memfd,anon", help="host memory kinds of --only copies")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of --only graphs / gemmab")
    ap.add_argument("--gemm-clients", default="call,loan", help="client modes of --only gemmab: call, loan")
    ap.add_argument("--graph-paths", default="", help="the paths of --only graphs to run, ';'-separated labels "
                    "(default: all), e.g. 'graph;graph, blocking lane'")
    ap.add_argument("--graph-chunks", default="", help="more chunk settings for the graph workers of --only graphs, "
                                                        "e.g. 8M/1M,16M/1M")
    ap.add_argument("--only", default="", help="sections to run, of big,tiny,rps,pageable,sweep,copies,graphs,gemmab (default: "
                                               "big,tiny,rps,pageable, plus sweep when --chunk-sweep is given)")
    args = ap.parse_args()
    only = set(filter(None, args.only.split(","))) or {"big", "tiny", "rps", "pageable"} | ({"sweep"} if args.chunk_sweep else set())
    res: dict[str, object] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                              "command": " ".join(sys.argv), "python": platform.python_version(),
                              "cpu_count": os.cpu_count()}
    try:
        # SHMRPC_COMMIT first: a copied tree (the GPU machine's) may carry a .git of another commit
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        res["commit"] = os.environ.get("SHMRPC_COMMIT") or (out.stdout.strip() if out.returncode == 0 else "unknown")
        res["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    res["ceiling"] = duplex_ceiling()
    if only & {"big", "tiny", "rps"}:
        name = f"gpu-{uuid.uuid4().hex[:6]}"
        w = start(name)
        try:
            if "big" in only:
                res["pinned_256MiB"] = big(name, args.reps)
            if "tiny" in only:
                res["tiny_64B"] = tiny(name, args.tiny)
            if "rps" in only:
                res["rps_gemm_1_client"] = rps(name, 1, args.seconds)
                res["rps_gemm_8_clients"] = rps(name, 8, args.seconds)
        finally:
            stop(w)
    if "tiny" in only:
        res["bare_zmq_64B"] = bare_zmq(args.tiny)
    if "pageable" in only:
        name2 = f"gpu-{uuid.uuid4().hex[:6]}"
        w = start(name2, "--no-register")
        try:
            res["pageable_256MiB"] = big(name2, max(5, args.reps // 4))
        finally:
            stop(w)
    if "sweep" in only and args.chunk_sweep:
        print("\n| pipeline | chunk | streams | 256 MiB in+out | duplex ceiling (just before) | ratio | "
              "client / worker per request | correct |\n|---|---|---|---|---|---|---|---|", flush=True)
        res["chunk_sweep"] = chunk_sweep(args.chunk_sweep.split(","), args.pipelines.split(","), args.chunk_streams,
                                         args.reps)
        res["ceiling_after"] = duplex_ceiling()
    if "graphs" in only:
        print("\n| round | chunk path | 256 MiB in+out | duplex ceiling (just before) | ratio | client / worker per request "
              "| correct |\n|---|---|---|---|---|---|---|", flush=True)
        res["graphs_through_worker"] = graphs_ab(args.reps, args.rounds, list(filter(None, args.graph_chunks.split(","))),
                                                   list(filter(None, args.graph_paths.split(";"))))
    if "gemmab" in only:
        print("\n| round | clients | CUDA graphs | gemm, 8 client processes | worker's own mean per request |\n"
              "|---|---|---|---|---|", flush=True)
        res["gemm_8_clients_graphs"] = gemm_ab(args.seconds, args.rounds, args.gemm_clients.split(","))
    if "copies" in only:
        res["copies_in_process"] = copies((args.chunk_sweep or "16M/1M").split(","), args.pipelines.split(","), args.reps,
                                          args.memories.split(","))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    c = res["ceiling"]
    print("\n| figure | measured | ceiling / baseline | ratio |\n|---|---|---|---|")
    p, u = res.get("pinned_256MiB"), res.get("pageable_256MiB")
    if p:
        print(f"| 256 MiB in+out, pinned | {p['gbps_both_ways']:.1f} GB/s | duplex copy {c['duplex_gbps']:.1f} GB/s | "  # type: ignore[index]
              f"{p['gbps_both_ways'] / c['duplex_gbps']:.2f} |")  # type: ignore[index]
    if p and u:
        print(f"| 256 MiB in+out, not registered | {u['gbps_both_ways']:.1f} GB/s | pinned {p['gbps_both_ways']:.1f} GB/s | "  # type: ignore[index]
              f"{u['gbps_both_ways'] / p['gbps_both_ways']:.2f} |")  # type: ignore[index]
    t, z = res.get("tiny_64B"), res.get("bare_zmq_64B")
    if t and z:
        print(f"| 64 B scale p50 / p99 | {t['p50_us']:.1f} / {t['p99_us']:.1f} us | bare zmq {z['p50_us']:.1f} / "  # type: ignore[index]
              f"{z['p99_us']:.1f} us | +{t['p50_us'] - z['p50_us']:.1f} us |")  # type: ignore[index]
    if "rps_gemm_8_clients" in res:
        print(f"| gemm 16x256x256 fp16 req/s | 8 procs {res['rps_gemm_8_clients']:.0f} | 1 proc {res['rps_gemm_1_client']:.0f} | "
              f"{res['rps_gemm_8_clients'] / res['rps_gemm_1_client']:.2f}x |")  # type: ignore[operator]
    return 0


if __name__ == "__main__":
    sys.exit(main())
