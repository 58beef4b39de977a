"""Control messages between client (ZeroMQ DEALER) and worker (ROUTER).

Every message is ONE ZeroMQ frame (the ROUTER adds the peer identity in front
of it). Its first byte says what it is; no payload bytes ever travel here.

====  ==========  =========  ==============================================
kind  name        direction  body after the kind byte
====  ==========  =========  ==============================================
H     HELLO       c -> w     JSON: protocol, schema_hash, pid, uid, lease
W     WELCOME     w -> c     JSON: protocol, schema_hash, worker_pid, regions,
                             geometry, op_table, lease, backend, client_id
C     CALL        c -> w     ``CALL`` struct: region u16, slot u32, request_id u32,
                             generation u32 (the request is in the slot)
D     DONE        w -> c     ``DONE`` struct: region u16, slot u32, request_id u32,
                             status u16 (the response is in the slot)
K     ATTACHED    c -> w     empty: the client has mapped every region of its WELCOME (the worker
                             then unlinks the names of the client's private regions)
A     ACQUIRE     c -> w     JSON: nbytes (borrow one more slot of that size)
G     GRANT       w -> c     JSON: region, slot, generation, slot_nbytes
R     RELEASE     c -> w     ``SLOT`` struct: region u16, slot u32 (give back a borrowed slot)
B     BYE         c -> w     empty: end of the lease
M     MANAGE      c -> w     JSON: action "list" | "drop", name (resident tensors)
m     MANAGED     w -> c     JSON: {"resident": {name: {shape, dtype}}} or {"dropped": name}
S     STATUS      c -> w     empty: ask for the worker's state (no lease needed)
s     STATE       w -> c     JSON: regions, leases, in-flight requests, counters
E     ERROR       w -> c     JSON: code, message, field (a control message was refused)
====  ==========  =========  ==============================================

Ordering: the client writes tensors, then the descriptor, then the header, and
only then sends CALL. The send is the publication point; the client writes
nothing into the slot until DONE for that request_id arrives. The worker writes
outputs, then the response descriptor, then the response header, then sends DONE.
"""

from __future__ import annotations

import json
import struct
from typing import Any

__all__ = [
    "PROTOCOL_VERSION",
    "HELLO", "WELCOME", "CALL", "DONE", "ACQUIRE", "GRANT", "RELEASE", "BYE", "STATUS", "STATE", "ERROR",
    "MANAGE", "MANAGED", "ATTACHED",
    "CALL_STRUCT", "DONE_STRUCT", "SLOT_STRUCT", "TRACE_STRUCT",
    "pack_json", "unpack_json", "pack_call", "unpack_call", "pack_done", "unpack_done",
]

PROTOCOL_VERSION = 1

HELLO = b"H"
WELCOME = b"W"
CALL = b"C"
DONE = b"D"
ACQUIRE = b"A"
GRANT = b"G"
RELEASE = b"R"
BYE = b"B"
MANAGE = b"M"
ATTACHED = b"K"
MANAGED = b"m"
STATUS = b"S"
STATE = b"s"
ERROR = b"E"

CALL_STRUCT = struct.Struct("<cxHIII")  # kind, pad, region, slot, request_id, generation: 16 B
DONE_STRUCT = struct.Struct("<cxHIIH")  # kind, pad, region, slot, request_id, status: 14 B
SLOT_STRUCT = struct.Struct("<cxHI")  # kind, pad, region, slot: 8 B
#: Optional tail of a CALL frame (a 41-byte CALL): the caller's W3C trace context in binary, trace_id
#: (16 B), parent span_id (8 B), trace flags (1 B). Sent only by a client that traces (``Client(trace=...)``);
#: a worker that does not trace ignores it.
TRACE_STRUCT = struct.Struct("<16s8sB")


def pack_json(kind: bytes, obj: Any) -> bytes:
    """A JSON control message."""
    return kind + json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(frame: bytes) -> Any:
    """The JSON body of a control message; raises ValueError when it is not JSON."""
    return json.loads(bytes(frame[1:]).decode())


def pack_call(region: int, slot: int, request_id: int, generation: int) -> bytes:
    """A CALL frame."""
    return CALL_STRUCT.pack(CALL, region, slot, request_id, generation)


def unpack_call(frame: bytes) -> tuple[int, int, int, int]:
    """(region, slot, request_id, generation) of a CALL frame; raises struct.error when malformed."""
    _, region, slot, request_id, generation = CALL_STRUCT.unpack(frame)
    return region, slot, request_id, generation


def pack_done(region: int, slot: int, request_id: int, status: int) -> bytes:
    """A DONE frame."""
    return DONE_STRUCT.pack(DONE, region, slot, request_id, status)


def unpack_done(frame: bytes) -> tuple[int, int, int, int]:
    """(region, slot, request_id, status) of a DONE frame."""
    _, region, slot, request_id, status = DONE_STRUCT.unpack(frame)
    return region, slot, request_id, status
