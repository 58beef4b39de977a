"""The round-trip traces (bench/zmq_trace.py, bench/lane_trace.py, bench/gpu/big_trace.py on the NumPy backend's
stand-in device), the client CPU probe (bench/client_cpu.py), the client memory probe (bench/client_rss.py), the lanes' CPU probe (bench/lane_cpu.py), the metrics fold probe (bench/metrics_fold.py) and the
floors probe (bench/gpu/floor_probe.py) run end to end and write what they print.

Each starts its own worker (and, for the ZeroMQ trace, a bare pyzmq echo) in child processes over real sockets;
a short run must give every interval of both sides, each positive and shorter than its round trip, in a JSON
document with the command and the machine but no goal verdicts (``write_probe``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmrpc.bench._report import write_probe

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str, out: Path) -> dict:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"JSON: {out}" in proc.stdout
    return json.loads(out.read_text())


def _check_parts(parts: dict[str, float], total_key: str, outside: tuple[str, ...] = (),
                 handed: tuple[tuple[str, str], ...] = ()) -> None:
    """Every part positive; the parts of the round trip (all but ``outside``) no longer than it. ``handed``: (a part
    ending where one process hands over, the next part, ending in the other process): the other may run before the
    first part's stamp is taken (a sender preempted inside its send on a busy machine), so only their sum must be
    positive."""
    total = parts[total_key]
    assert total > 0
    loose = {b for _, b in handed}
    for a, b in handed:
        assert parts[a] > 0 and parts[a] + parts[b] > 0, (a, parts[a], b, parts[b])
    for name, us in parts.items():
        assert name in loose or us > 0, (name, us)
        assert name in outside or us <= total, (name, us, total)


@pytest.mark.timeout(180)
def test_zmq_trace_times_both_sides_of_both_transports(tmp_path: Path) -> None:
    doc = _run("zmq_trace.py", "--calls", "400", "--rounds", "1", out=tmp_path / "z.json")
    assert doc["mode"] == "zmq-trace" and "verdicts" not in doc and doc["command"].startswith("bench/zmq_trace.py")
    shm, echo = doc["median_us"]["shmrpc"][0], doc["median_us"]["pyzmq"][0]
    assert set(shm) == {"client: send() entry to the socket send", "client: socket send", "sent to the worker's wake-up",
                        "worker: wake-up to _on_call", "worker: _on_call to DONE sent",
                        "DONE sent to the client's receive", "client: received to send() return", "round trip"}
    assert set(echo) == {"client: socket send", "sent to the server's receive", "server: received to sent",
                         "server sent to the client's receive", "round trip"}
    _check_parts(shm, "round trip", handed=(("client: socket send", "sent to the worker's wake-up"),))
    _check_parts(echo, "round trip", handed=(("client: socket send", "sent to the server's receive"),))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("call", [False, True])
def test_lane_trace_times_the_blocking_lane(tmp_path: Path, call: bool) -> None:
    doc = _run("lane_trace.py", "--calls", "600", "--lane", "block", *(["--call"] if call else []), out=tmp_path / "l.json")
    assert doc["mode"] == "lane-trace" and doc["lane"] == "block" and doc["call"] is call and "verdicts" not in doc
    assert len(doc["median_us"]) == 8
    _check_parts(doc["median_us"], "round trip", outside=("worker: DONE written to its next wait",))


def test_write_probe_records_the_command_and_no_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = write_probe({"mode": "some-probe", "x": 1}, ["bench/some_probe.py", "--n", "3"], tmp_path / "d" / "p.json")
    doc = json.loads(out.read_text())
    assert doc["mode"] == "some-probe" and doc["x"] == 1
    assert doc["command"] == "bench/some_probe.py --n 3"
    assert "verdicts" not in doc and "machine" in doc and "date" in doc
    assert capsys.readouterr().out.strip() == f"JSON: {out}"


def test_write_probe_without_argv_records_this_processs_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bench").mkdir()
    monkeypatch.setattr("sys.argv", [str(tmp_path / "bench" / "p.py"), "--calls", "7"])
    doc = json.loads(write_probe({"mode": "some-probe"}, None, tmp_path / "p.json").read_text())
    assert doc["command"] == "bench/p.py --calls 7"  # the program's path relative to the working directory


@pytest.mark.timeout(180)
def test_client_cpu_times_the_loan_and_call_of_each_tree(tmp_path: Path) -> None:
    doc = _run("client_cpu.py", "--calls", "300", "--rounds", "2", "--tree", "a=", "--tree", "b=",
               out=tmp_path / "c.json")
    assert doc["mode"] == "client-cpu" and "verdicts" not in doc and doc["command"].startswith("bench/client_cpu.py")
    assert set(doc["runs"]) == {"a", "b"} and all(len(rs) == 2 for rs in doc["runs"].values())
    for med in doc["medians"].values():
        assert set(med) == {"loan_us", "call_us", "replay_us"}
        # both include the replay; which of the loan and call() is quicker is the benchmark's to say, not a short
        # run's on a shared machine (call()'s copies cost ~3 µs, less than such a run's spread)
        assert 0 < med["replay_us"] < min(med["loan_us"], med["call_us"]), med


@pytest.mark.timeout(180)
def test_client_rss_reads_the_memory_of_each_tree(tmp_path: Path) -> None:
    doc = _run("client_rss.py", "--calls", "300", "--rounds", "2", "--tree", "a=", "--tree", "b=", out=tmp_path / "r.json")
    assert doc["mode"] == "client-rss" and "verdicts" not in doc and doc["command"].startswith("bench/client_rss.py")
    assert set(doc["runs"]) == {"a", "b"} and all(len(rs) == 2 for rs in doc["runs"].values())
    for rs in doc["runs"].values():
        for r in rs:
            assert r["rss_anon_first_kib"] > 0 and r["growth_kib"] == r["rss_anon_end_kib"] - r["rss_anon_first_kib"]


@pytest.mark.timeout(180)
def test_lane_cpu_times_both_sides_of_each_tree(tmp_path: Path) -> None:
    cpu = min(os.sched_getaffinity(0))  # one CPU this run may use, for both sides
    doc = _run("lane_cpu.py", "--calls", "300", "--rounds", "2", "--tree", "a=", "--tree", "b=", "--cpus", f"{cpu}:{cpu}",
               out=tmp_path / "l.json")
    assert doc["mode"] == "lane-cpu-block" and "verdicts" not in doc and doc["command"].startswith("bench/lane_cpu.py")
    assert set(doc["runs"]) == {"a", "b"} and all(len(rs) == 2 for rs in doc["runs"].values())
    for med in doc["medians"].values():
        assert set(med) == {"client_cpu_us", "worker_cpu_us", "p50_us"}, med
        # both on one CPU: the round trip holds both sides' CPU (the worker's is read in clock ticks: coarse)
        assert 0 < med["client_cpu_us"] < med["p50_us"] * 3 and med["worker_cpu_us"] >= 0 and med["p50_us"] < 1e5, med


def test_metrics_fold_times_observe_and_fold_of_each_tree(tmp_path: Path) -> None:
    doc = _run("metrics_fold.py", "--calls", "200", "--rounds", "2", "--tree", "a=", "--tree", "b=", out=tmp_path / "f.json")
    assert doc["mode"] == "metrics-fold" and "verdicts" not in doc and doc["command"].startswith("bench/metrics_fold.py")
    assert set(doc["runs"]) == {"a", "b"} and all(len(rs) == 2 for rs in doc["runs"].values())
    for med in doc["medians"].values():
        assert set(med) == {"observe_us", "fold_us"} and all(0 < v < 1000 for v in med.values()), med


def test_floor_probe_times_the_round_trips_and_the_pieces_of_a_hot_path(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "floor_probe.py"), "--iters", "300", "--out",
                           str(out)], capture_output=True, text=True, timeout=150, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert doc["mode"] == "floor-probe" and len(res) == 14, sorted(res)
    for trip in ("round trip, spinning on a shared seq word", "round trip, blocking on eventfds"):
        assert 0 < res[trip]["p50_us"] <= res[trip]["p99_us"], (trip, res[trip])
    for piece in ("time.perf_counter()", "a Lock taken and let go (with), in a call", "numpy.add of 16 float32 into its output"):
        assert 0 <= res[piece]["p50_us"] < 50, (piece, res[piece])


def test_big_trace_times_a_launched_request_and_its_pulse(tmp_path: Path) -> None:
    # bench/gpu/big_trace.py on the NumPy backend's stand-in device (a 4 MiB request launched, due 20 ms later):
    # the launch, the wait for the run, the PULSE and the DONE, over ZeroMQ and through the blocking lane
    env = dict(os.environ, SHMRPC_NUMPY_BATCH_JOINT="1", SHMRPC_NUMPY_LAUNCH_S="0.02")
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu" / "big_trace.py"), "--reps", "4", "--backend",
                           "numpy", "--mib", "4", "--lanes", "zmq,block", "--out", str(out)],
                          capture_output=True, text=True, timeout=150, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["mode"] == "big-trace" and doc["mib"] == 4 and set(doc["median_us"]) == {"zmq", "block"}
    for path, med in doc["median_us"].items():
        span = med["worker: _on_call to DONE (its metric's span)"]
        # found done no sooner than due (20 ms after the launch, which is a little before the wait's first stamp)
        assert 0.9 * 0.02e6 <= med["launched to found done"] < span < med["round trip"], (path, med)
        assert med["DONE to the client routing it"] > 0 and med["_on_call to launched"] > 0, (path, med)


@pytest.mark.timeout(180)
def test_mixed_trees_measures_every_pair_of_worker_and_clients(tmp_path: Path) -> None:
    # two pairs of this checkout (an empty site: the installed package) on the NumPy backend, two rounds
    doc = _run("gpu/mixed_trees.py", "--pair", "one=:", "--pair", "two=:", "--clients", "2", "--calls", "60",
               "--rounds", "2", "--backend", "numpy", "--dtype", "float32", out=tmp_path / "m.json")
    assert doc["mode"] == "mixed-trees" and "verdicts" not in doc and "machine" in doc
    assert doc["command"].startswith("bench/gpu/mixed_trees.py")
    assert set(doc["rounds"]) == {"one", "two"}
    for label, rows in doc["rounds"].items():
        assert len(rows) == 2
        for row in rows:
            assert row["rps"] > 0 and row["client_cpu_us"] > 0 and row["worker_cpu_us"] >= 0, (label, row)
        assert doc["medians"][label]["rps"] > 0
