"""The one bound of a client's signature caches.

A client keeps, per call signature (op, input shapes and dtypes, attributes...), the descriptor bytes, the output
sizes the worker answered, the call plan and the decoded response descriptor, so that a steady stream of identical
calls works each out once. A stream of ever new signatures (random sizes) would make them grow without end: each
holds at most :data:`CACHE_ENTRIES` and is emptied when full (a steady stream has few signatures; one that has
more than this many gains nothing from a cache of them). At about 2 KiB per signature in all (a client of random
sizes grew ~8 MiB with 4096 entries per cache), a client's caches stay near 2 MiB whatever it sends (docs/client.md,
"Caches and their bounds").
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
