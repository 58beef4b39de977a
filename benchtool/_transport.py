"""The client side of one benchmarked transport, and the server processes of the peers.

A :class:`Transport` holds one connection and one prepared payload. The timing
loops in ``_runner`` call :meth:`Transport.roundtrip` (latency) or
:meth:`Transport.start` / :meth:`Transport.finish` (a window of requests in
flight, bandwidth); everything else (making the payload, connecting) happens
outside the timed region.

A :class:`ServerProcess` runs a peer's server in a ``spawn`` child process and
tells its address; client processes of the multi-client mode connect to that
address by themselves.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np

__all__ = ["Transport", "ServerProcess", "TransportUnavailable", "touch", "payload_of"]


class TransportUnavailable(RuntimeError):
    """A transport cannot run here (a missing optional package, a worker that did not start); it is skipped."""


def touch(arr: np.ndarray) -> int:
    """Read one byte per 4 KiB page of ``arr`` (a flat uint8 view) so the server really holds the payload."""
    return int(arr[::4096].sum()) if arr.size else 0


class Transport(ABC):
    """One client connection of a transport under test, with a payload of ``nbytes`` prepared by :meth:`prepare`."""

    #: Short key used on the command line and in JSON (``shmrpc``, ``zmq``, ...).
    key: ClassVar[str] = ""
    #: Human label used in tables and plot legends.
    label: ClassVar[str] = ""
    #: Whether several client processes may use one server of this transport at once.
    multi_client: ClassVar[bool] = True
    #: Most requests one connection can keep in flight (bandwidth mode caps ``--window`` to it).
    max_window: ClassVar[int] = 1 << 30

    def __init__(self, address: str) -> None:
        self.address = address
        self.nbytes = 0

    @abstractmethod
    def prepare(self, nbytes: int) -> None:
        """Build the request payload of ``nbytes`` (done once per size, outside the timed loops)."""

    @abstractmethod
    def roundtrip(self) -> Any:
        """Send the payload and wait for the reply; returns the reply (a bytes-like or array)."""

    def start(self) -> Any:
        """Send the payload without waiting; returns a handle for :meth:`finish` (replies come back in order)."""
        return self.roundtrip()

    def finish(self, handle: Any) -> Any:
        """Wait for the reply of the request ``handle`` stands for; returns the reply."""
        return handle

    def reply_bytes(self, reply: Any) -> bytes:
        """The payload bytes of ``reply`` (for correctness checks, never timed)."""
        return bytes(memoryview(reply).cast("B"))

    def payload_bytes(self) -> bytes:
        """The bytes the prepared request carries (for correctness checks)."""
        return bytes(payload_of(self.nbytes))

    def end_size(self) -> None:
        """Called after the loops of one size: drop whatever :meth:`prepare` holds."""
        self.nbytes = 0

    def close(self) -> None:
        """Close the connection."""
        self.end_size()

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def payload_of(nbytes: int, dtype: str = "uint8") -> np.ndarray:
    """A deterministic payload of ``nbytes`` bytes in ``dtype``: bytes 0, 1, 2, ... mod 251 for the integer dtypes;
    for the floating ones items k / 256 - 0.5 (k = 0, 1, ... mod 251): small, finite and normal (bytes viewed as
    floats held NaN, subnormals and near-overflow values, which time other arithmetic than a user's); 0 and 1 for
    bool. One period is made and repeated, so a large payload costs a copy, not arithmetic per item."""
    from shmrpc.kernels._dtypes import f32_to_bf16, storage_dtype

    dt = storage_dtype(dtype)  # bfloat16: its uint16 bits
    if nbytes % dt.itemsize:
        raise ValueError(f"{nbytes} bytes is not a whole number of {dtype} items")
    if dtype == "bfloat16":
        period = f32_to_bf16(np, np.arange(251, dtype=np.float32) / 256 - 0.5)
    elif dt.kind == "f":
        period = (np.arange(251) / 256 - 0.5).astype(dt)
    elif dt.kind == "b":
        period = np.arange(251) % 2 == 1
    else:
        return np.resize(np.arange(251, dtype=np.uint8), nbytes).view(dt)
    return np.resize(period, nbytes // dt.itemsize)


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _serve_child(target: Callable[..., None], address: str, ready: Any, why: Any) -> None:
    """A peer server's process: Ctrl-C is the parent's to handle (it stops the server), and SIGTERM unwinds the
    server's Python (an iceoryx2 node removes its files in /dev/shm only then: killed by the default action, it
    left them behind). An error goes to the parent as one line, ``why``, for its skip reason."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    try:
        target(address, ready)
    except Exception as exc:
        try:
            why.send(f"{type(exc).__name__}: {exc}")
        except OSError:  # after its start: the parent no longer listens, and the traceback says it
            raise exc from None
        raise SystemExit(1) from None


@contextmanager
def ctrl_c_left_to_us() -> Iterator[None]:
    """Processes started inside begin with SIGINT ignored (an ignored signal stays so across exec): a Ctrl-C to the
    group while one was still importing, before it could ignore it, printed its traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


class ServerProcess:
    """A peer server ``target(address, ready)`` in a ``spawn`` child; a private temp dir holds its socket.

    ``target`` must be a module-level function; it sets ``ready`` once it accepts
    requests and runs until terminated. ``cleanup(address)`` runs once it is stopped (what it leaves outside its
    directory).

    Raises:
        TransportUnavailable: the server exited at start (its error named) or did not report ready within
            ``start_timeout_s``.
    """

    def __init__(self, target: Callable[..., None], sock_name: str, start_timeout_s: float = 30.0,
                 cleanup: Callable[[str], None] | None = None) -> None:
        self._cleanup = cleanup
        self._dir = tempfile.mkdtemp(prefix="shmrpc-bench-")
        os.chmod(self._dir, 0o700)
        self.address = os.path.join(self._dir, sock_name)
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        why, why_child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_serve_child, args=(target, self.address, ready, why_child), daemon=True)
        try:
            with ctrl_c_left_to_us():
                self._proc.start()
            why_child.close()
            deadline = time.monotonic() + start_timeout_s
            while not ready.wait(0.05):  # one that dies at start is told at once, with its cause
                if not self._proc.is_alive():
                    cause = why.recv() if why.poll() else "no error reported"
                    raise TransportUnavailable(f"the {sock_name} peer server exited at start with status "
                                               f"{self._proc.exitcode}: {cause}")
                if time.monotonic() > deadline:
                    raise TransportUnavailable(f"the {sock_name} peer server did not start within "
                                               f"{start_timeout_s} s")
        except BaseException:  # a Ctrl-C meanwhile too: the server and its directory go
            self.close()
            raise
        finally:
            why.close()

    def close(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s), remove its socket directory and run ``cleanup``."""
        if self._proc.pid is not None and self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        shutil.rmtree(self._dir, ignore_errors=True)
        if self._cleanup is not None:
            self._cleanup(self.address)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
