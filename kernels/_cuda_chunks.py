"""Large elementwise requests in chunks, so copies in, kernels and copies out overlap.

Settings, read once at import from the environment (the worker's, before it starts)::

    SHMRPC_CHUNK_BYTES            bytes of the widest tensor per chunk        (default 8M)
    SHMRPC_CHUNK_MIN_BYTES        first and last chunks, doubling up to       (default: no ramp)
                                  SHMRPC_CHUNK_BYTES
    SHMRPC_CHUNK_PIPELINE         "stages" or "streams"                       (default "stages")
    SHMRPC_CHUNK_STREAMS          streams of the "streams" pipeline (>= 1)     (default 4)
    SHMRPC_CHUNK_THRESHOLD_BYTES  chunk requests moving more than this        (default 32M)

Sizes take a K/M/G suffix (powers of 1024). The defaults are the best of the sweeps recorded
in ``bench/results/gpu-copies-2026-11-30-59425a9.json`` and ``gpu-chunks-2026-11-30-045ac74.json``
(256 MiB in + 256 MiB out, in process: "stages" 8M reached 0.91-0.93 of the duplex copy on the
same memory; 2M 0.83-0.86 (Python issue per chunk), 32M 0.83-0.88 (pipeline fill and drain);
"streams" at most 0.89; a ramp from 1M (e.g. 1M, 2M, 4M, then 8M chunks, then 4M, 2M, 1M,
:func:`chunk_ranges`) measured no better: 0.89 at 8M, 0.85 at 16M). Two pipelines::

    streams   chunk i on stream i % N: H2D(i), kernels(i), D2H(i) in that stream's order; the
              H2D of chunk i+N waits behind the D2H of chunk i on the same stream
    stages    one stream per stage: H2D(i) on s_in; s_k waits for it (event), kernels(i);
              s_out waits for those (event), D2H(i). Copies in never wait for copies out.

Chunk arrays stay referenced until the run's final synchronize (the pool gives freed blocks
back to the stream that allocated them, which in "stages" is not the stream still reading).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ._errors import OpError
from ._plan import Plan
from ._registry import TensorSpec

__all__ = ["CHUNK_BYTES", "CHUNK_MIN_BYTES", "CHUNK_STREAMS", "CHUNK_PIPELINE", "CHUNK_THRESHOLD_BYTES", "chunk_ranges",
           "parse_bytes", "run_chunked"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str, name: str = "size") -> int:
    """``"16M"`` -> 16777216 (suffix K/M/G, powers of 1024; plain digits are bytes); raises ValueError naming ``name``."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in ("K", "M", "G") else ""
    try:
        n = int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a size; write e.g. 4194304, 4M or 512K") from None
    if n <= 0:
        raise ValueError(f"{name}={text!r} must be > 0")
    return n


def _env_int(name: str, default: int, size: bool = False) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if size:
        return parse_bytes(raw, name)
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"{name}={raw!r} must be >= 1")
    return n


CHUNK_BYTES = _env_int("SHMRPC_CHUNK_BYTES", 8 << 20, size=True)
CHUNK_MIN_BYTES = _env_int("SHMRPC_CHUNK_MIN_BYTES", CHUNK_BYTES, size=True)
CHUNK_STREAMS = _env_int("SHMRPC_CHUNK_STREAMS", 4)
CHUNK_THRESHOLD_BYTES = _env_int("SHMRPC_CHUNK_THRESHOLD_BYTES", 32 << 20, size=True)
CHUNK_PIPELINE = os.environ.get("SHMRPC_CHUNK_PIPELINE", "") or "stages"
if CHUNK_PIPELINE not in ("streams", "stages"):
    raise ValueError(f"SHMRPC_CHUNK_PIPELINE={CHUNK_PIPELINE!r}: use 'streams' or 'stages'")

Step = Callable[[Any, dict[str, Any], Mapping[str, TensorSpec], Mapping[str, TensorSpec]], dict[str, Any]]


def chunk_ranges(n: int, chunk: int, first: int) -> list[tuple[int, int]]:
    """[start, stop) ranges covering ``range(n)``: ``first``, 2*``first``, ... below ``chunk``, then
    chunks of about ``chunk``, then the ramp mirrored; no ramp where it would not fit twice."""
    chunk, first = max(1, chunk), max(1, min(first, chunk))
    ramp = []
    c = first
    while c < chunk:
        ramp.append(c)
        c *= 2
    if 2 * sum(ramp) >= n:
        ramp = []
    middle = n - 2 * sum(ramp)
    k = max(1, -(-middle // chunk))
    sizes = [*ramp, *(middle // k + (1 if i < middle % k else 0) for i in range(k)), *reversed(ramp)]
    out, a = [], 0
    for sz in sizes:
        if sz:
            out.append((a, a + sz))
            a += sz
    return out


def _copy(cp: Any, dst: int, src: int, nbytes: int, kind: int, stream: Any) -> None:
    if nbytes:
        cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, stream.ptr)


def run_chunked(cp: Any, streams: list[Any], plan: Plan, host_in: Mapping[str, np.ndarray],
                host_out: Mapping[str, np.ndarray], resident: Mapping[str, Any], step: Step,
                chunk_bytes: int = 0, n_streams: int = 0, pipeline: str = "", first_bytes: int = 0,
                capture: bool = False, hold: list[Any] | None = None) -> dict[str, float]:
    """Run an elementwise ``plan`` over contiguous views in chunks; returns stage seconds.

    ``streams``: at least max(3, n_streams) streams owned by this run; ``step(st, ins, in_specs,
    out_specs)`` runs one step on the current stream. Stage figures: "streams" sums per-chunk
    spans; "stages" gives each stage's span from its first to its last chunk (they overlap).
    Returns also "chunks". Errors propagate after every stream has drained.

    ``capture``: ``streams[0]`` is capturing a graph; the run only enqueues (no synchronize, no
    timing): the other streams first wait on an event of ``streams[0]`` (so the capture takes
    them in) and ``streams[0]`` waits on each of them at the end (so it joins them); the device
    arrays of every chunk are appended to ``hold`` (the graph must keep them). Returns "chunks".
    """
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    first_bytes = first_bytes or CHUNK_MIN_BYTES
    n_streams = n_streams or CHUNK_STREAMS
    pipeline = pipeline or CHUNK_PIPELINE
    n = next(iter(plan.tensors.values())).size
    widest = max(np.dtype(a.dtype).itemsize for a in [*host_in.values(), *host_out.values(), *resident.values()])
    chunk = max(1, chunk_bytes // widest)
    flat_in = {k: v.reshape(-1) for k, v in host_in.items()}
    flat_out = {k: v.reshape(-1) for k, v in host_out.items()}
    flat_res = {k: v.reshape(-1) for k, v in resident.items()}
    h2d, d2h = cp.cuda.runtime.memcpyHostToDevice, cp.cuda.runtime.memcpyDeviceToHost
    hold = [] if hold is None else hold

    def chunk_steps(start: int, stop: int, env: dict[str, Any]) -> None:
        env.update({k: v[start:stop] for k, v in flat_res.items()})
        for st in plan.steps:
            in_specs = {p: TensorSpec((stop - start,), sp.dtype) for p, sp in st.in_specs.items()}
            out_specs = {p: TensorSpec((stop - start,), sp.dtype) for p, sp in st.out_specs.items()}
            res = step(st, {p: env[k] for p, k in st.inputs.items()}, in_specs, out_specs)
            for p, k in st.outputs.items():
                env[k] = res[p]

    def h2d_chunk(start: int, stop: int, s: Any) -> dict[str, Any]:
        env: dict[str, Any] = {}
        for k, v in flat_in.items():
            d = cp.empty(stop - start, dtype=v.dtype)
            _copy(cp, d.data.ptr, v[start:].ctypes.data, d.nbytes, h2d, s)
            env[k] = d
        return env

    def d2h_chunk(start: int, stop: int, env: dict[str, Any], s: Any) -> None:
        for k, h in flat_out.items():
            d = cp.ascontiguousarray(env[k])
            env["#d2h." + k] = d
            _copy(cp, h[start:].ctypes.data, d.data.ptr, d.nbytes, d2h, s)

    ranges = chunk_ranges(n, chunk, max(1, first_bytes // widest))
    used = streams[: max(3, n_streams)] if pipeline == "stages" else streams[:n_streams]
    if capture:
        fork = used[0].record()
        for s in used[1:]:
            s.wait_event(fork)
    try:
        if pipeline == "stages":
            s_in, s_k, s_out = used[0], used[1], used[2]
            t0 = s_in.record()
            e_in: list[Any] = []
            e_k: list[Any] = []
            for start, stop in ranges:
                with s_in:
                    env = h2d_chunk(start, stop, s_in)
                e_in.append(s_in.record())
                s_k.wait_event(e_in[-1])
                with s_k:
                    chunk_steps(start, stop, env)
                e_k.append(s_k.record())
                s_out.wait_event(e_k[-1])
                with s_out:
                    d2h_chunk(start, stop, env, s_out)
                hold.append(env)
            if capture:
                return _join(used, len(ranges))
            t_end = s_out.record()
            t_end.synchronize()
            for s in used:
                s.synchronize()
            el = cp.cuda.get_elapsed_time
            times = {"h2d": el(t0, e_in[-1]) / 1e3, "kernel": el(e_in[0], e_k[-1]) / 1e3, "d2h": el(e_k[0], t_end) / 1e3}
        else:
            marks = []
            for ci, (start, stop) in enumerate(ranges):
                s = used[ci % len(used)]
                with s:
                    ev = [s.record()]
                    env = h2d_chunk(start, stop, s)
                    ev.append(s.record())
                    chunk_steps(start, stop, env)
                    ev.append(s.record())
                    d2h_chunk(start, stop, env, s)
                    ev.append(s.record())
                marks.append(ev)  # env's blocks go back to stream s's pool: stream order keeps their reuse safe
                if capture:
                    hold.append(env)
            if capture:
                return _join(used, len(ranges))
            for s in used:
                s.synchronize()
            tot = [0.0, 0.0, 0.0]
            for ev in marks:
                for i in range(3):
                    tot[i] += cp.cuda.get_elapsed_time(ev[i], ev[i + 1]) / 1e3
            times = {"h2d": tot[0], "kernel": tot[1], "d2h": tot[2]}
    except OpError:
        if not capture:  # a capturing stream may not be synchronized: the caller ends the capture
            for s in used:
                s.synchronize()
        raise
    times["chunks"] = float(len(ranges))
    return times


def _join(used: list[Any], n_chunks: int) -> dict[str, float]:
    """The end of a captured run: ``used[0]`` waits on every other stream (a capture must join them)."""
    for s in used[1:]:
        used[0].wait_event(s.record())
    return {"chunks": float(n_chunks)}
