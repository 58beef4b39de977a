"""Where a worker called NAME lives: its socket directory, socket and lock file, region names.

Clients find a worker by NAME alone:

* runtime directory: ``$SHMRPC_RUNTIME_DIR`` if set, else ``$XDG_RUNTIME_DIR/shmrpc``
  if ``XDG_RUNTIME_DIR`` is set, else ``/tmp/shmrpc-<uid>``; mode 0700, owned by the
  worker's uid (the worker creates it and refuses one that others can enter);
* attach socket: ``<runtime dir>/<NAME>.attach`` (a plain Unix SOCK_SEQPACKET socket: the
  handshake, where both sides read the other's credentials from the kernel and the worker
  hands the client its regions as file descriptors);
* socket: ``<runtime dir>/<NAME>.sock`` (ZeroMQ ``ipc://`` endpoint, the doorbells);
* lock file: ``<runtime dir>/<NAME>.lock`` (flock held while the worker lives; JSON
  with its pid, start time, regions and socket, so a successor can clean up);
* regions: memfds with no name anywhere (handed over with ``SCM_RIGHTS``); names
  ``/shmrpc.<NAME>.<index>.<16 random hex digits>`` in ``/dev/shm`` exist only for tools,
  tests and regions left by older versions (doctor and a successor clean them up).

A client of another uid (a worker started with ``--allow-uid``) names the worker's uid: its
runtime directory is then ``$SHMRPC_RUNTIME_DIR`` if set, else ``/tmp/shmrpc-<worker uid>``
(another user's ``XDG_RUNTIME_DIR`` is private to that user).
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
    "device_worker_name",
    "device_workers",
    "runtime_dir",
    "socket_path",
    "attach_path",
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


def runtime_dir(worker_uid: int | None = None) -> Path:
    """The directory holding sockets and lock files (not created here).

    ``worker_uid``: the uid the worker runs as, when it is not this process's.
    """
    explicit = os.environ.get("SHMRPC_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    if worker_uid is not None and worker_uid != os.getuid():
        return Path(f"/tmp/shmrpc-{worker_uid}")
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "shmrpc"
    return Path(f"/tmp/shmrpc-{os.getuid()}")


def socket_path(name: str, worker_uid: int | None = None) -> Path:
    """The ipc socket file of worker ``name``."""
    return runtime_dir(worker_uid) / f"{validate_name(name)}.sock"


def attach_path(name: str, worker_uid: int | None = None) -> Path:
    """The attach (handshake) socket of worker ``name``."""
    return runtime_dir(worker_uid) / f"{validate_name(name)}.attach"


def lock_path(name: str) -> Path:
    """The lock file of worker ``name``."""
    return runtime_dir() / f"{validate_name(name)}.lock"


def endpoint(name: str, worker_uid: int | None = None) -> str:
    """The ZeroMQ endpoint of worker ``name``."""
    return f"ipc://{socket_path(name, worker_uid)}"


def region_prefix(name: str) -> str:
    """The /dev/shm name prefix of every region of worker ``name`` (without the leading slash)."""
    return f"{REGION_PREFIX}{validate_name(name)}."


def new_region_name(name: str, index: int) -> str:
    """A fresh, unguessable POSIX shm name for region ``index`` of worker ``name``."""
    return f"/{region_prefix(name)}{index}.{secrets.token_hex(8)}"


def device_worker_name(prefix: str, device: int) -> str:
    """The name of the worker a supervisor (``shmrpc serve --devices``) runs for ``device``: ``<prefix>-<device>``.

    A client :class:`~shmrpc.client.Pool` finds the workers of ``prefix`` by this pattern.
    """
    return validate_name(f"{prefix}-{int(device)}")


def device_workers(prefix: str, worker_uid: int | None = None) -> list[str]:
    """The names of ``prefix``'s per-device workers whose sockets exist now, in device order."""
    validate_name(prefix)
    found = []
    try:
        entries = list(runtime_dir(worker_uid).iterdir())
    except OSError:
        return []
    for p in entries:
        stem, dot, ext = p.name.rpartition(".")
        if dot and ext == "sock" and stem.startswith(prefix + "-") and stem[len(prefix) + 1:].isdigit():
            found.append((int(stem[len(prefix) + 1:]), stem))
    return [n for _, n in sorted(found)]
