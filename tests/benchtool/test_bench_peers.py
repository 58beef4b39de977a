"""Every peer server returns exactly the bytes it was sent, one at a time and with a window in flight."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.procstat import cpu_s

from shmrpc.bench._peers import PEERS, start_peer_server
from shmrpc.bench._runner import RunConfig, measure_bandwidth, measure_latency, run_clients


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", sorted(PEERS))
def test_peer_round_trips_the_payload(key: str) -> None:
    pytest.importorskip(PEERS[key][3])
    cls = PEERS[key][0]
    with start_peer_server(key) as server, cls(server.address) as t:
        for nbytes in (64, 4096, 300_001):
            t.prepare(nbytes)
            sent = t.payload_bytes()
            assert len(sent) == nbytes
            assert t.reply_bytes(t.roundtrip()) == sent
            handles = [t.start() for _ in range(3)]
            assert all(t.reply_bytes(t.finish(h)) == sent for h in handles)
            assert measure_latency(t, 3, 1).shape == (3,)
            assert measure_bandwidth(t, 5, 2, 1) > 0
            t.end_size()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("key", ["zmq", "ucx"])
def test_clients_mode_against_one_server(key: str) -> None:
    pytest.importorskip(PEERS[key][3])
    cfg = RunConfig(iters=20, warmup=2, transports=[key])
    with start_peer_server(key) as server:
        point = run_clients(key, server.address, cfg, 2, 64)
    assert "error" not in point, point
    assert point["clients"] == 2 and point["nbytes"] == 64
    assert len(point["per_client_p99_us"]) == 2
    assert point["calls_per_s"] > 0


def test_a_missing_ucx_is_a_skip_with_its_extra_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from shmrpc.bench._transport import TransportUnavailable

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ucxx" else real(name, *a))
    with pytest.raises(TransportUnavailable, match=r"shmrpc\[ucx\]"):
        start_peer_server("ucx")


@pytest.mark.timeout(60)
def test_the_spinning_iceoryx2_server_takes_no_core_while_no_client_calls() -> None:
    # the bench starts every peer's server before its first measurement: one that spun throughout took a core (or
    # the worker's own CPU, pinned) from every other transport measured meanwhile
    pytest.importorskip(PEERS["iox2-spin"][3])
    cls = PEERS["iox2-spin"][0]
    with start_peer_server("iox2-spin") as server, cls(server.address) as t:
        t.prepare(64)
        assert t.reply_bytes(t.roundtrip()) == t.payload_bytes()
        pid = server._proc.pid
        assert pid is not None
        time.sleep(0.1)
        cpu0, t0 = cpu_s(pid), time.monotonic()
        time.sleep(1.0)
        used = (cpu_s(pid) - cpu0) / (time.monotonic() - t0)
        assert used < 0.3, f"the idle spinning server used {used:.0%} of a core"
        assert t.reply_bytes(t.roundtrip()) == t.payload_bytes()  # and it still answers


def test_a_peer_server_is_stopped_with_its_python_unwound_and_ignores_ctrl_c(tmp_path: Path) -> None:
    """SIGTERM unwinds a peer server's Python (an iceoryx2 server killed by the default action left its node's files
    in /dev/shm), and SIGINT, which a terminal's Ctrl-C sends the whole group, is left to the bench to handle."""
    import os
    import signal

    from support.unwind_server import serve

    from shmrpc.bench._transport import ServerProcess

    srv = ServerProcess(serve, "unwind.sock")
    try:
        os.kill(srv._proc.pid, signal.SIGINT)
        time.sleep(0.3)
        assert srv._proc.is_alive()
        mark = srv.address + ".unwound"
        srv._proc.terminate()
        srv._proc.join(10)
        assert srv._proc.exitcode == 0 and Path(mark).read_text() == "yes"
    finally:
        srv.close()


def test_a_failed_client_sweep_reports_the_cause_not_the_broken_barrier() -> None:
    from shmrpc.bench._runner import first_cause

    limit = "ClientLimitError: uid 0 has 16 clients (--max-clients-per-uid 16)"
    assert first_cause(["BrokenBarrierError: ", limit, "BrokenBarrierError: "]) == limit
    assert first_cause(["BrokenBarrierError: "]) == "BrokenBarrierError: "


def _never_ready(address: str, ready: object) -> None:
    time.sleep(60)


def _report_sigint(queue: object) -> None:
    import signal

    queue.put(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)  # type: ignore[attr-defined]


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_a_peer_server_starts_leaves_neither_it_nor_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C to the group while a peer server was still importing printed its traceback (it could not ignore SIGINT
    yet), and one while the bench waited for it left its directory: children now start with SIGINT ignored, and the
    server is stopped when its start is cut short."""
    import multiprocessing as mp
    import os
    import signal
    import tempfile
    import threading

    from shmrpc.bench._transport import ServerProcess, ctrl_c_left_to_us

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with ctrl_c_left_to_us():
        child = ctx.Process(target=_report_sigint, args=(q,))
        child.start()
    assert q.get(timeout=30) is True
    child.join(10)

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        ServerProcess(_never_ready, "never.sock", start_timeout_s=30)
    timer.join()
    assert list(tmp_path.iterdir()) == []


def test_the_pipe_server_lets_a_client_go_in_the_middle_of_its_answer() -> None:
    # a client gone while the server sends (a Ctrl-C mid round trip) gave "Exception in thread ... BrokenPipeError"
    import multiprocessing as mp

    import numpy as np

    from shmrpc.bench._peers import _pipe_serve_conn

    client, server = mp.Pipe()
    client.send(np.zeros(64, np.uint8))
    client.close()
    _pipe_serve_conn(server)  # returns, no BrokenPipeError
    assert server.closed


@pytest.mark.timeout(60)
def test_a_peer_server_that_dies_at_start_is_told_at_once_with_its_cause() -> None:
    # it was noticed only when the 30 s start timeout ran out, as "did not start", with no cause
    from shmrpc.bench._transport import ServerProcess, TransportUnavailable, touch

    t0 = time.monotonic()
    with pytest.raises(TransportUnavailable, match=r"exited at start with status 1: TypeError: touch\(\)"):
        ServerProcess(touch, "dead.sock", start_timeout_s=30)  # touch(address, ready): a TypeError in the child
    assert time.monotonic() - t0 < 15


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", ["iox2", "iox2-spin"])
def test_an_iceoryx2_peer_leaves_nothing_in_dev_shm(key: str) -> None:
    """iceoryx2's files are named for the server's private directory and go with it: with the defaults a run left
    /tmp/iceoryx2 and a global_mgmt segment in /dev/shm, which no node removes."""
    import os

    pytest.importorskip(PEERS[key][3])
    cls = PEERS[key][0]
    with start_peer_server(key) as server:
        prefix = os.path.basename(os.path.dirname(server.address)) + "_"
        with cls(server.address) as t:
            t.prepare(4096)
            assert t.reply_bytes(t.roundtrip()) == t.payload_bytes()
            assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix) and n.endswith(".global_mgmt")]
    assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)] == []
    assert not os.path.exists(os.path.dirname(server.address))
