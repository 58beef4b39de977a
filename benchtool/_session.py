"""One benchmark run from start to end: servers up, every (transport, size) measured, servers down.

The result is one JSON-ready document (see ``docs/benchmarks.md`` for its schema)::

    {"schema": "shmrpc-bench/1", "mode": "lat" | "bw", "config": {...}, "worker": {...},
     "transports": {key: {"label", "status": "ok" | "skipped" | "failed", "reason"?, "method"?}},
     "results": [{"transport", "nbytes", "latency": {...}} | {"transport", "nbytes", "bandwidth": {...}}
                 | {"transport", "nbytes", "error"}],
     "scaling": [{"transport", "clients", "nbytes", "calls_per_s", "per_client_p99_us", ...}],
     "connect": {"iterations", "p50_us", ...} (``Client(name)`` to ready, then closed; with --connect-iters)}

``_report`` adds the machine facts, the command line and the verdicts.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ._report import now_iso
from ._runner import SHM_KEYS, RunConfig, Servers, make_transport, measure_latency, open_servers, run_clients
from ._runner import bandwidth_point as _bandwidth_point
from ._shm import worker_counts
from ._stats import iters_for_size, latency_stats, size_label
from ._transport import Transport, TransportUnavailable

__all__ = ["run_benchmark", "SCHEMA"]

SCHEMA = "shmrpc-bench/1"


def _progress(total: int, quiet: bool) -> Any:
    """A tqdm bar on stderr that shows itself only after 2 s, and only on a TTY; a no-op bar otherwise."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, disable=quiet or not sys.stderr.isatty(), delay=2.0, unit="pt", leave=False,
                dynamic_ncols=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        """Nothing to show."""

    def set_description(self, text: str) -> None:
        """Nothing to show."""

    def close(self) -> None:
        """Nothing to close."""


def _aliases(op: str) -> bool:
    """Whether ``op``'s output is its input (``echo``): nothing is read or written to answer it."""
    from shmrpc.kernels import REGISTRY

    spec = REGISTRY.get(op)
    return spec is not None and spec.alias


def _measure_size(t: Transport, key: str, nbytes: int, cfg: RunConfig, window: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"transport": key, "nbytes": nbytes}
    try:
        t.prepare(nbytes)
        if cfg.mode == "lat":
            iters = iters_for_size(nbytes, cfg.iters, cfg.bytes_budget, cfg.min_iters)
            samples = measure_latency(t, iters, min(cfg.warmup, max(1, iters // 2)))
            entry["latency"] = latency_stats(samples).to_json()
        else:
            entry["bandwidth"] = _bandwidth_point(t, nbytes, cfg, window)
            if getattr(t, "method", "") == "resend" and _aliases(cfg.op):
                # the loan's payload was written once, before the timing, and the op's output is its input: no
                # payload byte moved while the clock ran, so bytes per second would count bytes never copied
                entry["bandwidth"].update(one_dir_gbps=None, both_dir_gbps=None, payload_moved=False)
    except Exception as exc:  # one failing point is recorded, the run goes on
        entry["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            t.end_size()
        except Exception as exc:
            entry.setdefault("error", f"releasing: {type(exc).__name__}: {exc}")
    return entry


def run_benchmark(cfg: RunConfig, *, quiet: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every transport of ``cfg`` at every size (and the client sweep); return the result document.

    Missing optional peers and a worker that does not start are recorded as
    ``skipped`` with the reason; a point that fails is recorded with ``error``.

    Example:
        >>> doc = run_benchmark(RunConfig(sizes=[64], iters=10, transports=["zmq"]))  # doctest: +SKIP
        >>> doc["results"][0]["latency"]["p50_us"]  # doctest: +SKIP
        61.2
    """
    doc: dict[str, Any] = {"schema": SCHEMA, "mode": cfg.mode, "date": now_iso(), "config": asdict(cfg),
                           "transports": {}, "results": [], "scaling": []}
    t0 = time.monotonic()
    ignored: dict[int, Any] = {}
    servers = Servers()
    try:
        with open_servers(cfg, log, servers):
            doc["worker"] = servers.worker
            active = [k for k in cfg.transports if k not in servers.skipped]
            scaling = [k for k in active if cfg.clients]
            total = len(active) * len(cfg.sizes) + len(scaling) * len(cfg.clients) * len(cfg.scaling_sizes())
            bar = _progress(total, quiet)
            try:
                for key in cfg.transports:
                    label = _label(key)
                    if key in servers.skipped:
                        doc["transports"][key] = {"label": label, "status": "skipped", "reason": servers.skipped[key]}
                        continue
                    try:
                        t = make_transport(key, servers.addresses[key], cfg)
                    except TransportUnavailable as exc:
                        log(f"skipped {key}: {exc}")
                        doc["transports"][key] = {"label": label, "status": "skipped", "reason": str(exc)}
                        active.remove(key)
                        bar.update(len(cfg.sizes))
                        continue
                    # entered before its first size: a Ctrl-C in the middle keeps the sizes already measured in the table
                    info: dict[str, Any] = {"label": label, "status": "ok"}
                    doc["transports"][key] = info
                    with t:
                        for nbytes in cfg.sizes:
                            bar.set_description(f"{key} {size_label(nbytes)}")
                            window = min(cfg.window, t.max_window)
                            if servers.plan is not None and key.startswith("shmrpc"):
                                window = min(window, servers.plan.window_for(nbytes))
                            doc["results"].append(_measure_size(t, key, nbytes, cfg, window))
                            if hasattr(t, "method"):
                                info["method"] = t.method
                            bar.update()
                if cfg.connect_iters and any(k.startswith("shmrpc") for k in cfg.transports):
                    bar.set_description("connect")
                    doc["connect"] = connect_default_worker(cfg)
                for key in [k for k in scaling if k in active and _multi(k)]:
                    for n_clients in cfg.clients:
                        for nbytes in cfg.scaling_sizes():
                            bar.set_description(f"{key} x{n_clients} {size_label(nbytes)}")
                            before = worker_counts(servers.metrics_url) if key in SHM_KEYS else {}
                            try:
                                point = run_clients(key, servers.addresses[key], cfg, n_clients, nbytes)
                            except Exception as exc:
                                point = {"transport": key, "clients": n_clients, "nbytes": nbytes,
                                         "error": f"{type(exc).__name__}: {exc}"}
                            after = worker_counts(servers.metrics_url) if before else {}
                            if after:  # what the worker did for this point (warm-up and set-up calls included)
                                d = {k: after[k] - before[k] for k in after}
                                d["mean_batch"] = round(d["batched"] / d["batches"], 2) if d["batches"] else 1.0
                                point["worker"] = d
                            doc["scaling"].append(point)
                            bar.update()
            except KeyboardInterrupt:
                # what was measured is kept; the servers are stopped by the `with` (a second Ctrl-C or SIGTERM would cut
                # that short and leave them behind: ignored until they are)
                if threading.current_thread() is threading.main_thread():
                    ignored = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
                doc["interrupted"] = True
                _not_reached(doc, cfg)
                log("interrupted: stopping the servers; what was measured is kept")
            finally:
                bar.close()
    except KeyboardInterrupt:  # while the servers started or stopped: the `with` stopped those it had started
        doc["worker"] = servers.worker
        doc["interrupted"] = True
        _not_reached(doc, cfg)
        log("interrupted while the servers started or stopped; what was measured is kept")
    for sig, handler in ignored.items():
        signal.signal(sig, handler)
    doc["elapsed_s"] = round(time.monotonic() - t0, 3)
    return doc


def _not_reached(doc: dict[str, Any], cfg: RunConfig) -> None:
    for key in cfg.transports:
        doc["transports"].setdefault(key, {"label": _label(key), "status": "skipped",
                                           "reason": "not measured: the run was interrupted"})


def connect_default_worker(cfg: RunConfig) -> dict[str, Any]:
    """:func:`measure_connect` against a worker started with its defaults (slots, lease; ``cfg.backend``), or the
    running worker ``cfg.name``: what ``Client(name)`` costs a short-lived process (the benchmark's own worker
    leases every size class it measures, so its connects would be dearer)."""
    if cfg.name:
        return dict(measure_connect(cfg.name, cfg.connect_iters), worker="--name")
    from ._shm import WorkerProcess

    try:
        with WorkerProcess(None, cfg.backend, cfg.worker_args) as w:
            w.wait_ready()
            return dict(measure_connect(w.name, cfg.connect_iters), worker="defaults")
    except Exception as exc:  # recorded, the run goes on
        return {"error": f"{type(exc).__name__}: {exc}"}


def measure_connect(name: str, iters: int) -> dict[str, Any]:
    """``Client(name)`` from the call to a ready client (handshake, regions mapped), ``iters`` times; each is closed
    before the next (its close is not timed). Returns latency statistics, or ``{"error"}``."""
    try:
        from shmrpc.client import Client  # type: ignore[attr-defined]

        samples = []
        for _ in range(iters + 2):
            t0 = time.perf_counter_ns()
            c = Client(name, connect_timeout_s=20.0)
            samples.append(time.perf_counter_ns() - t0)
            c.close()
        import numpy as np

        return latency_stats(np.asarray(samples[2:], dtype=np.int64)).to_json()
    except Exception as exc:  # recorded, the run goes on
        return {"error": f"{type(exc).__name__}: {exc}"}


def _label(key: str) -> str:
    from ._runner import TRANSPORT_CLASSES

    return TRANSPORT_CLASSES[key].label


def _multi(key: str) -> bool:
    from ._runner import TRANSPORT_CLASSES

    return TRANSPORT_CLASSES[key].multi_client
