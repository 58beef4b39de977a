"""Fixtures of the ``shmrpc bench`` tests: a loopback stand-in for the shmrpc transports."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from shmrpc.bench import _runner
from shmrpc.bench._transport import Transport, payload_of


class LoopbackTransport(Transport):
    """An in-process stand-in for shmrpc: the 'reply' is a copy of the payload (no server, no worker)."""

    key = "shmrpc"
    label = "loopback stub"
    multi_client = False  # it lives in this process only

    def __init__(self, address: str, **kwargs: Any) -> None:
        super().__init__(address)
        self._payload = payload_of(0)

    def prepare(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._payload = payload_of(nbytes)

    def roundtrip(self) -> Any:
        return {"out": self._payload.copy()}

    def reply_bytes(self, reply: Any) -> bytes:
        return np.asarray(reply["out"]).tobytes()


@pytest.fixture
def stub_shmrpc(monkeypatch: pytest.MonkeyPatch) -> type[Transport]:
    """Replace the ``shmrpc`` transport with :class:`LoopbackTransport` (use with ``RunConfig(name=...)``)."""
    monkeypatch.setitem(_runner.TRANSPORT_CLASSES, "shmrpc", LoopbackTransport)
    return LoopbackTransport
