"""PNG plots of a run (matplotlib, Agg backend): latency vs size, bandwidth vs size, scaling with clients."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._report import shapes_note, spin_note
from ._stats import size_label

__all__ = ["write_plots"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _series(doc: dict[str, Any], kind: str) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """Transport -> its (size, point) in size order; a point without a figure to draw (a loan re-sent to echo has no
    GB/s) is left out, and a transport without one gets no line and no legend entry."""
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for r in doc["results"]:
        if kind in r and (kind != "bandwidth" or r[kind].get("both_dir_gbps") is not None):
            out.setdefault(r["transport"], []).append((r["nbytes"], r[kind]))
    for pts in out.values():
        pts.sort(key=lambda p: p[0])
    return out


def _label(doc: dict[str, Any], key: str) -> str:
    return str(doc["transports"].get(key, {}).get("label", key))


def _size_axis(ax: Any, sizes: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes)
    ax.set_xticklabels([size_label(n) for n in sizes], rotation=45, ha="right", fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("payload each way")
    ax.grid(True, which="both", alpha=0.3)


def _title(doc: dict[str, Any], what: str) -> str:
    m = doc.get("machine", {})
    return f"{what} — op {doc['config']['op']}{shapes_note(doc)}{spin_note(doc)}, {m.get('cpu_model', '')}".strip(", ")


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _per_size(doc: dict[str, Any], kind: str, path: Path, ylabel: str, title: str,
              draw: Callable[[Any, list[int], list[dict[str, Any]], str], None]) -> Path | None:
    """One log-log figure against payload size, ``draw(ax, sizes, points, label)`` once per transport."""
    series = _series(doc, kind)
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key, pts in series.items():
        draw(ax, [n for n, _ in pts], [p for _, p in pts], _label(doc, key))
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    _size_axis(ax, sorted({n for pts in series.values() for n, _ in pts}))
    ax.set_title(_title(doc, title), fontsize=10)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def _draw_latency(ax: Any, xs: list[int], pts: list[dict[str, Any]], label: str) -> None:
    p50 = [p["p50_us"] for p in pts]
    (line,) = ax.plot(xs, p50, marker="o", ms=3, label=f"{label} p50")
    ax.fill_between(xs, p50, [p["p99_us"] for p in pts], color=line.get_color(), alpha=0.2, linewidth=0)


def _draw_bandwidth(ax: Any, xs: list[int], pts: list[dict[str, Any]], label: str) -> None:
    (line,) = ax.plot(xs, [p["both_dir_gbps"] for p in pts], marker="o", ms=3, label=f"{label} (both directions)")
    ax.plot(xs, [p["one_dir_gbps"] for p in pts], ls="--", color=line.get_color(), alpha=0.6)


def _latency(doc: dict[str, Any], path: Path) -> Path | None:
    return _per_size(doc, "latency", path, "round trip (µs); band: p50 to p99", "round trip latency", _draw_latency)


def _bandwidth(doc: dict[str, Any], path: Path) -> Path | None:
    return _per_size(doc, "bandwidth", path, "GB/s (solid: both directions, dashed: one direction)",
                     f"bandwidth, window {doc['config']['window']}", _draw_bandwidth)


def _scaling(doc: dict[str, Any], path: Path) -> Path | None:
    pts = [p for p in doc.get("scaling", []) if "calls_per_s" in p]
    if not pts:
        return None
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.8))
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for p in pts:
        groups.setdefault((p["transport"], p["nbytes"]), []).append(p)
    for (key, n), g in groups.items():
        g.sort(key=lambda p: p["clients"])
        xs = [p["clients"] for p in g]
        label = f"{_label(doc, key)} {size_label(n)}"
        ax1.plot(xs, [p["calls_per_s"] for p in g], marker="o", ms=3, label=label)
        ax2.plot(xs, [max(p["per_client_p99_us"]) for p in g], marker="o", ms=3, label=label)
    clients = sorted({p["clients"] for p in pts})
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(clients)
        ax.set_xticklabels([str(c) for c in clients])
        ax.minorticks_off()
        ax.set_xlabel("client processes")
        ax.grid(True, alpha=0.3)
    ax1.set_ylabel("aggregate requests/s (all clients)")
    ax2.set_ylabel("p99 of the worst client (µs)")
    ax2.set_yscale("log")
    ax1.legend(fontsize=7)
    fig.suptitle(_title(doc, "scaling with clients"), fontsize=10)
    return _save(plt, fig, path)


def write_plots(doc: dict[str, Any], directory: str | os.PathLike[str], stem: str | None = None) -> list[Path]:
    """Write every plot the run has data for into ``directory``; returns the files written.

    Files: ``<stem>-latency.png`` (log-log, p50 line and p50..p99 band per
    transport), ``<stem>-bandwidth.png``, ``<stem>-scaling.png``; ``stem``
    defaults to the mode.

    Raises:
        ImportError: matplotlib is not installed.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    stem = stem or doc["mode"]
    written = []
    for name, fn in (("latency", _latency), ("bandwidth", _bandwidth), ("scaling", _scaling)):
        p = fn(doc, out / f"{stem}-{name}.png")
        if p is not None:
            written.append(p)
    return written
