"""The UCX peer (``ucxx``, e.g. the PyPI package ``ucxx-cu12``): tagged messages over UCX's shared memory.

UCX picks its transports itself; this peer asks for the shared-memory ones only (``UCX_TLS=sm,self``
unless the environment says otherwise), so on one host a message goes through a SysV or POSIX
shared-memory segment (small ones) or a cross-memory copy (large ones), never a socket.

Wire-up: the server writes its UCX worker address into the file at ``address`` (the peers' private
socket directory) and waits for HELLOs on tag 1; a client connects to that address, sends a HELLO
(its own tag base and worker address), and the server opens an endpoint back and serves that client
in its own task. A request is one tagged message, ``[u64 payload length][payload]``, on the client's
tag ``base+1``; the server views it, touches one byte per page, and sends the same bytes back on
``base+2``. Endpoints are made without UCX's peer-failure handling: with it, UCX refuses every
shared-memory transport (they have no peer-failure support) and falls back to TCP.

Both sides use ucxx's asyncio API with its ``blocking`` progress mode (sleeping on the worker's
event fd between messages); the client runs one event-loop turn per round trip, which is part of
what this peer costs a Python caller.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import struct
import time
from typing import Any

import numpy as np

from ._transport import Transport, TransportUnavailable, payload_of, touch

__all__ = ["UcxTransport", "ucx_server"]

_HELLO_TAG = 1
_LEN = struct.Struct("<Q")
_MAX_PAYLOAD = 256 << 20  # the largest payload a server buffer takes (virtual memory until touched)


def _setup() -> Any:
    """Import ucxx with the shared-memory transports and the blocking progress mode (unless the env says)."""
    os.environ.setdefault("UCX_TLS", "sm,self")
    os.environ.setdefault("UCXPY_PROGRESS_MODE", "blocking")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx

    return ucxx


def ucx_server(address: str, ready: Any) -> None:
    """The UCX echo server: one asyncio task per client."""
    ucxx = _setup()

    async def serve_client(ep: Any, base: int) -> None:
        buf = np.empty(_LEN.size + _MAX_PAYLOAD, np.uint8)
        while True:
            await ucxx.recv(buf, tag=base + 1)
            (n,) = _LEN.unpack_from(buf[:_LEN.size].tobytes())
            touch(buf[_LEN.size:_LEN.size + n])
            await ep.send(buf[:_LEN.size + n], tag=base + 2, force_tag=True)

    async def main() -> None:
        tmp = address + ".tmp"
        with open(tmp, "wb") as f:
            f.write(bytes(ucxx.get_worker_address()))
        os.replace(tmp, address)
        ready.set()
        hello = np.empty(1 << 16, np.uint8)
        tasks = set()
        while True:
            await ucxx.recv(hello, tag=_HELLO_TAG)
            base, length = struct.unpack("<QQ", hello[:16].tobytes())
            peer = ucxx.get_ucx_address_from_buffer(hello[16:16 + length].tobytes())
            ep = await ucxx.create_endpoint_from_worker_address(peer, endpoint_error_handling=False)
            task = asyncio.ensure_future(serve_client(ep, base))
            tasks.add(task)  # kept: a task nobody holds may be collected

    asyncio.run(main())


class UcxTransport(Transport):
    """UCX tagged send/receive over shared memory (ucxx, asyncio API, blocking progress)."""

    key = "ucx"
    label = "UCX tag send/recv (sm, ucxx)"
    max_window = 1

    def __init__(self, address: str) -> None:
        super().__init__(address)
        try:
            self._ucxx = _setup()
        except ImportError as exc:
            raise TransportUnavailable(f"ucxx is not installed (pip install ucxx-cu12): {exc}") from exc
        self._loop = asyncio.new_event_loop()
        self._base = (secrets.randbits(40) << 8) | 0x10  # this client's tags: base+1 requests, base+2 replies
        deadline = time.monotonic() + 20
        while not os.path.exists(address):
            if time.monotonic() > deadline:
                raise TransportUnavailable(f"the UCX server wrote no address at {address}")
            time.sleep(0.01)
        with open(address, "rb") as f:
            server_address = f.read()
        try:
            self._ep = self._loop.run_until_complete(self._connect(server_address))
        except Exception as exc:  # noqa: BLE001 - no usable UCX transport here: the peer is skipped
            self._loop.close()
            raise TransportUnavailable(f"UCX cannot connect: {type(exc).__name__}: {exc}") from exc
        self._msg = np.zeros(_LEN.size, np.uint8)
        self._back = np.zeros(_LEN.size, np.uint8)

    async def _connect(self, server_address: bytes) -> Any:
        ucxx = self._ucxx
        ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_ucx_address_from_buffer(server_address),
                                                            endpoint_error_handling=False)
        mine = bytes(ucxx.get_worker_address())
        hello = np.frombuffer(struct.pack("<QQ", self._base, len(mine)) + mine, np.uint8)
        await ep.send(hello, tag=_HELLO_TAG, force_tag=True)
        return ep

    def prepare(self, nbytes: int) -> None:
        if nbytes > _MAX_PAYLOAD:
            raise ValueError(f"the UCX peer sends at most {_MAX_PAYLOAD} bytes")
        self.nbytes = nbytes
        self._msg = np.empty(_LEN.size + nbytes, np.uint8)
        self._msg[:_LEN.size] = np.frombuffer(_LEN.pack(nbytes), np.uint8)
        self._msg[_LEN.size:] = payload_of(nbytes)
        self._back = np.empty_like(self._msg)

    async def _roundtrip(self) -> None:
        recv = asyncio.ensure_future(self._ucxx.recv(self._back, tag=self._base + 2))  # posted before the send
        await self._ep.send(self._msg, tag=self._base + 1, force_tag=True)
        await recv

    def roundtrip(self) -> Any:
        self._loop.run_until_complete(self._roundtrip())
        return self._back[_LEN.size:]

    def end_size(self) -> None:
        self.nbytes = 0

    def close(self) -> None:
        self.end_size()
        try:
            self._loop.run_until_complete(self._ep.close())
        finally:
            self._loop.close()
