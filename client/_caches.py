"""The one bound of a client's signature caches.

A client keeps, per call signature (op, input shapes and dtypes, attributes...), the descriptor bytes, the output
sizes the worker answered, the call plan and the decoded response descriptor, so that a steady stream of identical
calls works each out once. A stream of ever new signatures (random sizes) would make them grow without end: each
holds at most :data:`CACHE_ENTRIES` and is emptied when full (a steady stream has few signatures; one that has
more than this many gains nothing from a cache of them). A client of random sizes grew 6.6 MiB with 4096 entries
per cache and 1.1 MiB with this bound (bench/client_rss.py; docs/client.md, "Caches and their bounds").
"""

from __future__ import annotations

from typing import Any

__all__ = ["CACHE_ENTRIES", "bounded_put"]

CACHE_ENTRIES = 1024


def bounded_put(cache: dict[Any, Any], key: Any, value: Any) -> None:
    """``cache[key] = value``, emptying the cache first when it holds :data:`CACHE_ENTRIES`."""
    if len(cache) >= CACHE_ENTRIES:
        cache.clear()
    cache[key] = value
