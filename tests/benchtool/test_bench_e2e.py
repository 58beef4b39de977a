"""``shmrpc bench`` against a real worker it starts: every shmrpc line measured, the worker gone after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shmrpc.bench import RunConfig, main, run_benchmark
from shmrpc.bench._report import bandwidth_table
from shmrpc.bench._runner import make_transport, open_servers, started_on


def _bench_regions() -> set[str]:
    """Named regions of bench workers this process started (``bench-<our pid>-``): never another suite's.

    Regions are nameless memfds, so this finds a regression to named ones; what a subprocess's worker
    leaves (its sockets) is caught by the suite's leak check of this run's runtime directory.
    """
    return {e for e in os.listdir("/dev/shm") if e.startswith(f"shmrpc.bench-{os.getpid()}-")}


@pytest.fixture
def no_leak() -> object:
    before = _bench_regions()
    yield None
    assert _bench_regions() - before == set(), "the benchmark's worker left a region in /dev/shm"


@pytest.mark.e2e
@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["uint8", "float16"])
def test_shmrpc_paths_round_trip_the_payload(no_leak: object, dtype: str) -> None:
    # float16: the payload's values finite and normal, still moved byte for byte (an odd size of items included)
    cfg = RunConfig(sizes=[64, 65_538, 100_000], transports=["shmrpc", "shmrpc-call"], backend="numpy", dtype=dtype)
    with open_servers(cfg, log=print) as servers:
        assert servers.skipped == {}, servers.skipped
        for key in cfg.transports:
            with make_transport(key, servers.addresses[key], cfg) as t:
                for nbytes in cfg.sizes:
                    t.prepare(nbytes)
                    sent = t.payload_bytes()
                    assert len(sent) == nbytes
                    if dtype == "float16":
                        assert np.isfinite(np.frombuffer(sent, np.float16)).all()
                    assert t.reply_bytes(t.roundtrip()) == sent
                    assert t.reply_bytes(t.roundtrip()) == t.payload_bytes()
                    h = [t.start() for _ in range(2)]
                    assert all(t.reply_bytes(t.finish(x)) == t.payload_bytes() for x in h)
                    t.end_size()
    assert servers.worker["exit_status"] == 0


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_cli_latency_with_clients(tmp_path: Path, no_leak: object, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lat.json"
    rc = main(["lat", "--sizes", "64,4K", "--iters", "100", "--warmup", "2", "--backend", "numpy", "--peers", "zmq",
               "--clients", "2", "--out", str(out), "-q"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert {k: v["status"] for k, v in doc["transports"].items()} == {"shmrpc": "ok", "shmrpc-call": "ok",
                                                                      "zmq": "ok"}
    assert len(doc["results"]) == 6 and not any("error" in r for r in doc["results"])
    assert doc["worker"]["started_by_bench"] and doc["worker"]["exit_status"] == 0
    assert [x["status"] for x in doc["verdicts"]][0] in ("PASS", "MISS")
    assert sorted((p["transport"], p["nbytes"]) for p in doc["scaling"]) == sorted(
        (k, n) for k in ("shmrpc", "shmrpc-call", "zmq") for n in (64, 4096))
    assert all("error" not in p and len(p["per_client_p99_us"]) == 2 for p in doc["scaling"])
    # what the worker did per point, from its /metrics: at least every timed call (a NumPy worker runs a batch
    # item by item, so it parks none: no batches), and nothing for the peer
    for p in doc["scaling"]:
        if p["transport"] == "zmq":
            assert "worker" not in p
        else:
            assert p["worker"]["requests"] >= 2 * p["iters_per_client"], p
            assert p["worker"]["batches"] == 0 and p["worker"]["mean_batch"] == 1.0
    assert "PASS" in capsys.readouterr().out or "MISS" in out.read_text()


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_bandwidth_with_a_window(no_leak: object) -> None:
    doc = run_benchmark(RunConfig(mode="bw", sizes=[4096, 1 << 20], iters=20, warmup=1, window=3, backend="numpy"),
                        quiet=True, log=print)
    bw = {(r["transport"], r["nbytes"]): r["bandwidth"] for r in doc["results"]}
    assert bw[("shmrpc-call", 4096)]["window"] == 3 and bw[("shmrpc", 4096)]["window"] == 1
    assert all(b["messages"] == 20 and b["msgs_per_s"] > 0 for b in bw.values())
    # the loan re-sends data written once to echo, which answers with its input: no byte moved, so no GB/s
    for (key, _), b in bw.items():
        if key == "shmrpc":
            assert b["one_dir_gbps"] is None and b["both_dir_gbps"] is None and b["payload_moved"] is False
        else:
            assert b["one_dir_gbps"] > 0 and "payload_moved" not in b
    table = bandwidth_table(doc)
    assert "no payload byte moves, so no GB/s" in table
    assert [ln.split()[-2:] for ln in table.splitlines() if "shmrpc (zero-copy loan)" in ln] == [["-", "-"]] * 2


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_python_dash_m_runs(tmp_path: Path, no_leak: object) -> None:
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "shmrpc.bench", "lat", "--sizes", "64", "--iters", "5",
                           "--backend", "numpy", "--no-call", "--out", str(out), "-q"],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "shmrpc (zero-copy loan)" in proc.stdout
    assert json.loads(out.read_text())["command"].startswith("python -m shmrpc.bench lat")


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_spin_reaches_worker_and_clients(tmp_path: Path, no_leak: object, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "spin.json"
    rc = main(["lat", "--sizes", "64", "--iters", "20", "--warmup", "2", "--backend", "numpy",
               "--transports", "shmrpc", "--spin-us", "100", "--out", str(out), "-q"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["spin_us"] == 100
    argv = doc["worker"]["argv"]
    assert argv[argv.index("--spin-us") + 1] == "100" and doc["worker"]["exit_status"] == 0
    assert [r["transport"] for r in doc["results"]] == ["shmrpc"] and "error" not in doc["results"][0]
    assert "spinning 100 µs" in capsys.readouterr().out


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_one_sample_gives_no_verdict(tmp_path: Path, no_leak: object, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lat.json"
    rc = main(["lat", "--sizes", "64", "--iters", "1", "--warmup", "0", "--backend", "numpy", "--peers", "zmq",
               "--no-call", "--out", str(out), "-q"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "PASS" not in text and "MISS" not in text and "too few samples" in text
    assert {v["status"] for v in json.loads(out.read_text())["verdicts"]} == {"N/A"}


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_lanes_and_two_input_ops_round_trip(no_leak: object) -> None:
    # vector_add of the payload with itself, in place: every shmrpc path, lanes included, gives 2 * payload
    import numpy as np

    from shmrpc.bench._transport import payload_of

    cfg = RunConfig(sizes=[64, 1 << 20], transports=["shmrpc", "shmrpc-call", "shmrpc-lane", "shmrpc-lane-spin",
                                                     "shmrpc-call-lane"],
                    backend="numpy", op="vector_add", dtype="int32", in_place=True)
    with open_servers(cfg, log=print) as servers:
        assert servers.skipped == {}, servers.skipped
        for key in cfg.transports:
            with make_transport(key, servers.addresses[key], cfg) as t:
                assert t.inputs == ("x", "y")  # type: ignore[attr-defined]
                for nbytes in cfg.sizes:
                    t.prepare(nbytes)
                    p = payload_of(nbytes, "int32")
                    r1 = np.frombuffer(t.reply_bytes(t.roundtrip()), dtype=np.int32).copy()
                    r2 = np.frombuffer(t.reply_bytes(t.roundtrip()), dtype=np.int32).copy()
                    if key.startswith("shmrpc-call"):  # copied in: x + y = 2 * payload every time
                        np.testing.assert_array_equal(r1, 2 * p)
                        np.testing.assert_array_equal(r2, 2 * p)
                    else:  # the loan's x is overwritten in place: each send adds y (= payload) once more
                        np.testing.assert_array_equal(r2 - r1, p)
                    t.end_size()
                if key != "shmrpc-call" and key != "shmrpc":
                    assert t._client._t.lane is not None and t._client._t.lane.seq > 0  # type: ignore[attr-defined]
    assert servers.worker["exit_status"] == 0


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_cli_small_request_run_has_connects_and_small_verdicts(tmp_path: Path, no_leak: object) -> None:
    out = tmp_path / "small.json"
    rc = main(["lat", "--sizes", "64", "--iters", "120", "--warmup", "5", "--backend", "numpy", "--lanes",
               "--transports", "shmrpc,shmrpc-call,shmrpc-lane,shmrpc-lane-spin,shmrpc-call-lane,zmq",
               "--op", "vector_add", "--dtype", "float32", "--connect-iters", "5", "--out", str(out), "-q"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["connect"]["iterations"] == 5 and doc["connect"]["p50_us"] > 0
    goals = {v["goal"]: v["status"] for v in doc["verdicts"]}
    assert goals["connect (Client(name) to ready) p50 <= 5 ms"] == "N/A"  # 5 connects: too few for a verdict
    assert goals["64 B call() p50 <= 1.3x the loan's"] in ("PASS", "MISS")
    assert goals["64 B shmrpc-lane p50 <= 30 µs and under the fastest peer's"] in ("PASS", "MISS")
    assert goals["1 MiB loan p50 <= iceoryx2 blocking's"] == "N/A"


@pytest.mark.timeout(60)
def test_own_backend_baseline_runs_the_op_in_the_client_process() -> None:
    import numpy as np

    from shmrpc.bench._transport import payload_of

    cfg = RunConfig(sizes=[64], transports=["own"], backend="numpy", op="vector_add", dtype="int32")
    with open_servers(cfg, log=print) as servers, make_transport("own", servers.addresses["own"], cfg) as t:
        t.prepare(64)
        got = np.frombuffer(t.reply_bytes(t.roundtrip()), dtype=np.int32)
        np.testing.assert_array_equal(got, 2 * payload_of(64, "int32"))


def test_processes_started_on_cpus_get_them_and_the_starter_keeps_its_own() -> None:
    mine = os.sched_getaffinity(0)
    cpu = max(mine)
    with started_on((cpu,)):
        child = subprocess.Popen([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                                 stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=30)
    assert out.strip() == f"[{cpu}]" and os.sched_getaffinity(0) == mine


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_server_and_client_cpus_reach_the_worker_and_the_run(tmp_path: Path, no_leak: object) -> None:
    # a child process: --client-cpus pins the process that runs the bench
    cpu = max(os.sched_getaffinity(0))
    out = tmp_path / "pin.json"
    proc = subprocess.run([sys.executable, "-m", "shmrpc.bench", "lat", "--sizes", "64", "--iters", "20", "--warmup", "2",
                           "--backend", "numpy", "--transports", "shmrpc,zmq", "--server-cpus", str(cpu),
                           "--client-cpus", str(cpu), "--out", str(out), "-q"], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["server_cpus"] == [cpu] and doc["config"]["client_cpus"] == [cpu]
    argv = doc["worker"]["argv"]
    assert argv[argv.index("--cpus") + 1] == str(cpu)
    assert {r["transport"] for r in doc["results"] if "error" not in r} == {"shmrpc", "zmq"}


@pytest.mark.parametrize("flag", ["--server-cpus", "--client-cpus"])
def test_bad_cpus_are_a_usage_error_naming_the_flag(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lat", flag, "2-1", "--no-json"]) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(("args", "says"), [
    (["--dtype", "float99"], "--dtype float99: not a tensor dtype"),
    (["--op", "nosuchop"], "--op nosuchop: no such op"),
    (["--server-cpus", str(max(os.sched_getaffinity(0)) + 1)], "not CPUs this process may use"),
])
def test_an_unknown_dtype_op_or_cpu_is_a_usage_error_before_anything_starts(
        args: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    # (a dtype no tensor has once gave a run whose every point was an error, with exit status 0; an unknown op
    # started a worker first; a CPU not in the affinity mask was a traceback)
    assert main(["lat", "--sizes", "64", "--iters", "5", "--backend", "numpy", "--no-json", *args]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_async_mode_with_lanes_measures_every_line(tmp_path: Path, no_leak: object) -> None:
    # shmrpc bench async --lanes: the blocking call() and AsyncClient, over ZeroMQ and through a blocking lane, next
    # to zmq.asyncio; every line has its round trips, the loaded ones their calls/s and the loop's lag
    out = tmp_path / "async.json"
    rc = main(["async", "--sizes", "64", "--iters", "30", "--in-flight", "8", "--total", "200", "--lanes",
               "--backend", "numpy", "--out", str(out), "-q"])
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = {r["transport"]: r for r in doc["results"]}
    assert list(rows) == ["shmrpc-call", "shmrpc-async", "shmrpc-call-lane", "shmrpc-async-lane", "zmq.asyncio"]
    assert doc["config"]["lanes"] is True and doc["skipped"] == {}
    for key, r in rows.items():
        assert r["nbytes"] == 64 and 0 < r["rtt_us"]["p50"] <= r["rtt_us"]["p99"] <= r["rtt_us"]["max"], key
        if key != "shmrpc-call" and key != "shmrpc-call-lane":
            assert r["in_flight"] == 8 and r["calls"] >= 200 - 8 and r["calls_per_s"] > 0, key
            assert r["loop_lag_us"]["p50"] >= 0, key


def _processes_with(marker: str) -> list[int]:
    """Pids of this uid's processes whose environment holds ``marker`` (what a run started: its worker, its peers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _signalled_bench(tmp_path: Path, argv: list[str], sig: int) -> tuple[subprocess.Popen[str], str, str, str]:
    """Run ``python -m shmrpc.bench ARGV`` in its own runtime and temporary directories, send it ``sig`` once its
    worker is up and its servers started (SIGINT to the whole process group, as a terminal does; anything else to
    the bench alone), and wait for it. Returns the process, its stdout and stderr, and the environment mark its
    processes carry (:func:`_processes_with`)."""
    import signal
    import time

    rt, tmp = tmp_path / "rt", tmp_path / "tmp"
    rt.mkdir(mode=0o700)
    tmp.mkdir()
    marker = f"SHMRPC_BENCH_TEST_MARK={tmp_path.name}-{os.getpid()}"
    env = dict(os.environ, SHMRPC_RUNTIME_DIR=str(rt), TMPDIR=str(tmp), SHMRPC_BENCH_TEST_MARK=marker.split("=")[1])
    proc = subprocess.Popen([sys.executable, "-m", "shmrpc.bench", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not any(p.suffix == ".sock" for p in rt.iterdir()):  # the worker is up: the servers are started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(1.0)
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc, stdout, stderr, marker


def _nothing_left(tmp_path: Path, marker: str) -> None:
    """No process of the run, and nothing in its runtime or temporary directory."""
    import time

    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_with(marker) == []
    assert list((tmp_path / "rt").iterdir()) == [] and list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_ctrl_c_keeps_what_was_measured_and_leaves_nothing(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-run: exit 130 with one line, no
    traceback from the bench or its children, the JSON written with ``interrupted``, and nothing left: no worker or
    peer process, no socket, no peer's temporary directory."""
    import signal

    out = tmp_path / "lat.json"
    proc, stdout, stderr, marker = _signalled_bench(
        tmp_path, ["lat", "--sizes", "64", "--iters", "1000000", "--backend", "numpy", "--peers", "zmq,pipe",
                   "--no-call", "-q", "--out", str(out)], signal.SIGINT)
    assert proc.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "interrupted" in stderr
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and doc["worker"]["exit_status"] == 0
    _nothing_left(tmp_path, marker)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [["lat", "--sizes", "64", "--iters", "1000000", "--peers", "zmq,pipe", "--no-call"],
                                  ["threads", "--threads", "1", "--duration-s", "60"]])
def test_sigterm_takes_the_ctrl_c_path_and_leaves_nothing(tmp_path: Path, mode: list[str]) -> None:
    """SIGTERM to the bench alone (``timeout``, ``kill``): exit 143, one line, no traceback, and nothing left behind:
    no process, socket, peer's temporary directory or worker log (its default action left the last three)."""
    import signal

    out = tmp_path / "r.json"
    proc, stdout, stderr, marker = _signalled_bench(
        tmp_path, [*mode, "--backend", "numpy", "-q", "--out", str(out)], signal.SIGTERM)
    assert proc.returncode == 143, (stdout, stderr)
    assert "Traceback" not in stderr and "interrupted (SIGTERM)" in stderr, stderr
    if mode[0] == "lat":
        assert json.loads(out.read_text())["interrupted"] is True
    _nothing_left(tmp_path, marker)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("args", "flag"), [
    (["threads", "--threads", "1", "--duration-s", "-1"], "--duration-s"),
    (["threads", "--threads", "1", "--duration-s", "nan"], "--duration-s"),
    (["async", "--in-flight", "0"], "--in-flight"),
    (["async", "--in-flight", "-3"], "--in-flight"),
    (["async", "--total", "0"], "--total"),
    (["lat", "--connect-iters", "-1"], "--connect-iters"),
    (["lat", "--bytes-budget", "0"], "--bytes-budget"),
    (["lat", "--transports", ""], "--transports"),
    (["lat", "--transports", " , "], "--transports"),
])
def test_out_of_range_counts_are_a_usage_error_naming_the_option(
        args: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    # (--duration-s -1 started a worker and ended in a traceback, --in-flight 0 hung, --connect-iters -1 started a
    # second worker for no sample, --bytes-budget 0 gave 5 round trips, --transports '' meant the default set)
    assert main([*args, "--sizes", "64", "--backend", "numpy", "--no-json"]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_worker_args_takes_a_single_flag() -> None:
    # argparse refused a value starting with "-": --worker-args '--no-lanes' was "expected one argument"
    from shmrpc.bench._cli import build_parser

    parse = build_parser().parse_args
    assert parse(["lat", "--worker-args", "--no-lanes", "--sizes", "64"]).worker_args == "--no-lanes"
    assert parse(["lat", "--worker-args", "--threads 8"]).worker_args == "--threads 8"
    assert parse(["lat", "--worker-args=--no-lanes"]).worker_args == "--no-lanes"
    assert main(["lat", "--worker-args"]) == 2  # no value: a usage error as before


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_a_worker_started_with_a_single_flag_from_worker_args(tmp_path: Path, no_leak: object) -> None:
    out = tmp_path / "r.json"
    assert main(["lat", "--sizes", "64", "--iters", "5", "--no-call", "--backend", "numpy", "--worker-args",
                 "--no-lanes", "--out", str(out), "-q"]) == 0
    doc = json.loads(out.read_text())
    assert "--no-lanes" in doc["worker"]["argv"] and "error" not in doc["results"][0]


def test_the_help_names_every_peer() -> None:
    # the description and the --peers example named pyzmq, pipes and gRPC only
    from shmrpc.bench._cli import build_parser

    text = build_parser().format_help()
    assert "iceoryx2 and UCX" in text and "zmq, pipe, gRPC" not in text
