"""The statistics, size lists and slot planning of ``shmrpc bench`` (no processes, no timings)."""

from __future__ import annotations

import numpy as np
import pytest

from shmrpc.bench import bandwidth_stats, latency_stats, parse_sizes, size_sweep
from shmrpc.bench._shm import plan_slots, request_nbytes
from shmrpc.bench._stats import iters_for_size, size_label
from shmrpc.schema.layout import parse_geometry


def test_latency_stats_match_numpy_percentiles() -> None:
    rng = np.random.default_rng(1234)
    samples_ns = rng.integers(20_000, 5_000_000, size=10_007)
    s = latency_stats(samples_ns)
    us = samples_ns / 1e3
    assert s.iterations == samples_ns.size
    assert s.t_min_us == pytest.approx(us.min())
    assert s.max_us == pytest.approx(us.max())
    assert s.mean_us == pytest.approx(us.mean())
    assert s.stdev_us == pytest.approx(us.std(ddof=1))
    for field, q in (("p50_us", 50), ("p90_us", 90), ("p99_us", 99), ("p999_us", 99.9)):
        assert getattr(s, field) == pytest.approx(np.percentile(us, q))


def test_latency_stats_known_values() -> None:
    s = latency_stats(list(range(1000, 101_000, 1000)))  # 1..100 µs
    assert s.p50_us == pytest.approx(50.5)
    assert s.t_min_us == 1.0 and s.max_us == 100.0
    one = latency_stats([7000])
    assert one.p50_us == one.p999_us == 7.0 and one.stdev_us == 0.0
    with pytest.raises(ValueError):
        latency_stats([])


def test_latency_stats_json_is_flat_numbers() -> None:
    d = latency_stats([1000, 2000, 3000]).to_json()
    assert set(d) == {"iterations", "t_min_us", "p50_us", "p90_us", "p99_us", "p999_us", "max_us", "mean_us",
                      "stdev_us"}
    assert all(isinstance(v, (int, float)) for v in d.values())


def test_bandwidth_definitions() -> None:
    b = bandwidth_stats(nbytes=1_000_000, messages=500, window=4, elapsed_s=0.25)
    assert b.msgs_per_s == pytest.approx(2000)
    assert b.one_dir_gbps == pytest.approx(2.0)  # 1e6 B x 2000/s
    assert b.both_dir_gbps == pytest.approx(4.0)


def test_parse_sizes_and_sweep() -> None:
    assert parse_sizes("64,4K,1M,64M") == [64, 4096, 1 << 20, 64 << 20]
    assert parse_sizes("1M, 64 ,64") == [64, 1 << 20]
    with pytest.raises(ValueError):
        parse_sizes("12Q")
    assert size_sweep(64, 1024) == [64, 128, 256, 512, 1024]
    assert size_sweep(100, 1000) == [128, 256, 512]
    assert size_sweep(64, 256 << 20)[-1] == 256 << 20 and len(size_sweep(64, 256 << 20)) == 23
    with pytest.raises(ValueError):
        size_sweep(2048, 64)


def test_iters_for_size_budget() -> None:
    assert iters_for_size(64, 1000, 2 << 30) == 1000
    assert iters_for_size(256 << 20, 1000, 2 << 30) == 8
    assert iters_for_size(1 << 30, 1000, 1 << 20) == 5  # never below min_iters
    assert iters_for_size(1 << 30, 3, 1 << 20) == 3  # nor above iters


def test_size_label() -> None:
    assert [size_label(n) for n in (64, 4096, 1 << 20, 256 << 20, 1000)] == ["64B", "4K", "1M", "256M", "1000B"]


@pytest.mark.parametrize("clients", [1, 8])
def test_slot_plan_fits_every_size(clients: int) -> None:
    sizes = size_sweep(64, 256 << 20)
    plan = plan_slots(sizes, window=4, clients=clients)
    geo = parse_geometry(plan.slots)
    assert geo.region_nbytes == plan.region_nbytes
    lease = [int(x) for x in plan.lease.split(",")]
    assert len(lease) == len(geo.classes)
    for c, n in zip(geo.classes, lease):
        assert n * clients <= c.n_slots
    for n in sizes:
        assert request_nbytes(n) <= geo.max_slot_nbytes
        assert 1 <= plan.window_for(n) <= 4
    assert plan_slots([64, 1 << 20], 4, 1).slots == "64K:4,4M:4"


def test_slots_are_sized_for_every_input_of_the_op() -> None:
    from shmrpc.bench._shm import tensors_of

    assert tensors_of("vector_add") == 4 and tensors_of("echo") == 2 and tensors_of("no_such_op") == 2
    one_mib = 1 << 20
    assert request_nbytes(one_mib, 3) == request_nbytes(one_mib, 2) + one_mib
    plan = plan_slots([one_mib], window=1, clients=1, tensors=3)
    assert plan.window_for(one_mib) == 1 and plan.slots == "4M:1"
