"""A whole run with small sizes: the JSON document's schema, the tables, the verdicts and the plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shmrpc.bench import RunConfig, finish_document, main, run_benchmark, write_json, write_plots
from shmrpc.bench._report import MIN_VERDICT_SAMPLES, bandwidth_table, latency_table, scaling_table, verdicts

SIZES = [64, 4096, 1 << 20]
LAT_KEYS = {"iterations", "t_min_us", "p50_us", "p90_us", "p99_us", "p999_us", "max_us", "mean_us", "stdev_us"}
BW_KEYS = {"nbytes", "messages", "window", "elapsed_s", "msgs_per_s", "one_dir_gbps", "both_dir_gbps"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(mode: str, **kw: Any) -> dict[str, Any]:
    cfg = RunConfig(mode=mode, sizes=SIZES, iters=10, warmup=2, transports=["shmrpc", "zmq", "pipe"], name="stub",
                    **kw)
    return finish_document(run_benchmark(cfg, quiet=True, log=lambda s: None), ["shmrpc", "bench", mode])


def _check_common(doc: dict[str, Any], mode: str) -> None:
    doc = json.loads(json.dumps(doc))  # JSON-serialisable, and checked as read back
    assert doc["schema"] == "shmrpc-bench/1" and doc["mode"] == mode
    assert isinstance(doc["date"], str) and doc["command"] == f"shmrpc bench {mode}"
    m = doc["machine"]
    for key, typ in (("cpu_model", str), ("cores", int), ("python", str), ("packages", dict), ("gpus", list)):
        assert isinstance(m[key], typ), key
    assert "numpy" in m["packages"] and "pyzmq" in m["packages"]
    assert doc["config"]["sizes"] == SIZES
    assert set(doc["transports"]) == {"shmrpc", "zmq", "pipe"}
    assert all(v["status"] == "ok" and isinstance(v["label"], str) for v in doc["transports"].values())
    pairs = [(r["transport"], r["nbytes"]) for r in doc["results"]]
    assert sorted(pairs) == sorted((k, n) for k in ("shmrpc", "zmq", "pipe") for n in SIZES)  # one per pair
    assert not any("error" in r for r in doc["results"])


@pytest.mark.timeout(60)
def test_latency_document(stub_shmrpc: type, tmp_path: Path) -> None:
    doc = _run("lat")
    _check_common(doc, "lat")
    for r in doc["results"]:
        assert set(r["latency"]) == LAT_KEYS
        assert r["latency"]["iterations"] == 10
        assert all(isinstance(v, (int, float)) for v in r["latency"].values())
        assert r["latency"]["t_min_us"] <= r["latency"]["p50_us"] <= r["latency"]["p99_us"] <= r["latency"]["max_us"]
    v = verdicts(doc)  # 10 round trips per point: no verdict rests on so few
    assert len(v) == 3 and all(x["status"] == "N/A" and "too few samples" in x["detail"] for x in v)
    for r in doc["results"]:  # a large size cut to a few round trips leaves the goals of the others judged
        r["latency"]["iterations"] = MIN_VERDICT_SAMPLES if r["nbytes"] < 1 << 20 else 32
    v = verdicts(doc)
    assert v[0]["status"] in ("PASS", "MISS") and v[1]["status"] == "N/A"
    assert v[1]["detail"] == ("too few samples for a verdict (shmrpc at 1 MiB: 32, zmq at 1 MiB: 32, pipe at 1 MiB: 32 "
                              f"round trips; at least {MIN_VERDICT_SAMPLES} needed: raise --iters, or --bytes-budget "
                              "for the large sizes)")
    for r in doc["results"]:
        r["latency"]["iterations"] = MIN_VERDICT_SAMPLES
    v = verdicts(doc)
    assert [x["status"] for x in v][:2] != ["N/A", "N/A"]
    assert all(x["status"] in ("PASS", "MISS", "N/A") for x in v)
    assert v[2]["status"] == "N/A"  # no 64 MiB in this run
    assert "p50/shm" in latency_table(doc) and "loopback stub" in latency_table(doc)
    path = write_json(doc, tmp_path / "out" / "lat.json")
    assert json.loads(path.read_text())["results"] == doc["results"]
    pngs = write_plots(doc, tmp_path / "plots")
    assert [p.name for p in pngs] == ["lat-latency.png"]
    assert all(p.stat().st_size > 1000 and p.read_bytes()[:8] == PNG_MAGIC for p in pngs)


@pytest.mark.timeout(60)
def test_bandwidth_document_with_clients(stub_shmrpc: type, tmp_path: Path) -> None:
    doc = _run("bw", window=3, clients=[1, 2], clients_max_nbytes=64)
    _check_common(doc, "bw")
    for r in doc["results"]:
        assert set(r["bandwidth"]) == BW_KEYS
        assert r["bandwidth"]["window"] == 3 and r["bandwidth"]["nbytes"] == r["nbytes"]
        assert r["bandwidth"]["both_dir_gbps"] == pytest.approx(2 * r["bandwidth"]["one_dir_gbps"])
    assert verdicts(doc) == []
    # the stub lives in this process only, so the client sweep runs the real peers
    scaling = [p for p in doc["scaling"] if p["transport"] != "shmrpc"]
    assert sorted((p["transport"], p["clients"]) for p in scaling) == [("pipe", 1), ("pipe", 2), ("zmq", 1),
                                                                         ("zmq", 2)]
    for p in scaling:
        assert "error" not in p, p
        assert p["nbytes"] == 64 and len(p["per_client_p99_us"]) == p["clients"] and p["calls_per_s"] > 0
    assert "GB/s both" in bandwidth_table(doc) and "requests/s" in scaling_table(doc)
    pngs = write_plots(doc, tmp_path)
    assert sorted(p.name for p in pngs) == ["bw-bandwidth.png", "bw-scaling.png"]
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in pngs)


def test_missing_peer_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "grpc" else real(name, *a))
    doc = run_benchmark(RunConfig(sizes=[64], iters=3, warmup=0, transports=["grpc"]), quiet=True,
                        log=lambda s: None)
    assert doc["transports"]["grpc"]["status"] == "skipped"
    assert "grpcio" in doc["transports"]["grpc"]["reason"] or "grpc" in doc["transports"]["grpc"]["reason"]
    assert doc["results"] == []


@pytest.mark.timeout(60)
def test_cli_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = main(["lat", "--sizes", "64,4K", "--iters", "5", "--warmup", "1", "--transports", "zmq", "--out", str(out),
               "--plots", str(tmp_path / "p"), "-q"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "pyzmq DEALER/ROUTER ipc" in text and "N/A" in text and str(out) in text
    doc = json.loads(out.read_text())
    assert doc["command"].endswith("--plots " + str(tmp_path / "p") + " -q")
    assert len(doc["results"]) == 2
    assert (tmp_path / "p" / "lat-latency.png").stat().st_size > 1000


def test_cli_rejects_unknown_transport(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lat", "--transports", "carrier-pigeon"]) == 2
    err = capsys.readouterr().err
    assert "carrier-pigeon" in err and len(err.strip().splitlines()) == 1


def test_commit_from_env_first_then_git(monkeypatch: pytest.MonkeyPatch) -> None:
    from shmrpc.bench import _report

    real = _report._run
    git = {"head": "feedbeef"}
    monkeypatch.setattr(_report, "_run", lambda argv, *a: git["head"] if argv[0] == "git" else real(argv, *a))
    monkeypatch.setenv("SHMRPC_COMMIT", "0123abc")
    assert _report.machine_facts()["git_commit"] == "0123abc"  # a copied tree's .git may be of another commit
    monkeypatch.delenv("SHMRPC_COMMIT")
    assert _report.machine_facts()["git_commit"] == "feedbeef"
    git["head"] = None
    assert _report.machine_facts()["git_commit"] is None


def test_the_sweep_verdict_reads_8_clients_of_the_smallest_request() -> None:
    from shmrpc.bench._report import scaling_verdicts

    def pt(key: str, clients: int, rate: float, nbytes: int = 64) -> dict[str, object]:
        return {"transport": key, "clients": clients, "nbytes": nbytes, "calls_per_s": rate}

    doc = {"mode": "lat", "scaling": [pt("shmrpc", 8, 30_000), pt("shmrpc-lane", 8, 41_000), pt("zmq", 8, 90_000),
                                      pt("shmrpc", 8, 99_000, nbytes=4096), pt("shmrpc", 4, 50_000)]}
    (v,) = scaling_verdicts(doc)
    assert v["status"] == "PASS" and "shmrpc-lane 41000" in v["detail"] and v["requests_per_s"] == 41_000
    doc["scaling"] = [pt("shmrpc", 8, 30_000), pt("zmq", 8, 90_000)]
    assert scaling_verdicts(doc)[0]["status"] == "MISS"  # a peer's figure never passes it
    doc["scaling"] = [pt("shmrpc", 4, 30_000)]
    assert scaling_verdicts(doc)[0]["status"] == "N/A"
    assert scaling_verdicts({"mode": "lat", "scaling": []}) == []


def test_the_async_table_marks_figures_a_row_has_no_phase_for() -> None:
    from shmrpc.bench._concurrency import async_table

    table = async_table({"results": [
        {"nbytes": 64, "transport": "pyzmq", "rtt_us": {"p50": 10.0, "p99": 20.0}},
        {"nbytes": 64, "transport": "shmrpc", "rtt_us": {"p50": 12.0, "p99": 25.0}, "calls_per_s": 1000.0,
         "in_flight": 8, "loop_lag_us": {"p99": 3.0, "max": 9.0}}]})
    rows = table.splitlines()[2:]
    assert "nan" not in table
    assert rows[0].split()[4:] == ["-", "-", "-", "-"]
    assert rows[1].split()[4:] == ["1000", "8", "3.0", "9.0"]


@pytest.mark.timeout(60)
def test_ctrl_c_mid_transport_keeps_its_finished_sizes(stub_shmrpc: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport a Ctrl-C cuts short keeps the sizes it finished, in ``transports`` and in the table (they were
    in ``results`` only); the transports it never reached are named as not measured."""
    from shmrpc.bench import _session

    real = _session._measure_size

    def measure(t: Any, key: str, nbytes: int, cfg: RunConfig, window: int) -> dict[str, Any]:
        if nbytes == 1 << 20:
            raise KeyboardInterrupt  # what Ctrl-C does in the middle of this size
        return real(t, key, nbytes, cfg, window)

    monkeypatch.setattr(_session, "_measure_size", measure)
    cfg = RunConfig(sizes=SIZES, iters=5, warmup=1, transports=["shmrpc", "own"], name="stub", backend="numpy")
    doc = run_benchmark(cfg, quiet=True, log=lambda s: None)
    assert doc["interrupted"] is True
    assert [(r["transport"], r["nbytes"]) for r in doc["results"]] == [("shmrpc", 64), ("shmrpc", 4096)]
    assert doc["transports"]["shmrpc"]["status"] == "ok"
    assert doc["transports"]["own"] == {"label": "own backend, no server", "status": "skipped",
                                        "reason": "not measured: the run was interrupted"}
    rows = [ln for ln in latency_table(doc).splitlines() if "loopback stub" in ln]
    assert [ln.split()[0] for ln in rows] == ["64B", "4K"]


@pytest.mark.timeout(30)
def test_the_async_load_counts_the_calls_made_and_refuses_no_task() -> None:
    """``--total`` below ``--in-flight`` counted ``in_flight`` calls, never made (calls/s inflated); an ``in_flight``
    below 1 waited forever for the tasks to start."""
    import asyncio

    from shmrpc.bench._concurrency import _loaded

    made = [0]

    async def call() -> None:
        made[0] += 1
        await asyncio.sleep(0.001)

    r = asyncio.run(_loaded(call, in_flight=100, total=10))
    assert made[0] == 10 and r["calls"] == 10 and r["in_flight"] == 10
    made[0] = 0
    r = asyncio.run(_loaded(call, in_flight=4, total=50))
    assert made[0] == 50 and r["calls"] == 50 and r["in_flight"] == 4
    for in_flight, total in ((0, 10), (-1, 10), (4, 0)):
        with pytest.raises(ValueError, match="must be >= 1"):
            asyncio.run(asyncio.wait_for(_loaded(call, in_flight=in_flight, total=total), 3))


@pytest.mark.parametrize("mode", ["lat", "threads"])
def test_the_load_average_is_the_one_at_the_start(mode: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``machine.loadavg`` was read after the measurements, so it held the run's own load (the docs: "at the start")."""
    import os

    from shmrpc.bench import _concurrency, _session

    phase = ["start"]
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 2.0, 3.0) if phase[0] == "start" else (99.0, 99.0, 99.0))

    def run(*a: Any, **kw: Any) -> dict[str, Any]:  # stands for the measurements, during which the load changes
        phase[0] = "after"
        return {"schema": "shmrpc-bench/1", "mode": mode, "date": "x", "config": {"sizes": [64], "spin_us": 0,
                "op": "echo"}, "transports": {}, "results": [], "scaling": [], "worker": {}}

    monkeypatch.setattr(_session, "run_benchmark", run)
    monkeypatch.setattr(_concurrency, "run_threads", run)
    monkeypatch.setattr(_concurrency, "threads_table", lambda doc: "")
    out = tmp_path / "r.json"
    main([mode, "--sizes", "64", "--transports", "zmq", "-q", "--out", str(out)])
    assert json.loads(out.read_text())["machine"]["loadavg"] == [1.0, 2.0, 3.0]


def test_the_connect_goal_needs_as_many_samples_as_the_others() -> None:
    # it was judged from any number of connects, 1 included, where every other p50 needs 100
    from shmrpc.bench._report import latency_verdicts

    def connect_verdict(iterations: int) -> dict[str, Any]:
        doc = {"mode": "lat", "results": [], "config": {"sizes": [64]},
               "connect": {"iterations": iterations, "p50_us": 3000.0}}
        return next(v for v in latency_verdicts(doc) if v["goal"].startswith("connect"))

    assert connect_verdict(1)["status"] == "N/A" and "too few samples" in connect_verdict(1)["detail"]
    assert connect_verdict(MIN_VERDICT_SAMPLES - 1)["status"] == "N/A"
    assert connect_verdict(MIN_VERDICT_SAMPLES)["status"] == "PASS"


def test_the_bandwidth_plot_draws_only_transports_with_gbps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loan re-sent to echo has no GB/s: alone it gave an empty bandwidth plot, next to others a legend entry for a
    line not drawn."""
    from shmrpc.bench import _plots

    def point(key: str, n: int, gbps: float | None) -> dict[str, Any]:
        return {"transport": key, "nbytes": n, "bandwidth": {"nbytes": n, "messages": 100, "window": 1,
                "elapsed_s": 0.01, "msgs_per_s": 1e4, "one_dir_gbps": gbps, "both_dir_gbps": gbps and 2 * gbps}}

    doc = {"mode": "bw", "config": {"op": "echo", "window": 4, "sizes": [64, 4096]}, "machine": {}, "scaling": [],
           "transports": {"shmrpc": {"label": "shmrpc (zero-copy loan)", "status": "ok", "method": "resend"},
                          "zmq": {"label": "pyzmq DEALER/ROUTER ipc", "status": "ok"}},
           "results": [point("shmrpc", n, None) for n in (64, 4096)]}
    assert write_plots(doc, tmp_path / "a") == []
    drawn: list[str] = []
    real = _plots._draw_bandwidth
    monkeypatch.setattr(_plots, "_draw_bandwidth", lambda ax, xs, pts, label: (drawn.append(label),
                                                                                real(ax, xs, pts, label)))
    doc["results"] += [point("zmq", n, 0.5) for n in (64, 4096)]
    assert [p.name for p in write_plots(doc, tmp_path / "b")] == ["bw-bandwidth.png"]
    assert drawn == ["pyzmq DEALER/ROUTER ipc"]


def test_ctrl_c_while_the_servers_start_keeps_the_worker_facts(stub_shmrpc: type,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # a Ctrl-C while a peer server still started (a loaded machine) gave a document without "worker"
    from shmrpc.bench import _runner

    def start(key: str) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(_runner, "start_peer_server", start)
    doc = run_benchmark(RunConfig(sizes=[64], iters=5, transports=["shmrpc", "zmq"], name="stub"), quiet=True,
                        log=lambda s: None)
    assert doc["interrupted"] is True and doc["worker"] == {"name": "stub", "started_by_bench": False}
    assert doc["results"] == [] and doc["transports"]["zmq"]["status"] == "skipped"


def test_sizes_that_are_not_whole_units_keep_every_table_aligned() -> None:
    """``1048577B`` (8 characters) in a 6-wide size column pushed its rows out of line."""
    from shmrpc.bench._concurrency import async_table, threads_table
    from shmrpc.bench._stats import latency_stats

    def widths(table: str, skip_title: bool = True) -> set[int]:
        rows = table.splitlines()[1 if skip_title else 0:]
        return {len(r) for r in rows if not set(r) <= {"-"}}

    sizes = [64, 1048577]
    label = {"zmq": {"label": "pyzmq DEALER/ROUTER ipc", "status": "ok"}}
    lat = latency_stats([50000, 60000]).to_json()
    doc = {"mode": "lat", "config": {"sizes": sizes}, "transports": label,
           "results": [{"transport": "zmq", "nbytes": n, "latency": lat} for n in sizes],
           "scaling": [{"transport": "zmq", "clients": 2, "nbytes": n, "calls_per_s": 1e4, "p50_us": 50.0,
                        "per_client_p99_us": [70.0, 80.0], "span_s": 1.0} for n in sizes]}
    assert len(widths(latency_table(doc))) == 1
    assert len(widths(scaling_table(doc))) == 1
    bw = {"nbytes": 64, "messages": 10, "window": 4, "elapsed_s": 0.01, "msgs_per_s": 1e3, "one_dir_gbps": 0.1,
          "both_dir_gbps": 0.2}
    doc = {"mode": "bw", "config": {"sizes": sizes, "op": "echo"}, "transports": label,
           "results": [{"transport": "zmq", "nbytes": n, "bandwidth": dict(bw, nbytes=n)} for n in sizes]}
    assert len(widths(bandwidth_table(doc))) == 1
    rtt = {"p50": 10.0, "p99": 20.0, "max": 30.0}
    doc = {"results": [{"nbytes": n, "transport": "shmrpc-call", "rtt_us": rtt} for n in sizes]}
    assert len(widths(async_table(doc), skip_title=False)) == 1
    doc = {"results": [{"threads": 1, "nbytes": n, "shared_client_calls_per_s": 1e3,
                        "client_per_thread_calls_per_s": 1e3, "ratio": 1.0} for n in (64, 10_000_000)]}
    assert len(widths(threads_table(doc), skip_title=False)) == 1


def test_the_verdict_lines_spell_sizes_as_the_goals_do() -> None:
    # the goals said "64 B" and "1 MiB", their details and the sweep goal "64B" and "1M"
    from shmrpc.bench._report import scaling_verdicts, verdict_lines
    from shmrpc.bench._stats import latency_stats

    few = latency_stats([50000, 60000]).to_json()
    doc: dict[str, Any] = {"mode": "lat", "config": {"sizes": [64, 1 << 20]}, "connect": {},
                           "results": [{"transport": k, "nbytes": n, "latency": few}
                                       for k in ("shmrpc", "zmq", "shmrpc-lane") for n in (64, 1 << 20)],
                           "scaling": [{"transport": "shmrpc", "clients": 8, "nbytes": 64, "calls_per_s": 5e4}]}
    doc["verdicts"] = verdicts(doc) + scaling_verdicts(doc)
    text = verdict_lines(doc)
    assert "64 B" in text and "1 MiB" in text
    assert not any(w in text for w in ("64B", "1M:", "1M ", "(64B"))
