"""The transports a user would pick instead of shmrpc, each with a server that reads the payload and returns it.

Every peer server makes a numpy view of the received payload, reads one byte per
page of it (:func:`touch`), and sends back a reply of the same size, with as few
copies as its transport allows:

* ``zmq``: pyzmq DEALER (client) / ROUTER (server) over ``ipc://``; the payload
  travels through the socket, ``copy=False`` on both sides, and the server sends
  back the very frame it received. At 64 B this is the bare ping-pong baseline.
* ``pipe``: ``multiprocessing.connection`` over an ``AF_UNIX`` stream socket (the
  same ``Connection`` class as ``multiprocessing.Pipe()``), numpy arrays pickled
  both ways.
* ``grpc``: grpcio unary call over a unix socket, a generic handler with
  identity (``None``) serializers on bytes, message limits lifted to 2 GiB.

A peer whose package is missing raises :class:`TransportUnavailable` on start.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Client as _MpClient
from multiprocessing.connection import Connection, Listener
from typing import Any

import numpy as np

from ._iox2 import Iox2SpinTransport, Iox2Transport, iox2_server, iox2_spin_server, remove_leftovers
from ._transport import ServerProcess, Transport, TransportUnavailable, payload_of, touch
from ._ucx import UcxTransport, ucx_server

__all__ = ["ZmqTransport", "PipeTransport", "GrpcTransport", "PEERS", "start_peer_server"]

_GRPC_METHOD = "/shmrpc.bench.Echo/Echo"
_GRPC_MAX = 2**31 - 1
_GRPC_OPTIONS = [("grpc.max_receive_message_length", _GRPC_MAX), ("grpc.max_send_message_length", _GRPC_MAX)]


# --------------------------------------------------------------------- servers (run in spawn children)


def _zmq_server(address: str, ready: Any) -> None:
    """ROUTER echo loop: view the payload, touch it, send the same frame back."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"ipc://{address}")
    ready.set()
    while True:
        ident, frame = sock.recv_multipart(copy=False)
        touch(np.frombuffer(frame.buffer, dtype=np.uint8))
        sock.send_multipart([ident, frame], copy=False)


def _pipe_serve_conn(conn: Connection) -> None:
    """One connection's loop: unpickle an array, touch it, pickle it back, until the client goes (which a Ctrl-C
    does in the middle of a round trip: in the send too)."""
    with conn:
        while True:
            try:
                arr = conn.recv()
                touch(arr.view(np.uint8).reshape(-1))
                conn.send(arr)
            except (EOFError, OSError):
                return


def _pipe_server(address: str, ready: Any) -> None:
    """Accept ``multiprocessing.connection`` clients on a unix socket, a thread each."""
    with Listener(address, family="AF_UNIX") as listener:
        ready.set()
        while True:
            conn = listener.accept()
            threading.Thread(target=_pipe_serve_conn, args=(conn,), daemon=True).start()


def _grpc_echo(request: bytes, context: Any) -> bytes:
    """The gRPC handler: view the payload, touch it, return the same bytes."""
    touch(np.frombuffer(request, dtype=np.uint8))
    return request


def _grpc_server(address: str, ready: Any) -> None:
    """A grpcio server with one generic unary bytes method on ``unix:address``."""
    import grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=_GRPC_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "shmrpc.bench.Echo",
        {"Echo": grpc.unary_unary_rpc_method_handler(_grpc_echo, request_deserializer=None, response_serializer=None)},
    )
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix:{address}")
    server.start()
    ready.set()
    server.wait_for_termination()


# --------------------------------------------------------------------- clients


class ZmqTransport(Transport):
    """pyzmq DEALER over ipc://, payload through the socket, ``copy=False``."""

    key = "zmq"
    label = "pyzmq DEALER/ROUTER ipc"

    def __init__(self, address: str) -> None:
        super().__init__(address)
        try:
            import zmq
        except ImportError as exc:  # pragma: no cover - pyzmq is a core dependency
            raise TransportUnavailable(f"pyzmq is not installed: {exc}") from exc
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(f"ipc://{address}")
        self._payload: Any = payload_of(0)  # an ndarray; Any since pyzmq's stubs want a typing.Buffer

    def prepare(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._payload = payload_of(nbytes)

    def roundtrip(self) -> Any:
        self._sock.send(self._payload, copy=False)
        return self._sock.recv(copy=False)

    def start(self) -> Any:
        self._sock.send(self._payload, copy=False)
        return None

    def finish(self, handle: Any) -> Any:
        return self._sock.recv(copy=False)

    def reply_bytes(self, reply: Any) -> bytes:
        return bytes(reply.buffer)

    def end_size(self) -> None:
        self._payload = payload_of(0)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class PipeTransport(Transport):
    """``multiprocessing.connection`` (as ``Pipe()``) with pickled numpy arrays."""

    key = "pipe"
    label = "multiprocessing Pipe (pickle)"

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self._conn = _MpClient(address, family="AF_UNIX")
        self._payload: np.ndarray = payload_of(0)
        # A window of requests needs the sends on another thread: a large send
        # blocks until the server reads, and the server blocks until we read.
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pipe-send")

    def prepare(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._payload = payload_of(nbytes)

    def roundtrip(self) -> Any:
        self._conn.send(self._payload)
        return self._conn.recv()

    def start(self) -> Any:
        return self._sender.submit(self._conn.send, self._payload)

    def finish(self, handle: Future[None]) -> Any:
        reply = self._conn.recv()
        handle.result()
        return reply

    def end_size(self) -> None:
        self._payload = payload_of(0)

    def close(self) -> None:
        self._sender.shutdown(wait=True)
        self._conn.close()


class GrpcTransport(Transport):
    """grpcio unary call over a unix socket, identity serializers on bytes."""

    key = "grpc"
    label = "gRPC unary unix socket"

    def __init__(self, address: str) -> None:
        super().__init__(address)
        try:
            import grpc
        except ImportError as exc:
            raise TransportUnavailable(f"grpcio is not installed (pip install 'shmrpc[bench]'): {exc}") from exc
        self._channel = grpc.insecure_channel(f"unix:{address}", options=_GRPC_OPTIONS)
        grpc.channel_ready_future(self._channel).result(timeout=30)
        self._call = self._channel.unary_unary(_GRPC_METHOD, request_serializer=None, response_deserializer=None)
        self._payload = b""

    def prepare(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._payload = payload_of(nbytes).tobytes()

    def roundtrip(self) -> Any:
        return self._call(self._payload)

    def start(self) -> Any:
        return self._call.future(self._payload)

    def finish(self, handle: Any) -> Any:
        return handle.result()

    def end_size(self) -> None:
        self._payload = b""

    def close(self) -> None:
        self._channel.close()


#: Peer key -> (client class, server function, socket file name, module it needs).
PEERS: dict[str, tuple[type[Transport], Any, str, str]] = {
    "zmq": (ZmqTransport, _zmq_server, "zmq.sock", "zmq"),
    "pipe": (PipeTransport, _pipe_server, "pipe.sock", "multiprocessing"),
    "grpc": (GrpcTransport, _grpc_server, "grpc.sock", "grpc"),
    "iox2": (Iox2Transport, iox2_server, "iox2", "iceoryx2"),
    "iox2-spin": (Iox2SpinTransport, iox2_spin_server, "iox2", "iceoryx2"),
    "ucx": (UcxTransport, ucx_server, "ucx.addr", "ucxx"),
}


def start_peer_server(key: str) -> ServerProcess:
    """Start the server of peer ``key`` in a spawn child; its ``address`` is what the client class connects to.

    Raises:
        TransportUnavailable: the peer's package is not installed or its server did not start.
        KeyError: ``key`` is not a peer.
    """
    import importlib.util

    _, target, sock_name, module = PEERS[key]
    if importlib.util.find_spec(module) is None:
        extra = "ucx" if module == "ucxx" else "bench"  # UCX is an extra of its own (about 250 MB)
        raise TransportUnavailable(f"{module} is not installed (pip install 'shmrpc[{extra}]'); the {key} peer is skipped")
    return ServerProcess(target, sock_name, cleanup=remove_leftovers if module == "iceoryx2" else None)
