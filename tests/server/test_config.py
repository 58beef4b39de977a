"""WorkerConfig and `shmrpc serve` argument checks: a bad value is a ValueError naming its option."""

from __future__ import annotations

import pytest

from shmrpc.server.cli import main
from shmrpc.server.config import WorkerConfig


@pytest.mark.parametrize(("kw", "option"), [
    ({"spin_us": -1}, "--spin-us"), ({"spin_us": 2_000_000}, "--spin-us"), ({"threads": 0}, "--threads"),
    ({"backend": "tpu"}, "--backend"), ({"isolation": "none"}, "--isolation"),
])
def test_bad_values_name_their_option(kw: dict[str, object], option: str) -> None:
    with pytest.raises(ValueError, match=option):
        WorkerConfig(name="cfgtest", **kw)  # type: ignore[arg-type]


def test_spin_default_off_and_accepted() -> None:
    assert WorkerConfig(name="cfgtest").spin_us == 0
    assert WorkerConfig(name="cfgtest", spin_us=250).spin_us == 250


def test_serve_refuses_a_bad_spin_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--name", "cfgtest", "--spin-us", "-5"]) == 2
    assert "--spin-us" in capsys.readouterr().err
