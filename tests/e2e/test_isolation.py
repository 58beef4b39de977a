"""Isolation: a client's slots live in a region with no name; other uids cannot reach the worker."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pytest
from wire import attach_hello, hello_body, raw_call

from shmrpc.client import Client, StaleSlotError
from shmrpc.schema import messages as m
from shmrpc.schema.naming import attach_path, region_prefix, runtime_dir, socket_path

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _status(name: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", name, "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_private_region_has_no_name_and_is_no_one_elses(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as a, Client(worker.name, timeout_s=10) as b:
        a.call("echo", x=np.ones(4))
        b.call("echo", x=np.ones(4))
        own = {r.index: r.name for r in a._regions.values() if r.index != 0}
        assert len(own) == 1
        (index, name), = own.items()
        assert name.startswith("memfd:")  # no name in /dev/shm, ever: nothing to open, nothing to race for
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(region_prefix(worker.name))]
        # b knows nothing of a's region and cannot ring a's slots
        assert index not in b._regions
        slot = a._slots.free[0]
        with pytest.raises(StaleSlotError):
            raw_call(b, call=(slot.region, slot.index, 777, slot.generation))
        state = _status(worker.name)
        owners = sorted(r["owner"] for r in state["regions"] if r["owner"] is not None)
        assert owners == sorted(c["id"] for c in state["clients"])
    state = _status(worker.name)
    assert [r["index"] for r in state["regions"]] == [0], "a private region outlived its client"


def test_shared_isolation_mode_still_serves(spawn_worker: Callable[..., WorkerProc]) -> None:
    w = spawn_worker("--isolation", "shared")
    with Client(w.name, timeout_s=10) as c:
        assert set(c._regions) == {0}
        np.testing.assert_array_equal(c.call("scale", x=np.ones(8), a=2.0)["out"], 2.0)


def test_runtime_dir_is_private() -> None:
    st = os.stat(runtime_dir())
    assert st.st_mode & 0o077 == 0 and st.st_uid == os.geteuid()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another uid")
def test_other_uid_cannot_reach_the_sockets(worker: WorkerProc) -> None:
    nobody = pwd.getpwnam("nobody")
    # another uid cannot even reach the sockets: the runtime directory is 0700 (connect needs search permission)
    for path in (socket_path(worker.name), attach_path(worker.name)):
        assert path.exists()
        out = subprocess.run(["sh", "-c", f"test -e '{path}'"], user=nobody.pw_uid, group=nobody.pw_gid, timeout=30)
        assert out.returncode != 0


def test_hello_naming_another_process_is_refused(worker: WorkerProc) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        frame, body = attach_hello(worker.name, hello_body(pid=sleeper.pid))
        assert frame[:1] == m.ERROR and body["kind"] == "refused" and body["field"] == "pid"
    finally:
        sleeper.kill()
        sleeper.wait()
