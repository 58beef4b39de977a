"""``serve --device`` / ``--devices`` argument handling (the supervisor itself runs in tests/e2e/test_pool.py)."""

from __future__ import annotations

import pytest

from shmrpc.schema.naming import device_worker_name, device_workers
from shmrpc.server._supervisor import parse_devices, visible_devices
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
