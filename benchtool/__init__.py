"""``shmrpc bench``: round-trip latency and bandwidth of shmrpc next to the transports people use today.

Run it as ``shmrpc bench lat|bw ...`` or ``python -m shmrpc.bench lat|bw ...``;
``docs/benchmarks.md`` defines every figure. The library entry points:

* :func:`main` — the command line (``main(["lat", "--sizes", "64,1M", "--peers"])``);
* :func:`run_benchmark` with a :class:`RunConfig` — the measurements as a JSON-ready dict;
* :func:`latency_stats` — percentiles of round-trip samples;
* :func:`write_plots`, :func:`finish_document`, :func:`write_json` — the outputs.

Peers (``zmq``, ``pipe``, ``grpc``, ``iox2``, ``iox2-spin``, ``ucx``) need the ``[bench]`` extra for gRPC,
iceoryx2 and the plots, the ``[ucx]`` one for UCX; a missing package is reported and that transport skipped.
"""

from __future__ import annotations

from ._cli import main
from ._plots import write_plots
from ._report import finish_document, machine_facts, verdicts, write_json
from ._runner import RunConfig
from ._session import run_benchmark
from ._stats import BandwidthStats, LatencyStats, bandwidth_stats, latency_stats, parse_sizes, size_sweep

__all__ = [
    "main",
    "RunConfig",
    "run_benchmark",
    "LatencyStats",
    "BandwidthStats",
    "latency_stats",
    "bandwidth_stats",
    "parse_sizes",
    "size_sweep",
    "write_plots",
    "finish_document",
    "machine_facts",
    "verdicts",
    "write_json",
]
