"""Latency and bandwidth statistics, and the size lists a benchmark sweeps.

Latency samples are round-trip times in nanoseconds (``time.perf_counter_ns``);
every figure reported from them is in microseconds. Percentiles use numpy's
default ("linear") interpolation, so ``p99`` here equals
``numpy.percentile(samples, 99)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from shmrpc.schema.layout import format_size, parse_size

__all__ = [
    "LatencyStats",
    "BandwidthStats",
    "latency_stats",
    "bandwidth_stats",
    "parse_sizes",
    "size_sweep",
    "iters_for_size",
    "size_label",
]

#: The percentiles every latency line reports, as (field name, percentile).
PERCENTILES: tuple[tuple[str, float], ...] = (("p50_us", 50.0), ("p90_us", 90.0), ("p99_us", 99.0),
                                              ("p999_us", 99.9))


@dataclass(frozen=True)
class LatencyStats:
    """Round-trip latency of one (transport, size): the sample count and figures in µs."""

    iterations: int
    t_min_us: float
    p50_us: float
    p90_us: float
    p99_us: float
    p999_us: float
    max_us: float
    mean_us: float
    stdev_us: float

    def to_json(self) -> dict[str, float | int]:
        """The figures as a flat JSON object."""
        return asdict(self)


@dataclass(frozen=True)
class BandwidthStats:
    """Throughput of one (transport, size) with ``window`` requests kept in flight.

    ``one_dir_gbps`` counts the payload once per round trip (the bytes that reach
    the server, which equal the bytes that come back); ``both_dir_gbps`` counts
    it twice (request and response). GB is 10**9 bytes.
    """

    nbytes: int
    messages: int
    window: int
    elapsed_s: float
    msgs_per_s: float
    one_dir_gbps: float
    both_dir_gbps: float

    def to_json(self) -> dict[str, float | int]:
        """The figures as a flat JSON object."""
        return asdict(self)


def latency_stats(samples_ns: Sequence[int] | np.ndarray) -> LatencyStats:
    """Summarise round-trip samples (ns) as :class:`LatencyStats` in µs.

    Raises:
        ValueError: there are no samples.

    Example:
        >>> latency_stats([1000, 2000, 3000]).p50_us
        2.0
    """
    us = np.asarray(samples_ns, dtype=np.float64) / 1e3
    if us.size == 0:
        raise ValueError("no latency samples to summarise")
    pct = np.percentile(us, [p for _, p in PERCENTILES])
    figures = {name: float(v) for (name, _), v in zip(PERCENTILES, pct)}
    return LatencyStats(
        iterations=int(us.size),
        t_min_us=float(us.min()),
        max_us=float(us.max()),
        mean_us=float(us.mean()),
        stdev_us=float(us.std(ddof=1)) if us.size > 1 else 0.0,
        **figures,
    )


def bandwidth_stats(nbytes: int, messages: int, window: int, elapsed_s: float) -> BandwidthStats:
    """Throughput of ``messages`` round trips of ``nbytes`` each way in ``elapsed_s`` seconds."""
    elapsed_s = max(elapsed_s, 1e-12)
    one = nbytes * messages / elapsed_s / 1e9
    return BandwidthStats(nbytes=nbytes, messages=messages, window=window, elapsed_s=elapsed_s,
                          msgs_per_s=messages / elapsed_s, one_dir_gbps=one, both_dir_gbps=2 * one)


def parse_sizes(text: str) -> list[int]:
    """``"64,4K,1M,64M"`` -> sorted distinct byte counts.

    Raises:
        ValueError: an entry is not a size, or is below 1 byte.
    """
    sizes = sorted({parse_size(part) for part in text.split(",") if part.strip()})
    if not sizes or sizes[0] < 1:
        raise ValueError(f"no positive sizes in {text!r}")
    return sizes


def size_sweep(min_nbytes: int, max_nbytes: int) -> list[int]:
    """Powers of two from ``min_nbytes`` (rounded up to one) to ``max_nbytes``, both included when powers of two.

    Raises:
        ValueError: ``min_nbytes`` is larger than ``max_nbytes`` or not positive.
    """
    if min_nbytes < 1 or min_nbytes > max_nbytes:
        raise ValueError(f"size sweep {min_nbytes}..{max_nbytes} is empty")
    size = 1 << max(0, math.ceil(math.log2(min_nbytes)))
    out = []
    while size <= max_nbytes:
        out.append(size)
        size <<= 1
    return out


def iters_for_size(nbytes: int, iters: int, bytes_budget: int, min_iters: int = 5) -> int:
    """Iterations to time at ``nbytes``: ``iters``, cut so one size moves at most ``bytes_budget`` one way.

    Never fewer than ``min(iters, min_iters)``, so large sizes still get a p50.
    """
    cap = max(1, bytes_budget // max(1, nbytes))
    return max(min(iters, min_iters), min(iters, cap))


def size_label(nbytes: int) -> str:
    """A size label for tables: ``64B``, ``4K``, ``1M``, ``256M`` (exact binary units where possible)."""
    text = format_size(nbytes)
    return f"{text}B" if text.isdigit() else text
