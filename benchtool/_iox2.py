"""The iceoryx2 peer (the ``bench`` extra's ``iceoryx2``): its request-response API, blocking and spinning.

A true zero-copy peer: the client loans a request slice in iceoryx2's shared memory,
copies the payload in (as every peer's client sends a prepared payload), sends it;
the server views the request, touches one byte per page, loans a response of the same
size, copies the request into it and sends it; the client views the response.

* ``iox2``: blocking. Both sides sleep on an iceoryx2 event (a Listener), woken by the
  other's Notifier after each send: the blocking round trip iceoryx2 offers.
* ``iox2-spin``: spinning. Neither side sleeps while requests come: each polls ``receive()`` in a
  loop; the server, idle for 10 ms (between the bench's measurements), naps 0.5 ms between polls.

One client per server (the blocking server notifies one client listener).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from typing import Any

import numpy as np

from ._transport import Transport, TransportUnavailable, payload_of, touch

__all__ = ["Iox2Transport", "Iox2SpinTransport", "iox2_server", "iox2_spin_server", "remove_leftovers"]

# The spinning server polls without sleeping while requests come; after _IDLE_S without one it naps _NAP_S between
# polls (the bench starts every peer's server before the first measurement: spinning throughout, it took a core, or
# the worker's own CPU when pinned, from every other transport). A ping-pong never idles that long; the first
# request after a pause waits up to one nap (the warm-up takes it).
_IDLE_S = 0.01
_NAP_S = 0.0005

_MAX_SLICE = 256 << 20


def _names(address: str) -> tuple[str, str, str]:
    base = "shmrpc-bench/" + os.path.basename(os.path.dirname(address))
    return base + "/rr", base + "/to-server", base + "/to-client"


def _prefix(address: str) -> str:
    """The prefix of every file iceoryx2 makes for this server and its client: its private directory's name."""
    return os.path.basename(os.path.dirname(address)) + "_"


def _open(address: str) -> tuple[Any, Any, Any, Any]:
    import iceoryx2 as iox2

    iox2.set_log_level(iox2.LogLevel.Error)
    # iceoryx2's files go under the server's private directory (removed with it) and its /dev/shm ones get a prefix
    # of their own (removed by remove_leftovers): with the defaults it left /tmp/iceoryx2 and a global_mgmt segment
    # in /dev/shm that nothing removes
    config = iox2.config.default()
    config.global_cfg.root_path = iox2.Path.new(os.path.dirname(address) + "/")
    config.global_cfg.prefix = iox2.FileName.new(_prefix(address))
    node = iox2.NodeBuilder.new().config(config).create(iox2.ServiceType.Ipc)
    rr, to_server, to_client = _names(address)
    service = (node.service_builder(iox2.ServiceName.new(rr))
               .request_response(iox2.Slice[ctypes.c_uint8], iox2.Slice[ctypes.c_uint8]).open_or_create())
    ev_server = node.service_builder(iox2.ServiceName.new(to_server)).event().open_or_create()
    ev_client = node.service_builder(iox2.ServiceName.new(to_client)).event().open_or_create()
    return node, service, ev_server, ev_client


def _serve(address: str, ready: Any, blocking: bool) -> None:
    import iceoryx2 as iox2

    node, service, ev_server, ev_client = _open(address)
    server = (service.server_builder().initial_max_slice_len(64)
              .allocation_strategy(iox2.AllocationStrategy.PowerOfTwo).create())
    listener = ev_server.listener_builder().create()
    notifier = ev_client.notifier_builder().create()
    ready.set()
    last = time.perf_counter()
    while True:
        if blocking:
            listener.blocking_wait()
        req = server.receive()
        if req is None:
            # spinning: poll while requests come; idle for over _IDLE_S (between the bench's measurements), nap
            # between polls so that it does not take a core from the transports measured meanwhile
            if not blocking and time.perf_counter() - last > _IDLE_S:
                time.sleep(_NAP_S)
            continue
        last = time.perf_counter()
        data = req.payload()
        n = data.len()
        view = np.frombuffer(data.as_memory_view(), dtype=np.uint8, count=n) if n else np.empty(0, np.uint8)
        touch(view)
        resp = req.loan_slice_uninit(n)
        if n:
            ctypes.memmove(resp.payload().as_ptr(), data.as_ptr(), n)
        resp.assume_init().send()
        req.delete()
        if blocking:
            notifier.notify()


def remove_leftovers(address: str) -> None:
    """Remove what iceoryx2 left in /dev/shm for the server at ``address`` once it and its client are gone: the
    node's global management segment, which no node removes, and what a killed process left."""
    prefix = _prefix(address)
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", name))


def iox2_server(address: str, ready: Any) -> None:
    """The blocking server: sleeps on its Listener between requests."""
    _serve(address, ready, True)


def iox2_spin_server(address: str, ready: Any) -> None:
    """The spinning server: polls ``receive()`` without sleeping."""
    _serve(address, ready, False)


class Iox2Transport(Transport):
    """iceoryx2 request-response, blocking on events both ways."""

    key = "iox2"
    label = "iceoryx2 req/resp (blocking)"
    multi_client = False
    max_window = 1
    blocking = True

    def __init__(self, address: str) -> None:
        super().__init__(address)
        try:
            import iceoryx2 as iox2
        except ImportError as exc:
            raise TransportUnavailable(f"iceoryx2 is not installed: {exc}") from exc
        self._node, service, ev_server, ev_client = _open(address)
        self._client = (service.client_builder().initial_max_slice_len(64)
                        .allocation_strategy(iox2.AllocationStrategy.PowerOfTwo).create())
        self._notifier = ev_server.notifier_builder().create()
        self._listener = ev_client.listener_builder().create()
        self._payload = payload_of(0)
        self._last: tuple[Any, ...] = ()

    def prepare(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._payload = payload_of(nbytes)

    def _drop_last(self) -> None:
        for obj in self._last:
            obj.delete()
        self._last = ()

    def roundtrip(self) -> Any:
        self._drop_last()  # the previous reply's view ends here, as a zmq frame's would when replaced
        n = self.nbytes
        req = self._client.loan_slice_uninit(n)
        if n:
            ctypes.memmove(req.payload().as_ptr(), self._payload.ctypes.data, n)
        pending = req.assume_init().send()
        if self.blocking:
            self._notifier.notify()
        while True:
            resp = pending.receive()
            if resp is not None:
                break
            if self.blocking:
                self._listener.blocking_wait()
        self._last = (resp, pending)
        return resp.payload().as_memory_view() if n else b""

    def reply_bytes(self, reply: Any) -> bytes:
        return bytes(reply)

    def end_size(self) -> None:
        self._drop_last()
        self._payload = payload_of(0)
        self.nbytes = 0

    def close(self) -> None:
        self.end_size()
        for obj in (self._listener, self._notifier, self._client):
            obj.delete()
        self._node = None  # its files go with it


class Iox2SpinTransport(Iox2Transport):
    """iceoryx2 request-response, both sides polling without sleeping."""

    key = "iox2-spin"
    label = "iceoryx2 req/resp (spinning)"
    blocking = False
