"""shmrpc.schema: the wire contract shared by client and worker.

Depends on nothing of shmrpc's own; only ``flatbuffers`` and ``numpy``.

* :mod:`.header`: the 16-byte header and its flag bits.
* :mod:`.layout`: region superblock, slot size classes, tensor alignment.
* :mod:`.descriptor`: request/response descriptors <-> FlatBuffers bytes.
* :mod:`.messages`: the ZeroMQ control messages (HELLO, CALL, DONE, ...).
* :mod:`.optable`: the op table announced at WELCOME (entry format, build and parse).
* :mod:`.errors`: the error tree with wire codes.
* :mod:`.dtypes`: tensor element types.
* :mod:`.fbshash`: what of ``shmrpc.fbs`` the schema hash covers, and the function computing it.
"""

from __future__ import annotations

from . import descriptor, dtypes, errors, header, layout, messages, naming, optable
from ._hash import SCHEMA_HASH
from .messages import PROTOCOL_VERSION

__all__ = ["SCHEMA_HASH", "PROTOCOL_VERSION", "descriptor", "dtypes", "errors", "header", "layout", "messages", "naming", "optable"]
