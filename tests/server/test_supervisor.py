"""``serve --device`` / ``--devices`` argument handling and the supervisor's bounded stop (the supervisor with
real workers runs in tests/e2e/test_pool.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
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
