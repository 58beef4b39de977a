"""A worker's Prometheus samples, read from the metrics address its ready line prints."""

from __future__ import annotations

import urllib.request

__all__ = ["metrics_url", "samples"]


def metrics_url(ready_line: str) -> str:
    """The metrics address in a worker's ready line."""
    for part in ready_line.split():
        if part.startswith("http://"):
            return part.rstrip(")")
    raise AssertionError(ready_line)


def samples(ready_line: str) -> dict[str, float]:
    """Every sample the worker of ``ready_line`` exports now: ``'name{labels}'`` -> value."""
    with urllib.request.urlopen(metrics_url(ready_line), timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out
