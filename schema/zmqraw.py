"""pyzmq's Cython socket calls with plain int flags, for the per-request paths of the worker's loop and the client.

pyzmq's sugar layer (``zmq.Socket.send``, ``recv``, ``getsockopt``, ``send_multipart``) builds enum flags and
lists per message and wraps ``getsockopt(EVENTS)``'s answer in an enum; the Cython base class underneath takes
plain ints. ``RAW_SEND(sock, frame, flags)``, ``RAW_RECV(sock, flags)`` and ``RAW_GET(sock, option)`` call it
directly (``sock`` a ``zmq.Socket``); the flags here are plain ints, since ``int & IntFlag`` goes through the enum
machinery too.
"""

from __future__ import annotations

from typing import Any

import zmq

__all__ = ["RAW_SEND", "RAW_RECV", "RAW_GET", "POLLIN", "EVENTS", "NOBLOCK", "SNDMORE", "RCVMORE"]

_ZMQ_SOCKET: Any = zmq.Socket.__mro__[1]  # zmq.backend's Socket (send, recv, get)
RAW_SEND, RAW_RECV, RAW_GET = _ZMQ_SOCKET.send, _ZMQ_SOCKET.recv, _ZMQ_SOCKET.get
POLLIN = int(zmq.POLLIN)
EVENTS = int(zmq.EVENTS)
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)
RCVMORE = int(zmq.RCVMORE)
