"""``shmrpc serve --devices all|0,1,..``: one worker per device under one name prefix, restarted when it dies.

Each worker is ``shmrpc serve --name <prefix>-<device> --device <device>`` with the
supervisor's other arguments, a child process of the supervisor. A worker that
exits while the supervisor runs is started again (after ``restart_delay_s``,
doubling up to 10 s while it keeps dying within a minute of its start); its
successor removes the dead one's sockets (the lock file says it is dead) and
clients of a :class:`~shmrpc.client.Pool` find it again by name.

SIGTERM, SIGINT or SIGHUP to the supervisor: SIGTERM to every worker (each drains and
exits), then the supervisor exits 0 once all have; what remains after
``stop_timeout_s`` (30 s) gets SIGKILL, and the supervisor waits at most
``_KILL_WAIT_S`` (5 s) more: it is gone within about 35 s of the signal, whatever
its workers do (a worker restarted as the signal came gets its SIGTERM like the others).

NOTE: the signal handler (:meth:`Supervisor.stop`) only sets a flag; the loop polls it
between short sleeps. A handler runs in the main thread between two bytecodes, so one that
took a lock (``threading.Event.set``) while the loop held the same lock inside
``Event.wait`` waited on itself forever: the supervisor then never exited.

Lines on stdout: one ``shmrpc supervisor <prefix> ready (workers ...)`` once every
worker printed its own ready line, then one per restart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from shmrpc.schema.naming import device_worker_name

__all__ = ["Supervisor", "visible_devices", "parse_devices"]

_MAX_DELAY_S = 10.0
_TICK_S = 0.1  # how often the loop looks at its workers and at the stop flag
_KILL_WAIT_S = 5.0  # after SIGKILL, how long to wait for the workers to be reaped


def visible_devices() -> list[int]:
    """The CUDA devices this process sees (``CUDA_VISIBLE_DEVICES`` respected); [] without CuPy or a GPU."""
    try:
        import cupy

        return list(range(cupy.cuda.runtime.getDeviceCount()))
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no device: none visible
        return []


def parse_devices(text: str) -> list[int]:
    """``all`` (every visible GPU) or a comma-separated list of device ordinals.

    Raises:
        ValueError: an ordinal is not a non-negative integer, is repeated, or ``all`` finds no GPU.
    """
    if text.strip() == "all":
        found = visible_devices()
        if not found:
            raise ValueError("--devices all: no GPU is visible (CuPy missing or no device); name devices, e.g. 0,1")
        return found
    try:
        devs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--devices takes 'all' or ordinals like 0,1, got {text!r}") from None
    if not devs or min(devs) < 0 or len(set(devs)) != len(devs):
        raise ValueError(f"--devices takes 'all' or distinct ordinals >= 0, got {text!r}")
    return devs


@dataclass
class _Child:
    device: int
    name: str
    proc: subprocess.Popen | None = None  # type: ignore[type-arg]
    started_at: float = 0.0
    delay_s: float = 0.0
    restarts: int = 0
    ready: threading.Event = field(default_factory=threading.Event)


class Supervisor:
    """Runs and restarts one worker per device; ``worker_args`` are the other ``serve`` arguments."""

    def __init__(self, prefix: str, devices: list[int], worker_args: list[str], *, restart_delay_s: float = 0.5,
                 stop_timeout_s: float = 30.0, metrics_port: int | None = None) -> None:
        self.prefix = prefix
        self.children = [_Child(d, device_worker_name(prefix, d)) for d in devices]
        # one port each: worker i (its place in --devices) serves its metrics on metrics_port + i (0: each its own
        # free port, as given)
        self.metrics_port = metrics_port
        self.worker_args = worker_args
        self.restart_delay_s = restart_delay_s
        self.stop_timeout_s = stop_timeout_s
        self._stopping = False  # set by the signal handler: a plain flag, never a lock (see the module docstring)
        self._relays: list[threading.Thread] = []

    def _start(self, ch: _Child) -> None:
        argv = [sys.executable, "-m", "shmrpc.server", "serve", "--name", ch.name, "--device", str(ch.device),
                *self.worker_args]
        if self.metrics_port is not None:
            port = self.metrics_port + self.children.index(ch) if self.metrics_port else 0
            argv += ["--metrics-port", str(port)]
        ch.ready.clear()
        # the worker asks the kernel for SIGTERM when this process dies (SHMRPC_SUPERVISOR_PID; cli._serve): a
        # supervisor killed outright no longer leaves its workers running, holding their names
        env = dict(os.environ, SHMRPC_SUPERVISOR_PID=str(os.getpid()))
        ch.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=env)
        ch.started_at = time.monotonic()
        relay = threading.Thread(target=self._relay, args=(ch, ch.proc), daemon=True)
        relay.start()
        self._relays = [*(t for t in self._relays if t.is_alive()), relay]

    def _relay(self, ch: _Child, proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
        """Pass the worker's stdout through, prefixed; note its ready line once it is passed on."""
        assert proc.stdout is not None
        ready = f"shmrpc worker {ch.name} ready "
        with proc.stdout:
            for line in proc.stdout:
                print(f"[{ch.name}] {line}", end="", flush=True)
                # NOTE: after the print: run() prints the supervisor's ready line once every worker's is out
                if line.startswith(ready):
                    ch.ready.set()

    def stop(self, *_: object) -> None:
        """Ask the loop to stop (the SIGTERM/SIGINT handler: sets a flag and takes no lock)."""
        self._stopping = True

    def _sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, less once stopped; returns whether the supervisor is stopping."""
        end = time.monotonic() + seconds
        while not self._stopping:
            left = end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(_TICK_S, left))
        return self._stopping

    def run(self, ready_timeout_s: float = 120.0) -> int:
        """Start every worker, print the ready line, restart the dead until stopped; returns the exit status."""
        for ch in self.children:
            self._start(ch)
        deadline = time.monotonic() + ready_timeout_s
        for ch in self.children:
            while not ch.ready.wait(_TICK_S):  # ch.ready is set by a relay thread, never by the signal handler
                if self._stopping or time.monotonic() > deadline or (ch.proc and ch.proc.poll() is not None):
                    if not self._stopping:
                        print(f"shmrpc serve: worker {ch.name} did not start", file=sys.stderr, flush=True)
                    self._shutdown()
                    return 1
        names = ", ".join(f"{ch.name} (device {ch.device}, pid {ch.proc.pid if ch.proc else '?'})"
                          for ch in self.children)
        print(f"shmrpc supervisor {self.prefix} ready (pid {os.getpid()}; workers {names})", flush=True)
        while not self._sleep(_TICK_S):
            now = time.monotonic()
            for ch in self.children:
                if ch.proc is None or ch.proc.poll() is None:
                    continue
                rc = ch.proc.returncode
                quick = now - ch.started_at < 60.0
                ch.delay_s = min(_MAX_DELAY_S, ch.delay_s * 2 if quick and ch.delay_s else self.restart_delay_s)
                print(f"shmrpc supervisor: worker {ch.name} exited ({rc}); restarting in {ch.delay_s:.1f} s",
                      flush=True)
                ch.proc = None
                if self._sleep(ch.delay_s):
                    break
                ch.restarts += 1
                self._start(ch)
        return self._shutdown()

    def _shutdown(self) -> int:
        """SIGTERM to every live worker; SIGKILL to those left after ``stop_timeout_s``; bounded. Returns 0."""
        live = [(ch.name, ch.proc) for ch in self.children if ch.proc is not None and ch.proc.poll() is None]
        for _, p in live:
            _signal(p, signal.SIGTERM)
        end = time.monotonic() + self.stop_timeout_s
        for _, p in live:
            _wait(p, end - time.monotonic())
        stuck = [(name, p) for name, p in live if p.poll() is None]
        for name, p in stuck:
            print(f"shmrpc supervisor: worker {name} (pid {p.pid}) still running {self.stop_timeout_s:.0f} s "
                  f"after SIGTERM; killing it", file=sys.stderr, flush=True)
            _signal(p, signal.SIGKILL)
        end = time.monotonic() + _KILL_WAIT_S
        for _, p in stuck:
            _wait(p, end - time.monotonic())
        for relay in self._relays:  # each ends at its worker's exit (EOF); bounded all the same
            relay.join(max(0.0, end - time.monotonic()))
        return 0


def _signal(p: subprocess.Popen, sig: int) -> None:  # type: ignore[type-arg]
    try:
        p.send_signal(sig)
    except OSError:  # reaped meanwhile
        pass


def _wait(p: subprocess.Popen, timeout_s: float) -> None:  # type: ignore[type-arg]
    try:
        p.wait(max(0.01, timeout_s))
    except subprocess.TimeoutExpired:
        pass
