"""Isolation: a client's slots live in a region nobody else can open; other uids cannot connect."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import posix_ipc
import pytest
import zmq
from wire import raw_call

from shmrpc.client import Client, StaleSlotError
from shmrpc.schema import SCHEMA_HASH
from shmrpc.schema import messages as m
from shmrpc.schema.naming import endpoint, region_prefix, runtime_dir, socket_path

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def _status(name: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "shmrpc.server", "status", "--name", name, "--json"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_private_region_cannot_be_opened_by_another_process(worker: WorkerProc) -> None:
    with Client(worker.name, timeout_s=10) as a, Client(worker.name, timeout_s=10) as b:
        a.call("echo", x=np.ones(4))  # a's ATTACHED has been handled before its first answer
        b.call("echo", x=np.ones(4))
        own = {r.index: r.name for r in a._regions.values() if r.index != 0}
        assert len(own) == 1
        (index, name), = own.items()
        with pytest.raises(posix_ipc.ExistentialError):  # unlinked: not even a same-uid process can open it
            posix_ipc.SharedMemory(name)
        assert not [f for f in os.listdir("/dev/shm") if f.startswith(region_prefix(worker.name) + f"{index}.")]
        # b knows nothing of a's region and cannot ring a's slots
        assert index not in b._regions
        slot = a._free[0]
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
def test_other_uid_is_refused(worker: WorkerProc) -> None:
    nobody = pwd.getpwnam("nobody")
    # 1. another uid cannot even reach the socket: the runtime directory is 0700 (connect needs search permission)
    sock = socket_path(worker.name)
    assert sock.exists()
    out = subprocess.run(["sh", "-c", f"test -e '{sock}'"], user=nobody.pw_uid, group=nobody.pw_gid, timeout=30)
    assert out.returncode != 0
    # 2. a HELLO naming a process of another uid is refused, naming the field
    sleeper = subprocess.Popen(["sleep", "30"], user=nobody.pw_uid, group=nobody.pw_gid)
    try:
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint(worker.name))
        s.send(m.pack_json(m.HELLO, {"protocol": m.PROTOCOL_VERSION, "schema_hash": SCHEMA_HASH,
                                     "pid": sleeper.pid, "uid": nobody.pw_uid}))
        assert s.poll(5000)
        frame = s.recv()
        body = m.unpack_json(frame)
        assert frame[:1] == m.ERROR and body["kind"] == "refused" and body["field"] == "uid"
        s.close()
        ctx.term()
    finally:
        sleeper.kill()
        sleeper.wait()
