"""Where a worker called NAME lives: its socket directory, socket and lock file, region names.

Clients find a worker by NAME alone:

* runtime directory: ``$SHMRPC_RUNTIME_DIR`` if set, else ``$XDG_RUNTIME_DIR/shmrpc``
  if ``XDG_RUNTIME_DIR`` is set, else ``/tmp/shmrpc-<uid>``; mode 0700, owned by the
  worker's uid (the worker creates it and refuses one that others can enter);
* socket: ``<runtime dir>/<NAME>.sock`` (ZeroMQ ``ipc://`` endpoint);
* lock file: ``<runtime dir>/<NAME>.lock`` (flock held while the worker lives; JSON
  with its pid, start time, regions and socket, so a successor can clean up);
* regions: ``/shmrpc.<NAME>.<index>.<16 random hex digits>`` in ``/dev/shm``, created
  0600; the random part makes the name unguessable, and WELCOME tells it to clients.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

__all__ = [
    "NAME_RE",
    "REGION_PREFIX",
    "validate_name",
    "runtime_dir",
    "socket_path",
    "lock_path",
    "endpoint",
    "new_region_name",
    "region_prefix",
]

NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
REGION_PREFIX = "shmrpc."


def validate_name(name: str) -> str:
    """Return ``name`` if it is a valid worker name (letters, digits, ``_.-``, at most 64), else raise ValueError."""
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"invalid worker name {name!r}: use 1-64 letters, digits, '_', '.', '-' (not starting with '.' or '-')")
    return name


def runtime_dir() -> Path:
    """The directory holding sockets and lock files (not created here)."""
    explicit = os.environ.get("SHMRPC_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "shmrpc"
    return Path(f"/tmp/shmrpc-{os.getuid()}")


def socket_path(name: str) -> Path:
    """The ipc socket file of worker ``name``."""
    return runtime_dir() / f"{validate_name(name)}.sock"


def lock_path(name: str) -> Path:
    """The lock file of worker ``name``."""
    return runtime_dir() / f"{validate_name(name)}.lock"


def endpoint(name: str) -> str:
    """The ZeroMQ endpoint of worker ``name``."""
    return f"ipc://{socket_path(name)}"


def region_prefix(name: str) -> str:
    """The /dev/shm name prefix of every region of worker ``name`` (without the leading slash)."""
    return f"{REGION_PREFIX}{validate_name(name)}."


def new_region_name(name: str, index: int) -> str:
    """A fresh, unguessable POSIX shm name for region ``index`` of worker ``name``."""
    return f"/{region_prefix(name)}{index}.{secrets.token_hex(8)}"
