"""A small decoder layer served by a shmrpc worker from resident weights, one token per request.

The layer (D = model width, H heads, F = MLP width)::

    h   = layernorm(x)                        built-in, float32
    qkv = h @ w_qkv                           built-in gemm, float32
    att = kv_attend(qkv, kcache, vcache, pos) users' op (decoder_ops.py): rotary embedding, the session's
                                              KV cache grows by one row in place, softmax attention
    x1  = x + att @ w_o                       built-in gemm and vector_add, float32 (the residual stream)
    h2  = rmsnorm_f16(x1)                     users' op, float32 -> float16
    y   = gemm_w4a16(gelu(gemm_w4a16(h2, up)), down)   built-ins; int4 weights from quantize_int4
    x2  = residual_add(x1, y)                 users' op, float32

Every step of a session is ONE request (a pipeline of ten ops) carrying x (D float32) and pos (one
int32); the weights are shared resident tensors put once; each session's KV cache is a pair of its
own resident tensors of ``--max-tokens`` rows (a slab: allocated once at session start, written one
row per step, freed by the worker when the session's client ends or dies; over ``--resident-limit``
the put fails with ResourceError).

Run (a worker with the ops loaded, then the driver)::

    PYTHONPATH=examples shmrpc serve --name demo --ops decoder_ops &
    PYTHONPATH=examples python examples/decoder_layer.py --worker demo --procs 2 --sessions 2 --tokens 32

or let the driver start its own worker (``--spawn numpy|cupy``). It runs one session alone, then
``--procs`` processes of ``--sessions`` sessions each, checks every step against a NumPy reference
and prints tokens/s and per-step p50/p99; ``--inprocess numpy|cupy`` runs the same layer (one
session) in this process through the backend directly (no RPC: the ceiling), and the difference
of the one-session p50s is the RPC overhead per step; ``--out FILE`` writes everything as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

#: The layer's pipeline: (op, inputs, outputs, attrs); names are request tensors or earlier outputs.
#: Weights are resident tensors named w.<name>; the session's caches are kc and vc.
STEPS: list[tuple[str, dict[str, str], dict[str, str], dict[str, Any]]] = [
    ("layernorm", {"x": "x", "gamma": "w.ln_g", "beta": "w.ln_b"}, {"out": "h"}, {}),
    ("gemm", {"x": "h", "w": "w.qkv"}, {"out": "qkv"}, {}),
    ("kv_attend", {"qkv": "qkv", "kcache": "kc", "vcache": "vc", "pos": "pos"}, {"out": "att"}, {"n_heads": 0}),
    ("gemm", {"x": "att", "w": "w.o"}, {"out": "o"}, {}),
    ("vector_add", {"x": "x", "y": "o"}, {"out": "x1"}, {}),
    ("rmsnorm_f16", {"x": "x1", "g": "w.g2"}, {"out": "h2"}, {}),
    ("gemm_w4a16", {"x": "h2", "qweight": "w.up_q", "scales": "w.up_s", "zeros": "w.up_z"}, {"out": "u"}, {}),
    ("gelu", {"x": "u"}, {"out": "a"}, {}),
    ("gemm_w4a16", {"x": "a", "qweight": "w.dn_q", "scales": "w.dn_s", "zeros": "w.dn_z"}, {"out": "dn"}, {}),
    ("residual_add", {"x": "x1", "y": "dn"}, {"out": "x2"}, {}),
]
WEIGHTS = ("ln_g", "ln_b", "qkv", "o", "g2", "up_q", "up_s", "up_z", "dn_q", "dn_s", "dn_z")


@dataclass
class Config:
    d: int = 256
    heads: int = 4
    f: int = 1024
    max_tokens: int = 64
    tokens: int = 32
    sessions: int = 2
    procs: int = 2
    seed: int = 0


def steps(cfg: Config) -> list[tuple[str, dict[str, str], dict[str, str], dict[str, Any]]]:
    return [(op, i, o, ({"n_heads": cfg.heads} if op == "kv_attend" else a)) for op, i, o, a in STEPS]


def make_weights(cfg: Config) -> dict[str, np.ndarray]:
    """Float weights; the MLP's are float16 (quantized to int4 by the worker's quantize_int4)."""
    rng = np.random.default_rng(cfg.seed)
    d, f = cfg.d, cfg.f
    return {
        "ln_g": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        "ln_b": (0.1 * rng.standard_normal(d)).astype(np.float32),
        "qkv": (rng.standard_normal((d, 3 * d)) / math.sqrt(d)).astype(np.float32),
        "o": (rng.standard_normal((d, d)) / math.sqrt(d)).astype(np.float32),
        "g2": (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32),
        "up": (rng.standard_normal((d, f)) / math.sqrt(d)).astype(np.float16),
        "dn": (rng.standard_normal((f, d)) / math.sqrt(f)).astype(np.float16),
    }


# ------------------------------------------------------------------ the NumPy reference


def _dequant(q: np.ndarray, s: np.ndarray, z: np.ndarray) -> np.ndarray:
    k2, n = q.shape
    w = np.empty((2 * k2, n), np.float32)
    w[0::2], w[1::2] = q & 0xF, q >> 4
    g = s.shape[0]
    w = w.reshape(g, -1, n) - z.astype(np.float32)[:, None, :]
    return (w * s.astype(np.float32)[:, None, :]).reshape(2 * k2, n)


def _rope(t: np.ndarray, pos: int, h: int) -> np.ndarray:
    hd = t.size // h
    half = hd // 2
    x = t.reshape(h, hd).astype(np.float64)
    ang = pos * 10000.0 ** (-np.arange(half) * 2.0 / hd)
    a, b = x[:, :half], x[:, half:]
    return np.concatenate([a * np.cos(ang) - b * np.sin(ang), a * np.sin(ang) + b * np.cos(ang)], axis=1).reshape(-1)


class Reference:
    """The layer in NumPy (float64 but the int4 MLP, dequantized to float32), with its own KV cache: one per session."""

    def __init__(self, cfg: Config, w: dict[str, np.ndarray]) -> None:
        self.cfg, self.w = cfg, w
        self.up = _dequant(w["up_q"], w["up_s"], w["up_z"])  # float32: enough next to float16 activations
        self.dn = _dequant(w["dn_q"], w["dn_s"], w["dn_z"])
        self.k = np.zeros((cfg.max_tokens, cfg.d))
        self.v = np.zeros((cfg.max_tokens, cfg.d))

    def step(self, x: np.ndarray, pos: int) -> np.ndarray:
        cfg, w = self.cfg, self.w
        x = x.astype(np.float64).reshape(-1)
        mu = x.mean()
        h = (x - mu) / np.sqrt(((x - mu) ** 2).mean() + 1e-5) * w["ln_g"] + w["ln_b"]
        qkv = (h.astype(np.float32) @ w["qkv"]).astype(np.float64)  # float32 products: cheap at D = 2048
        d, hh = cfg.d, cfg.heads
        q = _rope(qkv[:d], pos, hh)
        self.k[pos], self.v[pos] = _rope(qkv[d:2 * d], pos, hh), qkv[2 * d:]
        hd = d // hh
        s = np.einsum("hd,thd->ht", q.reshape(hh, hd), self.k[: pos + 1].reshape(-1, hh, hd)) / math.sqrt(hd)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        att = np.einsum("ht,thd->hd", p, self.v[: pos + 1].reshape(-1, hh, hd)).reshape(-1)
        x1 = x + (att.astype(np.float32) @ w["o"])
        h2 = x1 / np.sqrt((x1 * x1).mean() + 1e-6) * w["g2"]
        u = (h2.astype(np.float16).astype(np.float32) @ self.up).astype(np.float64)
        a = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        return (x1 + (a.astype(np.float16).astype(np.float32) @ self.dn)).reshape(1, -1)


def check(got: np.ndarray, want: np.ndarray, what: str) -> float:
    """Largest error relative to the row's scale; raises when over 2e-2 (float16 activations, int4 weights)."""
    err = float(np.max(np.abs(got.astype(np.float64) - want)) / max(1.0, float(np.max(np.abs(want)))))
    if not err <= 2e-2:
        raise AssertionError(f"{what}: off the NumPy reference by {err:.3g} (relative to the row's largest value)")
    return err


# ------------------------------------------------------------------ served by a worker


def put_weights(client: Any, cfg: Config) -> dict[str, np.ndarray]:
    """Quantize the MLP on the worker, put every weight as a shared resident tensor; returns them as put."""
    w = make_weights(cfg)
    out = {k: w[k] for k in ("ln_g", "ln_b", "qkv", "o", "g2")}
    for m in ("up", "dn"):
        q = client.call("quantize_int4", w=w[m], group_size=64)
        out[f"{m}_q"], out[f"{m}_s"], out[f"{m}_z"] = q["qweight"], q["scales"], q["zeros"]
    for k in WEIGHTS:
        client.put(f"w.{k}", out[k], shared=True)
    return out


def _session_proc(args: tuple[str, Config, int, dict[str, np.ndarray]]) -> dict[str, Any]:
    """One process: ``cfg.sessions`` sessions (a Client each, its own KV cache), stepped in turn."""
    from shmrpc.client import Client, Pipeline, Resident

    name, cfg, proc, weights = args
    pipe = Pipeline(outputs=("x2",))
    for op, i, o, a in steps(cfg):
        pipe = pipe.then(op, inputs=i, outputs=o, **a)
    rng = np.random.default_rng(cfg.seed + 1 + proc)
    clients = [Client(name, timeout_s=60) for _ in range(cfg.sessions)]
    lat: list[float] = []
    worst = 0.0
    try:
        for c in clients:
            c.put("kc", np.zeros((cfg.max_tokens, cfg.d), np.float32))
            c.put("vc", np.zeros((cfg.max_tokens, cfg.d), np.float32))
        res = {f"w.{k}": Resident(f"shared/w.{k}") for k in WEIGHTS}
        res.update(kc=Resident("kc"), vc=Resident("vc"))
        xs = [rng.standard_normal((1, cfg.d)).astype(np.float32) for _ in clients]
        seen: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in clients]
        start = time.time()
        for t in range(cfg.tokens):
            for s, c in enumerate(clients):
                pos = np.array([t], np.int32)
                t0 = time.perf_counter()
                x2 = c.call(pipe, x=xs[s], pos=pos, **res)["x2"]
                lat.append(time.perf_counter() - t0)
                seen[s].append((xs[s], x2))
                xs[s] = next_input(x2)
        end = time.time()
    finally:
        for c in clients:
            c.close()
    for s, steps_seen in enumerate(seen):  # every step against the reference, after the timed run
        ref = Reference(cfg, weights)
        for t, (x, x2) in enumerate(steps_seen):
            worst = max(worst, check(x2, ref.step(x, t), f"process {proc} session {s} token {t}"))
    return {"latency_s": lat, "max_rel_err": worst, "start": start, "end": end}


def next_input(x2: np.ndarray) -> np.ndarray:
    """The next token's input: this step's output, scaled into [-1, 1]."""
    return (x2 / max(1.0, float(np.abs(x2).max()))).astype(np.float32)


def run_served(name: str, cfg: Config) -> dict[str, Any]:
    """Weights put once, then ``cfg.procs`` processes of ``cfg.sessions`` sessions; figures of every step."""
    from shmrpc.client import Client

    with Client(name, timeout_s=60) as owner:  # owns the shared weights: it stays until the sessions end
        weights = put_weights(owner, cfg)
        with mp.get_context("spawn").Pool(cfg.procs) as pool:
            parts = pool.map(_session_proc, [(name, cfg, p, weights) for p in range(cfg.procs)])
        wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)  # stepping only, not process start
    lat = np.array([x for p in parts for x in p["latency_s"]])
    return _figures(lat, wall, max(p["max_rel_err"] for p in parts))


def _figures(lat: np.ndarray, wall_s: float, err: float) -> dict[str, Any]:
    return {"steps": int(lat.size), "tokens_per_s": round(lat.size / wall_s, 1),
            "step_p50_us": round(float(np.percentile(lat, 50)) * 1e6, 1),
            "step_p99_us": round(float(np.percentile(lat, 99)) * 1e6, 1), "max_rel_err": err}


# ------------------------------------------------------------------ in process, no RPC (the ceiling)


def run_inprocess(backend: str, cfg: Config) -> dict[str, Any]:
    """The same pipeline through ``select_backend(backend)`` in this process: host x in, host x2 out, no RPC."""
    sys.path.insert(0, HERE)
    import decoder_ops  # noqa: F401  (registers the users' ops here)

    from shmrpc.kernels import StepSpec, TensorSpec, select_backend

    be = select_backend(backend)
    w = make_weights(cfg)
    weights = {k: w[k] for k in ("ln_g", "ln_b", "qkv", "o", "g2")}
    for m in ("up", "dn"):
        plan = be.plan([StepSpec("quantize_int4", {"w": "w"}, {"qweight": "q", "scales": "s", "zeros": "z"},
                                 {"group_size": 64})], {"w": TensorSpec(w[m].shape, "float16")}, ["q", "s", "z"])
        outs = {n: np.empty(s.shape, s.dtype) for n, s in plan.outputs.items()}
        be.run(plan, {"w": w[m]}, outs)
        weights[f"{m}_q"], weights[f"{m}_s"], weights[f"{m}_z"] = outs["q"], outs["s"], outs["z"]
    for k, a in weights.items():
        be.put(f"w.{k}", a, str(a.dtype))
    sessions = cfg.sessions * cfg.procs
    for s in range(sessions):
        be.put(f"{s}/kc", np.zeros((cfg.max_tokens, cfg.d), np.float32), "float32")
        be.put(f"{s}/vc", np.zeros((cfg.max_tokens, cfg.d), np.float32), "float32")
    specs = {f"w.{k}": TensorSpec(a.shape, str(a.dtype)) for k, a in weights.items()}
    specs.update(x=TensorSpec((1, cfg.d), "float32"), pos=TensorSpec((1,), "int32"),
                 kc=TensorSpec((cfg.max_tokens, cfg.d), "float32"), vc=TensorSpec((cfg.max_tokens, cfg.d), "float32"))
    sts = [StepSpec(op, i, o, a) for op, i, o, a in steps(cfg)]
    plans = [be.plan(sts, specs, ["x2"], resident={**{f"w.{k}": f"w.{k}" for k in weights},
                                                     "kc": f"{s}/kc", "vc": f"{s}/vc"}) for s in range(sessions)]
    rng = np.random.default_rng(cfg.seed + 1)
    xs = [rng.standard_normal((1, cfg.d)).astype(np.float32) for _ in range(sessions)]
    seen: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(sessions)]
    lat, worst = [], 0.0
    t_start = time.perf_counter()
    for t in range(cfg.tokens):
        for s in range(sessions):
            out = np.empty((1, cfg.d), np.float32)
            t0 = time.perf_counter()
            be.run(plans[s], {"x": xs[s], "pos": np.array([t], np.int32)}, {"x2": out})
            lat.append(time.perf_counter() - t0)
            seen[s].append((xs[s], out))
            xs[s] = next_input(out)
    wall = time.perf_counter() - t_start
    be.close()
    for s, steps_seen in enumerate(seen):
        ref = Reference(cfg, weights)
        for t, (x, x2) in enumerate(steps_seen):
            worst = max(worst, check(x2, ref.step(x, t), f"in-process session {s} token {t}"))
    return _figures(np.array(lat), wall, worst)


# ------------------------------------------------------------------ the command


def _spawn_worker(backend: str, name: str) -> subprocess.Popen:  # type: ignore[type-arg]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (HERE, os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--backend", backend,
                             "--ops", "decoder_ops", "--no-mlock", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, env=env, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if "ready" not in line:
        proc.kill()
        raise SystemExit(f"the worker did not start: {line!r}")
    return proc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", help="the worker's name (started with --ops decoder_ops)")
    p.add_argument("--spawn", choices=("numpy", "cupy"), help="start a worker of this backend for the run")
    p.add_argument("--inprocess", choices=("numpy", "cupy"), help="also run the layer in process (no RPC)")
    for k, v in asdict(Config()).items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args(argv)
    # the MLP's int4 weights are grouped by 64 along D and F (quantize_int4), and D splits into the heads
    for flag, v in (("--d", a.d), ("--f", a.f)):
        if v <= 0 or v % 64:
            p.error(f"{flag} must be a positive multiple of 64 (the int4 weights' group size), got {v}")
    if a.heads <= 0 or a.d % a.heads:
        p.error(f"--heads must divide --d ({a.d}), got {a.heads}")
    for flag, v in (("--tokens", a.tokens), ("--max-tokens", a.max_tokens), ("--sessions", a.sessions),
                    ("--procs", a.procs)):
        if v <= 0:
            p.error(f"{flag} must be positive, got {v}")
    if a.tokens > a.max_tokens:
        p.error(f"--tokens ({a.tokens}) must be at most --max-tokens ({a.max_tokens})")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # `timeout`: stop the spawned worker on the way out
    cfg = Config(**{k: getattr(a, k) for k in asdict(Config())})
    result: dict[str, Any] = {"config": asdict(cfg), "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]])}
    proc = None
    name = a.worker or f"decoder-{os.getpid()}"
    try:
        if a.spawn:
            proc = _spawn_worker(a.spawn, name)
            result["worker_backend"] = a.spawn
        if a.worker or a.spawn:
            # one session alone first: its per-step time next to the in-process one is the RPC overhead
            result["served_one_session"] = run_served(name, replace(cfg, procs=1, sessions=1))
            print(f"served, 1 session:  {_line(result['served_one_session'])}")
            result["served"] = run_served(name, cfg)
            print(f"served, {cfg.procs} x {cfg.sessions}:   {_line(result['served'])}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if a.inprocess:
        result["inprocess"] = run_inprocess(a.inprocess, replace(cfg, procs=1, sessions=1))
        result["inprocess_backend"] = a.inprocess
        print(f"in process, 1 session: {_line(result['inprocess'])}")
    if "served" in result and "inprocess" in result:
        one, inp = result["served_one_session"], result["inprocess"]
        result["rpc_overhead_p50_us"] = round(one["step_p50_us"] - inp["step_p50_us"], 1)
        result["rpc_overhead_p99_us"] = round(one["step_p99_us"] - inp["step_p99_us"], 1)
        print(f"RPC overhead per step, one session: p50 {result['rpc_overhead_p50_us']} us, "
              f"p99 {result['rpc_overhead_p99_us']} us")
    if a.out:
        result.update(date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), commit=os.environ.get("SHMRPC_COMMIT", _commit()),
                      machine={"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                               "load_average_1m_at_end": round(os.getloadavg()[0], 2)})
        with open(a.out, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


def _line(r: dict[str, Any]) -> str:
    return (f"{r['steps']} steps, {r['tokens_per_s']} tokens/s, step p50 {r['step_p50_us']} us, "
            f"p99 {r['step_p99_us']} us, max error {r['max_rel_err']:.2g}")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
