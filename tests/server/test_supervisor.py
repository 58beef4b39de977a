"""``serve --device`` / ``--devices`` argument handling and the supervisor's bounded stop (the supervisor with
real workers runs in tests/e2e/test_pool.py)."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import threading
import time

import pytest

from shmrpc.schema.naming import device_worker_name, device_workers
from shmrpc.server._supervisor import Supervisor, parse_devices, visible_devices
from shmrpc.server.cli import main


def test_parse_devices() -> None:
    assert parse_devices("0,1") == [0, 1]
    assert parse_devices(" 3 ") == [3]
    for bad in ("", "0,0", "-1", "a"):
        with pytest.raises(ValueError, match="--devices"):
            parse_devices(bad)


def test_devices_all_without_a_gpu_is_an_error_naming_the_remedy() -> None:
    if visible_devices():
        pytest.skip("this host has GPUs")
    with pytest.raises(ValueError, match="name devices, e.g. 0,1"):
        parse_devices("all")


@pytest.mark.parametrize("argv", [
    ["serve", "--name", "x", "--devices", "0,0"],
    ["serve", "--name", "x", "--devices", "0,1", "--device", "1"],
    ["serve", "--name", "x", "--device", "-1"],
])
def test_bad_device_arguments_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("shmrpc serve:") and "device" in err


def test_device_worker_names(worker_name: str) -> None:
    assert device_worker_name(worker_name, 3) == f"{worker_name}-3"
    assert device_workers(worker_name) == []
    with pytest.raises(ValueError):
        device_worker_name("-bad", 0)


@pytest.mark.timeout(30)
def test_shutdown_kills_workers_that_ignore_sigterm_after_stop_timeout(worker_name: str,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    sup = Supervisor(worker_name, [0, 1], [], stop_timeout_s=0.5)
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('deaf', flush=True); time.sleep(30)"
    procs = [subprocess.Popen([sys.executable, "-c", deaf], stdout=subprocess.PIPE, text=True) for _ in sup.children]
    try:
        for ch, p in zip(sup.children, procs):
            assert p.stdout is not None and p.stdout.readline() == "deaf\n"  # SIGTERM is ignored from here on
            ch.proc = p
        t0 = time.monotonic()
        assert sup._shutdown() == 0
        assert time.monotonic() - t0 < 5.0  # 0.5 s for SIGTERM, then SIGKILL: not 0.5 s per worker plus 5 s each
        assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2
        assert capsys.readouterr().err.count("after SIGTERM; killing it") == 2
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=5)


@pytest.mark.timeout(30)
def test_a_workers_ready_line_is_passed_on_before_it_counts_as_ready(worker_name: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """run() prints the supervisor's ready line once every worker is ready: each worker's own line must be out by then."""
    sup = Supervisor(worker_name, [0], [])
    ch = sup.children[0]
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    seen_at_ready: list[str] = []

    class _Ready(threading.Event):
        def set(self) -> None:
            seen_at_ready.append(out.getvalue())
            super().set()

    ch.ready = _Ready()
    lines = ["loading the model: ready soon\n", f"shmrpc worker {ch.name} ready (pid 1, backend numpy)\n", "after\n"]
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdout.write({''.join(lines)!r})"],
                            stdout=subprocess.PIPE, text=True)
    try:
        sup._relay(ch, proc)  # returns at the worker's EOF
    finally:
        proc.wait(timeout=10)
    assert out.getvalue() == "".join(f"[{ch.name}] {line}" for line in lines)
    # set once, by the worker's own ready line (not by another line saying "ready"), after that line was printed
    assert seen_at_ready == [f"[{ch.name}] {lines[0]}[{ch.name}] {lines[1]}"]
