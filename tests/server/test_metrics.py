"""Metrics: observe, scrape over HTTP, snapshot, shutdown frees the port."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from shmrpc.server.metrics import Metrics


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_observe_scrape_shutdown() -> None:
    m = Metrics()
    m.observe("matmul", "ok", 0.003, 1000, 500, {"queue": 1e-5, "kernel": 0.002})
    m.observe("matmul", "ok", 0.004, 1000, 500)
    m.observe("add", "KernelError", 0.0001, 10, 0)
    m.slots_leased.set(5)
    m.clients.set(2)
    m.serve(0)
    try:
        assert m.port
        text = _scrape(m.port)
    finally:
        port = m.port
        m.shutdown()
    assert 'shmrpc_requests_total{op="matmul",status="ok"} 2.0' in text
    assert 'shmrpc_requests_total{op="add",status="KernelError"} 1.0' in text
    assert 'shmrpc_request_duration_seconds_count{op="matmul"} 2.0' in text
    assert 'shmrpc_request_duration_seconds_bucket{le="1e-05",op="matmul"}' in text
    assert 'shmrpc_stage_seconds_count{op="matmul",stage="kernel"} 1.0' in text
    assert "shmrpc_bytes_in_total 2010.0" in text
    assert "shmrpc_bytes_out_total 1000.0" in text
    assert "shmrpc_slots_leased 5.0" in text
    assert "shmrpc_clients_connected 2.0" in text
    for name in ("shmrpc_requests_in_flight", "shmrpc_gpu_memory_bytes", "shmrpc_resident_bytes"):
        assert name in text
    assert m.port is None
    with socket.socket() as s, pytest.raises(ConnectionRefusedError):  # nobody listens any more
        s.connect(("127.0.0.1", port))
    m.shutdown()  # idempotent


def test_fixed_port_and_double_serve(free_port: int) -> None:
    m = Metrics()
    m.serve(free_port)
    try:
        assert m.port == free_port
        assert "# TYPE shmrpc_requests_total counter" in _scrape(free_port)
        with pytest.raises(RuntimeError, match="already served"):
            m.serve(0)
    finally:
        m.shutdown()


def test_snapshot_and_independent_registries() -> None:
    a, b = Metrics(), Metrics()
    a.observe("matmul", "ok", 0.5, 64, 32)
    a.inflight.inc()
    snap = a.snapshot()
    assert snap["requests"] == {"matmul": {"ok": 1}}
    assert snap["duration"]["matmul"]["count"] == 1
    assert snap["duration"]["matmul"]["sum_s"] == pytest.approx(0.5)
    assert snap["bytes_in"] == 64 and snap["bytes_out"] == 32
    assert snap["inflight"] == 1
    assert snap["slots_leased"] == 0
    assert b.snapshot()["requests"] == {}


def test_histograms_match_prometheus_client() -> None:
    """The lock-free request histograms expose what prometheus_client's own Histogram would."""
    import random

    from prometheus_client import CollectorRegistry, Histogram

    from shmrpc.server.metrics import DURATION_BUCKETS_S

    rng = random.Random(7)
    values = [10 ** rng.uniform(-6, 1.5) for _ in range(2000)] + list(DURATION_BUCKETS_S)  # bounds themselves too
    ref_registry = CollectorRegistry()
    ref = Histogram("shmrpc_request_duration_seconds", "ref", ["op"], buckets=DURATION_BUCKETS_S,
                    registry=ref_registry)
    m = Metrics()
    for v in values:
        ref.labels("echo").observe(v)
        m.observe("echo", "ok", v, 0, 0, {"kernel": v})

    def samples(registry: CollectorRegistry, family: str) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels.get("le", "")): s.value for f in registry.collect() if f.name == family
                for s in f.samples if not s.name.endswith("_created")}

    want = samples(ref_registry, "shmrpc_request_duration_seconds")
    got = samples(m.registry, "shmrpc_request_duration_seconds")
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k
    stage = samples(m.registry, "shmrpc_stage_seconds")
    assert {le: v for (name, le), v in stage.items() if name.endswith("_bucket")} == \
        {le: v for (name, le), v in want.items() if name.endswith("_bucket")}


def test_a_fold_of_interleaved_ops_keeps_each_op_apart() -> None:
    # the fold looks an op label's numbers up again only when the label changes: labels, statuses, budgets and
    # stages interleaved at random must each land in their own op's counts (a fold mid-way too)
    import random

    m = Metrics()
    m.set_budgets(0.0, {"scale": 0.01})
    rng = random.Random(11)
    requests: dict[str, dict[str, int]] = {}
    count: dict[str, int] = {}
    total: dict[str, float] = {}
    over: dict[str, int] = {}
    for i in range(600):
        op, status = rng.choice(["echo", "scale", "gemm"]), rng.choice(["ok", "KernelError"])
        v = 10 ** rng.uniform(-4, -1)
        stages = {"h2d": 0.0, "kernel": v / 2, "total": v / 3} if i % 3 else None
        m.observe(op, status, v, 3, 5, stages)
        requests.setdefault(op, {})[status] = requests.get(op, {}).get(status, 0) + 1
        count[op] = count.get(op, 0) + 1
        total[op] = total.get(op, 0.0) + v
        if op == "scale" and (v / 3 if stages else v) > 0.01:
            over[op] = over.get(op, 0) + 1
        if i == 300:
            m.fold()
    snap = m.snapshot()
    assert snap["requests"] == requests
    assert {op: d["count"] for op, d in snap["duration"].items()} == count
    assert {op: d["sum_s"] for op, d in snap["duration"].items()} == pytest.approx(total)
    assert snap["over_budget"] == over and over["scale"] > 0
    assert snap["bytes_in"] == 3 * 600 and snap["bytes_out"] == 5 * 600


def test_a_fold_of_many_counts_what_folds_of_few_count() -> None:
    # a fold of many observations counts the buckets with NumPy, one of few observation by observation: the same
    # observations (bucket bounds themselves, zero and missing stages, statuses, two ops, a budget) give the same
    # families either way
    import random

    from shmrpc.server import metrics as metrics_mod
    from shmrpc.server.metrics import DURATION_BUCKETS_S

    rng = random.Random(5)
    obs = []
    for i in range(400):
        v = DURATION_BUCKETS_S[i % len(DURATION_BUCKETS_S)] if i % 4 == 0 else 10 ** rng.uniform(-6, 1)
        stages = None if i % 5 == 0 else {"h2d": 0.0, "kernel": v / 2, "queue": v / 7 if i % 2 else 0.0, "total": v}
        obs.append(("echo" if i % 3 else "scale", "ok" if i % 7 else "KernelError", v, i, 2 * i, stages))
    few, many = Metrics(), Metrics()
    for m in (few, many):
        m.set_budgets(0.0, {"scale": 0.05})
    for i, o in enumerate(obs):
        few.observe(*o)
        if i % (metrics_mod._MANY - 1) == 0:
            few.fold()  # never as many as _MANY queued
        many.observe(*o)
    few.fold()
    many.fold()
    assert not few._stats.queued and not many._stats.queued

    def families(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in m.registry.collect()
                for s in f.samples if not s.name.endswith("_created") and s.name.startswith("shmrpc_")}

    got_few, got_many = families(few), families(many)
    assert got_few.keys() == got_many.keys()
    for k, v in got_few.items():
        if k[0].endswith("_sum"):
            assert got_many[k] == pytest.approx(v, rel=1e-12), k
        else:
            assert got_many[k] == v, k
    assert got_many[("shmrpc_over_budget_total", (("op", "scale"),))] > 0
    assert any(k[0] == "shmrpc_stage_seconds_count" and ("stage", "queue") in k[1] for k in got_many)


def test_the_endpoint_bounds_its_connections_in_number_and_time() -> None:
    """Idle connections (sending nothing) once held a thread and an fd each, for good: now at most max_connections are
    open, one more is closed at once, each is closed at its deadline, and a scrape gets through again after it."""
    from shmrpc.server import _http

    m = Metrics()
    m.serve(0)
    assert m._server is not None and m.port is not None
    srv = m._server._server
    srv.max_connections, srv.conn_timeout_s = 4, 1.0
    idle = [socket.create_connection(("127.0.0.1", m.port), timeout=5) for _ in range(4)]
    try:
        deadline = time.monotonic() + 5
        while srv.n_open < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.n_open == 4
        extra = socket.create_connection(("127.0.0.1", m.port), timeout=5)
        with extra:  # closed at once, unanswered
            assert extra.recv(1) == b""
        assert srv.refused == 1
        t0 = time.monotonic()
        for s in idle:  # each is ended by the server at its deadline
            assert s.recv(1) == b""
        assert time.monotonic() - t0 < 3
        deadline = time.monotonic() + 5
        while srv.n_open and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.n_open == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{m.port}/metrics", timeout=5) as r:
            assert r.status == 200
    finally:
        for s in idle:
            s.close()
        m.shutdown()
    assert _http.MAX_CONNECTIONS < _http.FD_RESERVE


def test_the_endpoint_takes_none_of_the_last_fds() -> None:
    """A connection that would leave the process fewer than fd_reserve fds is closed at once."""
    import resource

    m = Metrics()
    m.serve(0)
    assert m._server is not None and m.port is not None
    srv = m._server._server
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    srv.fd_reserve = soft  # no room left as far as the endpoint is concerned
    try:
        with socket.create_connection(("127.0.0.1", m.port), timeout=5) as s:
            assert s.recv(1) == b""
        assert srv.refused == 1
        srv.fd_reserve = 0
        with urllib.request.urlopen(f"http://127.0.0.1:{m.port}/healthz", timeout=5) as r:
            assert r.status == 200
    finally:
        m.shutdown()
