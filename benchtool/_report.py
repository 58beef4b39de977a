"""What a run prints and records: machine facts, the tables, the goal verdicts, the JSON file."""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ._stats import size_label

__all__ = ["machine_facts", "latency_table", "bandwidth_table", "scaling_table", "verdicts", "verdict_lines",
           "write_json", "default_out_path", "finish_document", "now_iso"]

_PACKAGES = ("shmrpc", "numpy", "pyzmq", "grpcio", "iceoryx2", "ucxx-cu12", "cupy", "cupy-cuda12x", "cupy-cuda13x",
             "matplotlib")
_PEER_KEYS = ("zmq", "pipe", "grpc", "iox2", "iox2-spin", "ucx")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _run(argv: list[str], timeout_s: float = 5.0) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_facts() -> dict[str, Any]:
    """CPU model, cores, memory, OS, Python, package versions, GPU names (nvidia-smi), git commit."""
    versions = {}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            continue
    gpus = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    repo = Path(__file__).resolve().parents[1]  # benchtool/ sits at the top of the checkout
    # SHMRPC_COMMIT first: a copy of the tree (the GPU machine's) has no .git, or one of another commit.
    commit = os.environ.get("SHMRPC_COMMIT") or _run(["git", "-C", str(repo), "rev-parse", "HEAD"])
    dirty = _run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
    mem_kib = 0
    try:
        with open("/proc/meminfo") as f:
            mem_kib = int(f.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_gib": round(mem_kib / (1 << 20), 1),
        "os": platform.platform(),
        "python": sys.version.split()[0],
        "packages": versions,
        "gpus": gpus.splitlines() if gpus else [],
        "loadavg": list(os.getloadavg()),  # other work on the machine when the run started (1, 5, 15 minutes)
        "git_commit": commit,
        "git_dirty": bool(dirty),
    }


def now_iso() -> str:
    """The local time now, ISO 8601 with its UTC offset, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def finish_document(doc: dict[str, Any], argv: list[str], machine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Add the date (the run's start if set), the exact command line, the machine facts (``machine``: those taken at
    the run's start, whose ``loadavg`` is the other work's, not the run's own) and the verdicts to a run's document."""
    doc.setdefault("date", now_iso())
    doc["command"] = shlex.join(argv)
    doc["machine"] = machine if machine is not None else machine_facts()
    doc["verdicts"] = verdicts(doc)
    return doc


def write_probe(doc: dict[str, Any], argv: list[str] | None, path: str | os.PathLike[str]) -> Path:
    """A probe's document (no goals to judge): :func:`finish_document` without the verdicts, written to ``path``
    (``argv``: the command as run, the program's path relative to the checkout; None: this process's own command
    line, its program's path made relative to the working directory); prints where and returns it."""
    if argv is None:
        argv = [os.path.relpath(sys.argv[0]), *sys.argv[1:]]
    doc = finish_document(doc, argv)
    doc.pop("verdicts", None)
    out = write_json(doc, path)
    print(f"JSON: {out}")
    return out


def default_out_path(mode: str, root: str | os.PathLike[str] = "bench/out") -> Path:
    """``bench/out/<mode>-<YYYYmmdd-HHMMSS>.json``."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(root) / f"{mode}-{stamp}.json"


def write_json(doc: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``doc`` as indented JSON, creating the parent folders; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return out


# --------------------------------------------------------------------- tables


def size_width(sizes: Iterable[int]) -> int:
    """Width of a table's size column: 6, or the longest label (``1048577B`` is 8)."""
    return max([6, *(len(size_label(n)) for n in sizes)])


def _points(doc: dict[str, Any], kind: str) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["transport"], r["nbytes"]): r.get(kind, r) for r in doc["results"]}


def _keys(doc: dict[str, Any]) -> list[str]:
    return [k for k, v in doc["transports"].items() if v["status"] == "ok"]


def spin_note(doc: dict[str, Any]) -> str:
    """``", shmrpc spinning N µs"`` when the run's worker and clients spun (``--spin-us``), else empty."""
    spin = doc["config"].get("spin_us", 0)
    return f", shmrpc spinning {spin} µs" if spin else ""


def shapes_note(doc: dict[str, Any]) -> str:
    """``", request x=16x256, w=256x256 float16"`` when the run sent shaped tensors (``--shape``), else empty."""
    shapes = doc["config"].get("shapes") or {}
    if not shapes:
        return ""
    return ", request " + ", ".join(f"{n}={'x'.join(map(str, s))}" for n, s in shapes.items()) + \
        f" {doc['config'].get('dtype', '')}"


def _rows(doc: dict[str, Any], kind: str, lines: list[str]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(size, label, point) in table order; a failed point gets its error line in ``lines`` instead."""
    pts = _points(doc, kind)
    w = size_width(doc["config"]["sizes"])
    for n in doc["config"]["sizes"]:
        for key in _keys(doc):
            p = pts.get((key, n))
            if p is None:
                continue
            label = doc["transports"][key]["label"]
            if "error" in p:
                lines.append(f"{size_label(n):>{w}}  {label:<30} error: {p['error']}")
                continue
            yield n, label, p


def latency_table(doc: dict[str, Any]) -> str:
    """Round-trip latency in µs: one row per (size, transport), with each p50 over shmrpc's at that size."""
    base = {n: p["p50_us"] for (key, n), p in _points(doc, "latency").items() if key == "shmrpc" and "p50_us" in p}
    w = size_width(doc["config"]["sizes"])
    head = f"{'size':>{w}}  {'transport':<30} {'iters':>6} {'min':>9} {'p50':>9} {'p90':>9} {'p99':>9} " \
           f"{'p99.9':>9} {'max':>9} {'mean':>9} {'stdev':>8} {'p50/shm':>8}"
    lines = [f"round trip latency (µs){spin_note(doc)}{shapes_note(doc)}", head, "-" * len(head)]
    for n, label, p in _rows(doc, "latency", lines):
        ratio = f"{p['p50_us'] / base[n]:8.2f}" if base.get(n) else f"{'':>8}"
        lines.append(f"{size_label(n):>{w}}  {label:<30} {p['iterations']:6d} {p['t_min_us']:9.1f} "
                     f"{p['p50_us']:9.1f} {p['p90_us']:9.1f} {p['p99_us']:9.1f} {p['p999_us']:9.1f} "
                     f"{p['max_us']:9.1f} {p['mean_us']:9.1f} {p['stdev_us']:8.1f} {ratio}")
    return "\n".join(lines)


def bandwidth_table(doc: dict[str, Any]) -> str:
    """Throughput with a window in flight: messages/s and GB/s one direction and both."""
    w = size_width(doc["config"]["sizes"])
    head = f"{'size':>{w}}  {'transport':<30} {'window':>6} {'msgs':>6} {'msg/s':>10} {'GB/s 1-dir':>10} {'GB/s both':>10}"
    lines = [f"bandwidth (GB = 1e9 B; 1-dir counts the payload once per round trip, both counts it twice){spin_note(doc)}",
             head, "-" * len(head)]
    unmoved = False
    for n, label, p in _rows(doc, "bandwidth", lines):
        if p["one_dir_gbps"] is None:  # a loan re-sent to an aliasing op (echo): no payload byte moved
            unmoved = True
            gbps = f"{'-':>10} {'-':>10}"
        else:
            gbps = f"{p['one_dir_gbps']:10.3f} {p['both_dir_gbps']:10.3f}"
        lines.append(f"{size_label(n):>{w}}  {label:<30} {p['window']:6d} {p['messages']:6d} {p['msgs_per_s']:10.0f} "
                     f"{gbps}")
    if unmoved:
        lines.append(f"- : the zero-copy loan re-sends data written once into its slot, and {doc['config']['op']} "
                     f"answers with its input: no payload byte moves, so no GB/s (an op that computes, e.g. "
                     f"--op scale, moves its bytes)")
    return "\n".join(lines)


def scaling_table(doc: dict[str, Any]) -> str:
    """Several client processes against one server: aggregate calls/s and each client's p99."""
    if not doc.get("scaling"):
        return ""
    w = size_width(p["nbytes"] for p in doc["scaling"])
    head = (f"{'transport':<30} {'clients':>7} {'size':>{w}} {'requests/s':>10} {'p50':>9} {'p99 worst client':>17}"
            f" {'batch':>6}")
    lines = [f"scaling with client processes (latency loop in each; requests/s of all together; µs; batch: the "
             f"worker's mean requests per batched run)"
             f"{spin_note(doc)}{shapes_note(doc)}", head, "-" * len(head)]
    for p in doc["scaling"]:
        label = doc["transports"].get(p["transport"], {}).get("label", p["transport"])
        if "error" in p:
            lines.append(f"{label:<30} {p['clients']:7d} {size_label(p['nbytes']):>{w}} error: {p['error']}")
            continue
        batch = f"{p['worker']['mean_batch']:6.2f}" if p.get("worker", {}).get("batches") else f"{'-':>6}"
        short = p.get("span_s", 1.0) < SHORT_SPAN_S
        lines.append(f"{label:<30} {p['clients']:7d} {size_label(p['nbytes']):>{w}} {p['calls_per_s']:10.0f} "
                     f"{p['p50_us']:9.1f} {max(p['per_client_p99_us']):17.1f} {batch}" + (" *" if short else ""))
    if any(p.get("span_s", 1.0) < SHORT_SPAN_S for p in doc["scaling"]):
        lines.append(f"* measured over less than {SHORT_SPAN_S * 1000:.0f} ms (span_s in the JSON): shorter than a "
                     f"scheduler's time slice, the clients may have run one after another; raise --iters")
    return "\n".join(lines)


#: A client sweep's point measured over less than this (seconds) is marked in the table: its clients may not have
#: run at the same time.
SHORT_SPAN_S = 0.05


# --------------------------------------------------------------------- verdicts


#: Fewest round trips behind a p50 that a verdict may rest on (``--iters 1`` gives no verdict).
MIN_VERDICT_SAMPLES = 100


def spelled(nbytes: int) -> str:
    """A size as the goals spell it: ``64 B``, ``4 KiB``, ``1 MiB``, ``1048577 B`` (the tables' ``64B`` / ``1M``
    made the verdict lines spell one size two ways)."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _verdict(goal: str, ok: bool | None, detail: str, **figures: Any) -> dict[str, Any]:
    return {"goal": goal, "status": "N/A" if ok is None else ("PASS" if ok else "MISS"), "detail": detail, **figures}


def verdicts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals this run has figures for: :func:`latency_verdicts`, then :func:`scaling_verdicts`."""
    return latency_verdicts(doc) + scaling_verdicts(doc)


#: Issue #12: small same-shape requests from this many client processes together ...
SWEEP_CLIENTS = 8
#: ... reach at least this many requests/s in total.
SWEEP_REQUESTS_PER_S = 40_000


def scaling_verdicts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """With a client sweep: 8 client processes of the smallest request together reach 40 000 requests/s on the
    best shmrpc path (``N/A`` without an 8-client shmrpc point)."""
    pts = [p for p in doc.get("scaling") or [] if "calls_per_s" in p]
    if doc["mode"] != "lat" or not pts:
        return []
    n = min(p["nbytes"] for p in pts)
    goal = f"{SWEEP_CLIENTS} client processes >= {SWEEP_REQUESTS_PER_S} requests/s in total ({spelled(n)} requests)"
    shm = [p for p in pts if p["transport"].startswith("shmrpc") and p["clients"] == SWEEP_CLIENTS and p["nbytes"] == n]
    if not shm:
        return [_verdict(goal, None, f"needs a shmrpc point with {SWEEP_CLIENTS} clients")]
    best = max(shm, key=lambda p: p["calls_per_s"])
    return [_verdict(goal, best["calls_per_s"] >= SWEEP_REQUESTS_PER_S,
                     f"best {best['transport']} {best['calls_per_s']:.0f} requests/s",
                     requests_per_s=best["calls_per_s"])]


class _P50(dict):  # type: ignore[type-arg]
    """(transport, size) -> p50 µs of the points with enough samples for a verdict; ``few``: the others' counts."""

    def __init__(self, points: dict[tuple[str, int], dict[str, Any]]) -> None:
        super().__init__((k, v["p50_us"]) for k, v in points.items() if v.get("iterations", 0) >= MIN_VERDICT_SAMPLES)
        self.few = {k: int(v.get("iterations", 0)) for k, v in points.items() if k not in self}

    def need(self, keys: Iterable[tuple[str, int]], otherwise: str) -> str:
        """Why a goal over ``keys`` has no verdict: the points among them with too few samples, else ``otherwise``."""
        few = [f"{t} at {spelled(n)}: {self.few[(t, n)]}" for t, n in keys if (t, n) in self.few]
        if few:
            return (f"too few samples for a verdict ({', '.join(few)} round trips; at least {MIN_VERDICT_SAMPLES} "
                    f"needed: raise --iters, or --bytes-budget for the large sizes)")
        return otherwise


def latency_verdicts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The three latency goals of `shmrpc bench`, judged from this run's latency p50s (``N/A`` where a figure is missing).

    1. 64 B round trip p50 within 1.2x the zmq peer's.
    2. From 1 MiB up, shmrpc's p50 at least 10x shorter than every peer's.
    3. 64 MiB round trip p50 within 2x shmrpc's own 64 B.

    Each goal rests on its own points: a p50 from fewer than :data:`MIN_VERDICT_SAMPLES` round trips is not used,
    and a goal that needs it is ``N/A``, saying so (a large size cut to a few round trips by ``--bytes-budget``
    leaves the 64 B goal judged).
    """
    if doc["mode"] != "lat":
        return []
    points = {k: v for k, v in _points(doc, "latency").items() if "p50_us" in v}
    p50 = _P50(points)
    shm = "shmrpc" if any(k == "shmrpc" for k, _ in points) else "shmrpc-call"
    out = []
    a, b = p50.get((shm, 64)), p50.get(("zmq", 64))
    goal = "64 B round trip p50 <= 1.2x zmq's"
    if a is None or b is None:
        out.append(_verdict(goal, None, p50.need([(shm, 64), ("zmq", 64)], "needs shmrpc and the zmq peer at 64 B")))
    else:
        out.append(_verdict(goal, a <= 1.2 * b, f"{shm} {a:.1f} µs vs zmq {b:.1f} µs = {a / b:.2f}x", ratio=a / b))
    goal = "from 1 MiB up, p50 >= 10x shorter than every peer's"
    worst: tuple[float, int, str] | None = None
    for (key, n), v in p50.items():
        if key in _PEER_KEYS and n >= 1 << 20 and (shm, n) in p50:
            ratio = v / p50[(shm, n)]
            if worst is None or ratio < worst[0]:
                worst = (ratio, n, key)
    large = [(k, n) for k, n in points if n >= 1 << 20 and (k == shm or k in _PEER_KEYS)]
    if worst is None:
        out.append(_verdict(goal, None, p50.need(large, "needs shmrpc and a peer at 1 MiB or more")))
    else:
        ratio, n, key = worst
        skipped = p50.need(large, "")
        out.append(_verdict(goal, ratio >= 10, f"smallest advantage {ratio:.1f}x ({key} at {spelled(n)}: "
                            f"{p50[(key, n)]:.1f} µs vs {p50[(shm, n)]:.1f} µs)"
                            + (f"; not judged: {skipped}" if skipped else ""), ratio=ratio))
    a, b = p50.get((shm, 64 << 20)), p50.get((shm, 64))
    goal = "64 MiB round trip p50 <= 2x shmrpc's 64 B"
    if a is None or b is None:
        out.append(_verdict(goal, None, p50.need([(shm, 64 << 20), (shm, 64)], "needs shmrpc at 64 B and 64 MiB")))
    else:
        out.append(_verdict(goal, a <= 2 * b, f"{a:.1f} µs vs {b:.1f} µs = {a / b:.2f}x", ratio=a / b))
    if any(k in _SMALL_KEYS for k, _ in points) or doc.get("connect"):
        out += small_verdicts(doc, p50)
    return out


_SMALL_KEYS = ("shmrpc-lane", "shmrpc-lane-spin", "shmrpc-call-lane", "iox2", "iox2-spin")


def _ratio_verdict(goal: str, p50: dict[tuple[str, int], float], a: tuple[str, int], b: tuple[str, int],
                   limit: float) -> dict[str, Any]:
    x, y = p50.get(a), p50.get(b)
    if x is None or y is None:
        return _verdict(goal, None, _need(p50, [a, b], f"needs {a[0]} and {b[0]} at {spelled(a[1])}"))
    return _verdict(goal, x <= limit * y, f"{a[0]} {x:.1f} µs vs {b[0]} {y:.1f} µs = {x / y:.2f}x", ratio=x / y)


def _need(p50: dict[tuple[str, int], float], keys: list[tuple[str, int]], otherwise: str) -> str:
    return p50.need(keys, otherwise) if isinstance(p50, _P50) else otherwise


def small_verdicts(doc: dict[str, Any], p50: dict[tuple[str, int], float]) -> list[dict[str, Any]]:
    """The small-request goals, judged where this run has the figures (a run with lanes, iceoryx2 or --connect-iters).

    64 B loan within 1.0x zmq; call() within 1.3x the loan; 1 MiB loan at or under iceoryx2 blocking; the spinning
    lane at most 10 µs and the blocking one at most 30 µs at 64 B, each faster than the fastest peer; connect p50 at
    most 5 ms.
    """
    out = [
        _ratio_verdict("64 B loan p50 <= 1.0x zmq's", p50, ("shmrpc", 64), ("zmq", 64), 1.0),
        _ratio_verdict("64 B call() p50 <= 1.3x the loan's", p50, ("shmrpc-call", 64), ("shmrpc", 64), 1.3),
        _ratio_verdict("64 B call() through the lane <= 1.3x the lane's loan", p50, ("shmrpc-call-lane", 64),
                       ("shmrpc-lane", 64), 1.3),
        _ratio_verdict("1 MiB loan p50 <= iceoryx2 blocking's", p50, ("shmrpc", 1 << 20), ("iox2", 1 << 20), 1.0),
    ]
    peers = {k: v for (k, n), v in p50.items() if n == 64 and k in _PEER_KEYS}
    fastest = min(peers.items(), key=lambda kv: kv[1]) if peers else None
    for key, limit in (("shmrpc-lane-spin", 10.0), ("shmrpc-lane", 30.0)):
        goal = f"64 B {key} p50 <= {limit:.0f} µs and under the fastest peer's"
        v = p50.get((key, 64))
        if v is None:
            out.append(_verdict(goal, None, _need(p50, [(key, 64)], f"needs {key} at 64 B")))
            continue
        beat = fastest is None or v < fastest[1]
        peer = f"; fastest peer {fastest[0]} {fastest[1]:.1f} µs" if fastest else "; no peer measured"
        out.append(_verdict(goal, v <= limit and beat, f"{v:.1f} µs{peer}", p50_us=v))
    conn = doc.get("connect") or {}
    goal = "connect (Client(name) to ready) p50 <= 5 ms"
    if "p50_us" not in conn:
        out.append(_verdict(goal, None, "needs --connect-iters"))
    elif conn.get("iterations", 0) < MIN_VERDICT_SAMPLES:  # as for every other p50
        out.append(_verdict(goal, None, f"too few samples for a verdict ({conn.get('iterations', 0)} connects; at "
                                        f"least {MIN_VERDICT_SAMPLES} needed: --connect-iters)"))
    else:
        out.append(_verdict(goal, conn["p50_us"] <= 5000, f"{conn['p50_us'] / 1000:.2f} ms", p50_us=conn["p50_us"]))
    return out


def verdict_lines(doc: dict[str, Any]) -> str:
    """One ``PASS``/``MISS``/``N/A`` line per goal."""
    return "\n".join(f"{v['status']:<4} {v['goal']}: {v['detail']}" for v in doc.get("verdicts", []))
