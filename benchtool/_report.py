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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._stats import size_label

__all__ = ["machine_facts", "latency_table", "bandwidth_table", "scaling_table", "verdicts", "verdict_lines",
           "write_json", "default_out_path", "finish_document", "now_iso"]

_PACKAGES = ("shmrpc", "numpy", "pyzmq", "grpcio", "cupy", "cupy-cuda12x", "cupy-cuda13x", "matplotlib")
_PEER_KEYS = ("zmq", "pipe", "grpc")


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
    repo = Path(__file__).resolve().parents[2]
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
        "git_commit": commit,
        "git_dirty": bool(dirty),
    }


def now_iso() -> str:
    """The local time now, ISO 8601 with its UTC offset, to the second."""
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


def finish_document(doc: dict[str, Any], argv: list[str]) -> dict[str, Any]:
    """Add the date (the run's start if set), the exact command line, the machine facts and the verdicts to a run's document."""
    doc.setdefault("date", now_iso())
    doc["command"] = shlex.join(argv)
    doc["machine"] = machine_facts()
    doc["verdicts"] = verdicts(doc)
    return doc


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


def _points(doc: dict[str, Any], kind: str) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["transport"], r["nbytes"]): r.get(kind, r) for r in doc["results"]}


def _keys(doc: dict[str, Any]) -> list[str]:
    return [k for k, v in doc["transports"].items() if v["status"] == "ok"]


def spin_note(doc: dict[str, Any]) -> str:
    """``", shmrpc spinning N µs"`` when the run's worker and clients spun (``--spin-us``), else empty."""
    spin = doc["config"].get("spin_us", 0)
    return f", shmrpc spinning {spin} µs" if spin else ""


def _rows(doc: dict[str, Any], kind: str, lines: list[str]) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(size, label, point) in table order; a failed point gets its error line in ``lines`` instead."""
    pts = _points(doc, kind)
    for n in doc["config"]["sizes"]:
        for key in _keys(doc):
            p = pts.get((key, n))
            if p is None:
                continue
            label = doc["transports"][key]["label"]
            if "error" in p:
                lines.append(f"{size_label(n):>6}  {label:<30} error: {p['error']}")
                continue
            yield n, label, p


def latency_table(doc: dict[str, Any]) -> str:
    """Round-trip latency in µs: one row per (size, transport), with each p50 over shmrpc's at that size."""
    base = {n: p["p50_us"] for (key, n), p in _points(doc, "latency").items() if key == "shmrpc" and "p50_us" in p}
    head = f"{'size':>6}  {'transport':<30} {'iters':>6} {'min':>9} {'p50':>9} {'p90':>9} {'p99':>9} " \
           f"{'p99.9':>9} {'max':>9} {'mean':>9} {'stdev':>8} {'p50/shm':>8}"
    lines = [f"round trip latency (µs){spin_note(doc)}", head, "-" * len(head)]
    for n, label, p in _rows(doc, "latency", lines):
        ratio = f"{p['p50_us'] / base[n]:8.2f}" if base.get(n) else f"{'':>8}"
        lines.append(f"{size_label(n):>6}  {label:<30} {p['iterations']:6d} {p['t_min_us']:9.1f} "
                     f"{p['p50_us']:9.1f} {p['p90_us']:9.1f} {p['p99_us']:9.1f} {p['p999_us']:9.1f} "
                     f"{p['max_us']:9.1f} {p['mean_us']:9.1f} {p['stdev_us']:8.1f} {ratio}")
    return "\n".join(lines)


def bandwidth_table(doc: dict[str, Any]) -> str:
    """Throughput with a window in flight: messages/s and GB/s one direction and both."""
    head = f"{'size':>6}  {'transport':<30} {'window':>6} {'msgs':>6} {'msg/s':>10} {'GB/s 1-dir':>10} {'GB/s both':>10}"
    lines = [f"bandwidth (GB = 1e9 B; 1-dir counts the payload once per round trip, both counts it twice){spin_note(doc)}",
             head, "-" * len(head)]
    for n, label, p in _rows(doc, "bandwidth", lines):
        lines.append(f"{size_label(n):>6}  {label:<30} {p['window']:6d} {p['messages']:6d} "
                     f"{p['msgs_per_s']:10.0f} {p['one_dir_gbps']:10.3f} {p['both_dir_gbps']:10.3f}")
    return "\n".join(lines)


def scaling_table(doc: dict[str, Any]) -> str:
    """Several client processes against one server: aggregate calls/s and each client's p99."""
    if not doc.get("scaling"):
        return ""
    head = f"{'transport':<30} {'clients':>7} {'size':>6} {'calls/s':>10} {'p50':>9} {'p99 worst client':>17}"
    lines = [f"scaling with client processes (latency loop in each; µs){spin_note(doc)}", head, "-" * len(head)]
    for p in doc["scaling"]:
        label = doc["transports"].get(p["transport"], {}).get("label", p["transport"])
        if "error" in p:
            lines.append(f"{label:<30} {p['clients']:7d} {size_label(p['nbytes']):>6} error: {p['error']}")
            continue
        lines.append(f"{label:<30} {p['clients']:7d} {size_label(p['nbytes']):>6} {p['calls_per_s']:10.0f} "
                     f"{p['p50_us']:9.1f} {max(p['per_client_p99_us']):17.1f}")
    return "\n".join(lines)


# --------------------------------------------------------------------- verdicts


#: Fewest round trips behind a p50 that a verdict may rest on (``--iters 1`` gives no verdict).
MIN_VERDICT_SAMPLES = 100


def _verdict(goal: str, ok: bool | None, detail: str, **figures: Any) -> dict[str, Any]:
    return {"goal": goal, "status": "N/A" if ok is None else ("PASS" if ok else "MISS"), "detail": detail, **figures}


def verdicts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The three goals of the issue, judged from this run's latency p50s (``N/A`` where a figure is missing).

    1. 64 B round trip p50 within 1.2x the zmq peer's.
    2. From 1 MiB up, shmrpc's p50 at least 10x shorter than every peer's.
    3. 64 MiB round trip p50 within 2x shmrpc's own 64 B.

    A p50 from fewer than :data:`MIN_VERDICT_SAMPLES` round trips is not used: the goal it
    would decide is ``N/A``, saying so.
    """
    if doc["mode"] != "lat":
        return []
    points = {k: v for k, v in _points(doc, "latency").items() if "p50_us" in v}
    p50 = {k: v["p50_us"] for k, v in points.items() if v.get("iterations", 0) >= MIN_VERDICT_SAMPLES}
    if len(p50) < len(points):
        few = min(v.get("iterations", 0) for v in points.values())
        note = f"too few samples for a verdict ({few} round trips; at least {MIN_VERDICT_SAMPLES} needed)"
        return [_verdict(goal, None, note) for goal in (
            "64 B round trip p50 <= 1.2x zmq's", "from 1 MiB up, p50 >= 10x shorter than every peer's",
            "64 MiB round trip p50 <= 2x shmrpc's 64 B")]
    shm = "shmrpc" if any(k == "shmrpc" for k, _ in p50) else "shmrpc-call"
    out = []
    a, b = p50.get((shm, 64)), p50.get(("zmq", 64))
    goal = "64 B round trip p50 <= 1.2x zmq's"
    if a is None or b is None:
        out.append(_verdict(goal, None, "needs shmrpc and the zmq peer at 64 B"))
    else:
        out.append(_verdict(goal, a <= 1.2 * b, f"{shm} {a:.1f} µs vs zmq {b:.1f} µs = {a / b:.2f}x", ratio=a / b))
    goal = "from 1 MiB up, p50 >= 10x shorter than every peer's"
    worst: tuple[float, int, str] | None = None
    for (key, n), v in p50.items():
        if key in _PEER_KEYS and n >= 1 << 20 and (shm, n) in p50:
            ratio = v / p50[(shm, n)]
            if worst is None or ratio < worst[0]:
                worst = (ratio, n, key)
    if worst is None:
        out.append(_verdict(goal, None, "needs shmrpc and a peer at 1 MiB or more"))
    else:
        ratio, n, key = worst
        out.append(_verdict(goal, ratio >= 10, f"smallest advantage {ratio:.1f}x ({key} at {size_label(n)}: "
                            f"{p50[(key, n)]:.1f} µs vs {p50[(shm, n)]:.1f} µs)", ratio=ratio))
    a, b = p50.get((shm, 64 << 20)), p50.get((shm, 64))
    goal = "64 MiB round trip p50 <= 2x shmrpc's 64 B"
    if a is None or b is None:
        out.append(_verdict(goal, None, "needs shmrpc at 64 B and 64 MiB"))
    else:
        out.append(_verdict(goal, a <= 2 * b, f"{a:.1f} µs vs {b:.1f} µs = {a / b:.2f}x", ratio=a / b))
    return out


def verdict_lines(doc: dict[str, Any]) -> str:
    """One ``PASS``/``MISS``/``N/A`` line per goal."""
    return "\n".join(f"{v['status']:<4} {v['goal']}: {v['detail']}" for v in doc.get("verdicts", []))
