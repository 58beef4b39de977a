"""What the ``shmrpc`` commands print about real workers: ``status``'s op list and region sizes, ``doctor``'s
memory check (the one ``serve`` runs at start), and the supervisor's ready line after its workers'."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from shmrpc.schema.layout import format_size_approx, parse_geometry
from shmrpc.schema.naming import device_workers

from .conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

USER_OP = '''
from shmrpc.kernels.api import OpSpec, register_op


def _rule(i, a):
    return {"out": i["x"]}


def _impl(call):
    return {"out": call.xp.multiply(call.inputs["x"], 2, out=call.dest("out"))}


register_op(OpSpec("{name}", inputs=("x",), outputs=("out",), infer=_rule, numpy=_impl))
'''


def _shmrpc(*argv: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmrpc.server", *argv], capture_output=True, text=True,
                          timeout=timeout_s)


def test_status_lists_every_op_it_counts_users_ops_included(spawn_worker: Callable[..., WorkerProc],
                                                             tmp_path: Path, worker_name: str) -> None:
    mod = "cliops_" + worker_name.replace("-", "_")
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(USER_OP.replace("{name}", "t_twice")))
    old = os.environ.get("PYTHONPATH", "")
    w = spawn_worker("--ops", mod, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *filter(None, [old])])))
    table = json.loads(_shmrpc("status", "--name", w.name, "--json").stdout)["ops"]
    assert not table["t_twice"]["builtin"] and sum(not o["builtin"] for o in table.values()) == 1
    text = _shmrpc("status", "--name", w.name).stdout
    m = re.search(r"^ops (\d+): (.*)$", text, re.M)
    assert m, text
    names = m.group(2).split(", ")
    assert int(m.group(1)) == len(names) == len(table)
    assert names == list(table) and names[-1] == "t_twice"  # by code: the built-ins, then the user's
    assert re.search(r"^users' ops: t_twice \(\d+, numpy\)$", text, re.M), text


def test_status_shows_a_small_region_in_kib(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker(slots="64K:4", lease="1")
    size = format_size_approx(parse_geometry("64K:4").region_nbytes)
    assert size.endswith(" KiB")
    text = _shmrpc("status", "--name", w.name).stdout
    regions = [line for line in text.splitlines() if line.startswith("region 0: ")]
    assert len(regions) == 1 and f"  {size}  slots " in regions[0], text
    assert " 0 MiB" not in text


def _without_available(message: str) -> str:
    """A memory StartupError's message with the host's available memory (which moves) taken out."""
    return re.sub(r"[\d.]+ [KMGT]?i?B of memory is available", "N of memory is available", message)


def test_doctor_refuses_a_geometry_as_serve_does(worker_name: str) -> None:
    """doctor runs serve's start check: the same refusal for the same geometry, with the same remedy."""
    huge = "1000G:1"
    served = _shmrpc("serve", "--name", worker_name, "--slots", huge, "--backend", "numpy", "--no-mlock")
    assert served.returncode == 1, served.stderr
    refusal = served.stderr.strip()
    # (the pool, 1000 GiB, and a client's own region at the default --lease, 4 slots of that class, 4000 GiB)
    assert refusal.startswith("shmrpc serve: ") and "of memory is available" in refusal and \
        "but the pool region with one client's own region (default --lease) needs 5000.0 GiB" in refusal
    checked = _shmrpc("doctor", "--slots", huge)
    assert checked.returncode == 1
    problems = [line for line in checked.stdout.splitlines() if line.startswith("PROBLEM ")]
    assert _without_available("PROBLEM " + refusal.removeprefix("shmrpc serve: ")) in map(_without_available, problems)
    assert not any("/dev/shm" in line for line in problems), checked.stdout


def _until_ready(sup: subprocess.Popen[str], name: str) -> list[str]:
    """The supervisor's stdout lines up to its ready line (the test fails if it ends first)."""
    assert sup.stdout is not None
    seen: list[str] = []
    for line in sup.stdout:
        seen.append(line)
        if line.startswith(f"shmrpc supervisor {name} ready"):
            return seen
    pytest.fail(f"supervisor did not start: {seen} {sup.stderr.read() if sup.stderr else ''}")


def test_supervisor_ready_line_comes_after_every_workers(worker_name: str) -> None:
    sup = subprocess.Popen(
        [sys.executable, "-m", "shmrpc.server", "serve", "--name", worker_name, "--devices", "0,1", "--slots", "64K:4",
         "--lease", "1", "--backend", "numpy", "--no-mlock", "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # its workers join its group
    try:
        seen = _until_ready(sup, worker_name)
        for d in (0, 1):
            name = f"{worker_name}-{d}"
            assert any(line.startswith(f"[{name}] shmrpc worker {name} ready (") for line in seen[:-1]), seen
        sup.send_signal(signal.SIGTERM)
        sup.communicate(timeout=60)
        assert sup.returncode == 0
        assert device_workers(worker_name) == []
    finally:
        if sup.poll() is None:  # the supervisor and its workers: the process group it leads
            os.killpg(sup.pid, signal.SIGKILL)
            sup.communicate(timeout=10)


def _free_port_pair() -> int:
    """A port P with P and P + 1 free now (bound and released: another process may take them before the worker)."""
    import socket

    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    pytest.skip("no two free neighbouring ports")


def test_a_supervisor_killed_outright_takes_its_workers_with_it_and_gives_each_a_metrics_port(
        worker_name: str) -> None:
    """`serve --devices 0,1 --metrics-port P`: worker i serves metrics on P + i (one fixed port for all stopped the
    start: the second worker found it taken). SIGKILL to the supervisor: its workers get SIGTERM from the kernel
    (they were left running, holding their names, and a new supervisor refused to start)."""
    import time
    import urllib.request

    port = _free_port_pair()
    argv = [sys.executable, "-m", "shmrpc.server", "serve", "--name", worker_name, "--devices", "0,1", "--slots",
            "64K:4", "--lease", "1", "--backend", "numpy", "--no-mlock", "--log-level", "WARNING", "--metrics-port",
            str(port)]
    sup = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _until_ready(sup, worker_name)
        for i in (0, 1):
            with urllib.request.urlopen(f"http://127.0.0.1:{port + i}/metrics", timeout=10) as r:
                assert b"shmrpc_clients" in r.read()
        assert len(device_workers(worker_name)) == 2
        sup.kill()
        sup.wait(timeout=10)
        deadline = time.monotonic() + 30
        while device_workers(worker_name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert device_workers(worker_name) == [], "the workers outlived their supervisor"
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)
        sup.communicate(timeout=10)
        try:
            os.killpg(sup.pid, signal.SIGKILL)  # a worker left behind by a failure above
        except ProcessLookupError:
            pass
