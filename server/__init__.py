"""shmrpc.server: the worker daemon (region owner, ZeroMQ loop, dispatch, metrics, CLI).

Run it with ``shmrpc serve --name NAME`` or ``python -m shmrpc.server serve --name NAME``;
embed it with :class:`Worker` and :class:`WorkerConfig`.
"""

from __future__ import annotations

from ._loop import Worker
from .config import WorkerConfig

__all__ = ["Worker", "WorkerConfig"]
