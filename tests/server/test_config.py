"""WorkerConfig and `shmrpc serve` argument checks: a bad value is a ValueError naming its option."""

from __future__ import annotations

import pytest

from shmrpc.server.cli import main
from shmrpc.server.config import WorkerConfig


@pytest.mark.parametrize(("kw", "option"), [
    ({"spin_us": -1}, "--spin-us"), ({"spin_us": 2_000_000}, "--spin-us"), ({"threads": 0}, "--threads"),
    ({"backend": "tpu"}, "--backend"), ({"isolation": "none"}, "--isolation"),
    ({"max_clients": -1}, "--max-clients"), ({"max_clients_per_uid": -1}, "--max-clients-per-uid"),
    ({"request_memory_limit_bytes": -1}, "--request-memory-limit"), ({"inline_max_flops": -1}, "--inline-max-flops"),
    ({"client_max_waiters": -1}, "--client-max-waiters"),
    ({"lane_linger_us": -1}, "--lane-linger-us"), ({"lane_linger_us": 20_000}, "--lane-linger-us"),
    ({"io_threads": 0}, "--io-threads"), ({"io_threads": 65}, "--io-threads"),
])
def test_bad_values_name_their_option(kw: dict[str, object], option: str) -> None:
    with pytest.raises(ValueError, match=option):
        WorkerConfig(name="cfgtest", **kw)  # type: ignore[arg-type]


def test_spin_default_off_and_accepted() -> None:
    assert WorkerConfig(name="cfgtest").spin_us == 0
    assert WorkerConfig(name="cfgtest", spin_us=250).spin_us == 250


def test_lane_linger_default_is_the_protocols_and_zero_turns_it_off() -> None:
    from shmrpc.schema.lane import LINGER_NS

    assert WorkerConfig(name="cfgtest").lane_linger_us * 1000 == LINGER_NS > 0
    assert WorkerConfig(name="cfgtest", lane_linger_us=0).lane_linger_us == 0


def test_serve_refuses_a_bad_spin_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--name", "cfgtest", "--spin-us", "-5"]) == 2
    assert "--spin-us" in capsys.readouterr().err


def test_serve_refuses_no_io_thread_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--name", "cfgtest", "--io-threads", "0"]) == 2
    assert "--io-threads" in capsys.readouterr().err


def test_lease_max_is_cut_to_the_classes_and_never_below_the_lease() -> None:
    from shmrpc.schema.layout import parse_geometry

    cfg = WorkerConfig(name="cfgtest", geometry=parse_geometry("64K:8,8M:6"), lease=(4, 3))
    assert cfg.lease_max == (4, 3)  # the default 4,2,1,1,0 cut to two classes, raised to the lease
    assert WorkerConfig(name="cfgtest").private_geometry().region_nbytes == 4096 + 4 * (64 << 10) + 2 * (1 << 20)


def test_serve_bound_flags_reach_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--name", "cfgtest", "--request-memory-limit", "lots"]) == 2
    assert "not a size" in capsys.readouterr().err
