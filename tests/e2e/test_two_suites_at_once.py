"""Two test runs on one machine at once do not interfere: each scopes its regions, sockets and workers to its run.

Two ``pytest`` processes run the same selection of multi-process e2e tests concurrently (workers
killed and restarted, clients killed mid-request, several client processes, leak checks after
each test). Both must pass, with different run ids. This is what CI relies on when several
suites share a host.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
SELECTION = [
    "tests/e2e/test_lifecycle.py::test_client_killed_mid_request_slots_come_back_zeroed",
    "tests/e2e/test_lifecycle.py::test_worker_killed_pending_call_fails_fast_then_restart_cleans",
    "tests/e2e/test_calls.py::test_four_client_processes_at_once",
    "tests/e2e/test_reliability.py::test_client_killed_at_each_point_gives_every_slot_back_zeroed",
]


def test_two_runs_of_the_suite_at_once_both_pass(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SHMRPC_RUNTIME_DIR"}  # each run makes its own
    runs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / f"run{i}"),
               *SELECTION]
        runs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    started = time.monotonic()
    outs = []
    try:
        for p in runs:
            out, _ = p.communicate(timeout=360)
            outs.append(out)
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=10)
    print(f"both runs done in {time.monotonic() - started:.1f} s")
    for p, out in zip(runs, outs):
        assert p.returncode == 0, out[-6000:]
        assert re.search(r"\b6 passed\b", out), out[-3000:]
    ids = [re.search(r"run id (\w+)", out) for out in outs]
    assert all(ids) and ids[0].group(1) != ids[1].group(1), "the two runs should have different run ids"  # type: ignore[union-attr]
