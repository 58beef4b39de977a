"""Real worker processes for end-to-end tests: `python -m shmrpc.server serve` over a real region and socket."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from shmrpc.schema.naming import socket_path

#: Small geometry: 16 x 64K, 4 x 1M, 2 x 4M, 1 x 64M; each client leases 4 x 64K and 1 x 1M.
SLOTS = "64K:16,1M:4,4M:2,64M:1"
LEASE = "4,1,0,0"


@dataclass
class WorkerProc:
    """A running worker subprocess."""

    name: str
    proc: subprocess.Popen  # type: ignore[type-arg]
    args: list[str]
    stderr: str = ""
    ready_line: str = ""  # what the worker printed on stdout once it served

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int:
        """Signal the worker and wait for it; returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            _, self.stderr = self.proc.communicate(timeout=timeout_s)  # also closes the pipes
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate(timeout=5)
            raise
        return self.proc.returncode


def start_worker(name: str, *extra: str, slots: str = SLOTS, lease: str = LEASE, wait_s: float = 30.0,
                 env: dict[str, str] | None = None) -> WorkerProc:
    """Start a worker and wait until its socket exists; fail with its stderr if it exits first."""
    args = [sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--slots", slots, "--lease", lease,
            "--backend", "numpy", "--no-mlock", "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    w = WorkerProc(name, proc, args)
    # the worker prints one "ready" line on stdout once it serves
    line = proc.stdout.readline() if proc.stdout else ""
    if "ready" not in line or not socket_path(name).exists():
        proc.kill()
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"worker {name} did not start: {line}{out}{err}")
    w.ready_line = line
    return w


@pytest.fixture
def worker(worker_name: str) -> Iterator[WorkerProc]:
    """A NumPy-backend worker for this test, stopped with SIGTERM afterwards (must exit 0)."""
    w = start_worker(worker_name)
    yield w
    rc = w.stop()
    assert rc == 0, w.stderr


@pytest.fixture
def spawn_worker(worker_name: str) -> Iterator[Callable[..., WorkerProc]]:
    """Start workers with custom options; all are killed at the end."""
    started: list[WorkerProc] = []

    def spawn(*extra: str, name: str | None = None, **kw: Any) -> WorkerProc:
        w = start_worker(name or worker_name, *extra, **kw)
        started.append(w)
        return w

    yield spawn
    for w in started:
        w.stop(signal.SIGTERM)
