"""``examples/raw_client.py``, a client written from docs/protocol.md alone (it imports nothing of shmrpc), against a
real worker: the handshake, two calls compared with NumPy, five refusals the document gives, BYE. If the worker and
the document part, this fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from shmrpc.client import Client

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

RAW = Path(__file__).resolve().parents[2] / "examples" / "raw_client.py"


def test_the_raw_client_follows_the_protocol_document(worker: WorkerProc) -> None:
    text = RAW.read_text()
    assert "import shmrpc" not in text and "from shmrpc" not in text  # the document alone
    out = subprocess.run([sys.executable, str(RAW), worker.name], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert any(ln.startswith("scale ok") for ln in lines) and any(ln.startswith("vector_add ok") for ln in lines)
    refused = [ln for ln in lines if ln.startswith("bad request: ")]
    assert len(refused) == 5 and all(ln.endswith("-> as documented") for ln in refused), refused
    assert lines[-1] == "BYE sent"
    with Client(worker.name, timeout_s=10) as c:  # the worker serves on
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones(3), y=np.ones(3))["out"], 2.0)
