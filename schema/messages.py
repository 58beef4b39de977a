"""Control messages between client and worker: the handshake on the attach socket, the rest on ZeroMQ.

HELLO and WELCOME (or ERROR) are one packet each on the worker's attach socket
(``<NAME>.attach``, AF_UNIX SOCK_SEQPACKET): there both sides read the other's
pid and uid from the kernel (``SO_PEERCRED``), and WELCOME carries the regions as
file descriptors (``SCM_RIGHTS``, in the order of its ``regions`` list) and a secret
``token``. Every later message is ONE ZeroMQ frame from a DEALER whose routing id is
that token (the ROUTER adds it in front); the worker acts only for tokens it issued.
The first byte says what a message is; no payload bytes ever travel here. The JSON
bodies are typed in ``schema.control`` (fields, types, parsing rules); this table only names them.

====  ==========  =========  ==============================================
kind  name        direction  body after the kind byte
====  ==========  =========  ==============================================
H     HELLO       c -> w     JSON: protocol, schema_hash, pid, uid, start_ticks (attach socket;
                             each must equal what the kernel says of the peer), and optionally
                             lease (slots wanted per size class, capped by the worker's --lease-max)
                             and lane (ask for a lane: schema/lane.py)
W     WELCOME     w -> c     JSON: protocol, schema_hash, worker_pid, worker_start_ticks, token,
                             regions (+ their fds), geometry, op_table, lease, backend, client_id,
                             and lane when one was asked for (+ its fds) (attach socket)
C     CALL        c -> w     ``CALL`` struct: region u16, slot u32, request_id u32,
                             generation u32 (the request is in the slot)
D     DONE        w -> c     ``DONE`` struct: region u16, slot u32, request_id u32,
                             status u16 (the response is in the slot, unless
                             status has the ``NO_RESPONSE`` bit)
A     ACQUIRE     c -> w     JSON: nbytes (borrow one more slot of at least that whole size), wait_s, id
G     GRANT       w -> c     JSON: region, slot, generation, slot_nbytes, id (the ACQUIRE's)
R     RELEASE     c -> w     ``SLOT`` struct: region u16, slot u32 (give back a borrowed slot)
B     BYE         c -> w     empty: end of the lease
M     MANAGE      c -> w     JSON: action "list" | "drop", name (resident tensors), or action
                             "plan" (output specs of a request: ``schema/planquery.py``), id
m     MANAGED     w -> c     JSON: resident ({name: {shape, dtype}}) or dropped (name) or outputs
                             ({name: [shape, dtype]}), id (the MANAGE's)
S     STATUS      c -> w     empty: ask for the worker's state (no lease needed)
s     STATE       w -> c     JSON: regions, leases, in-flight requests, counters
E     ERROR       w -> c     JSON: code, kind, message, field, and id when it answers ACQUIRE or MANAGE
P     PULSE       w -> c     empty: a DONE of this client is due within about 0.2 ms (a launched request
                             of 1 ms or more nearing its end); the client discards it
====  ==========  =========  ==============================================

Size: a message to the worker is at most :data:`MAX_MESSAGE_NBYTES`; the worker's socket
drops the connection of a peer that sends a larger one (ZeroMQ ``MAXMSGSIZE``), so no
peer can make it buffer more. A message of more than one frame is answered with ERROR.

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
    "PROTOCOL_VERSION", "MAX_MESSAGE_NBYTES",
    "HELLO", "WELCOME", "CALL", "DONE", "ACQUIRE", "GRANT", "RELEASE", "BYE", "STATUS", "STATE", "ERROR", "PULSE",
    "MANAGE", "MANAGED", "ATTACH_MAX_NBYTES", "TOKEN_NBYTES",
    "CALL_STRUCT", "DONE_STRUCT", "SLOT_STRUCT", "TRACE_STRUCT", "NO_RESPONSE",
    "pack_json", "unpack_json", "pack_call", "unpack_call", "pack_done", "unpack_done",
]

#: 3: ACQUIRE and MANAGE carry an ``id`` that GRANT, MANAGED and ERROR echo; 4: the header's GUESS request flag.
PROTOCOL_VERSION = 4

#: Largest HELLO or WELCOME packet on the attach socket.
ATTACH_MAX_NBYTES = 1 << 20
#: Random bytes in a session token (sent as hex; the DEALER's routing id is the hex's ASCII).
TOKEN_NBYTES = 16

#: Most bytes of one message to the worker (the largest legitimate one, a HELLO, is a few hundred).
MAX_MESSAGE_NBYTES = 64 * 1024

HELLO = b"H"
WELCOME = b"W"
CALL = b"C"
DONE = b"D"
ACQUIRE = b"A"
GRANT = b"G"
RELEASE = b"R"
BYE = b"B"
MANAGE = b"M"
MANAGED = b"m"
STATUS = b"S"
STATE = b"s"
ERROR = b"E"
PULSE = b"P"

CALL_STRUCT = struct.Struct("<cxHIII")  # kind, pad, region, slot, request_id, generation: 16 B
DONE_STRUCT = struct.Struct("<cxHIIH")  # kind, pad, region, slot, request_id, status: 14 B
SLOT_STRUCT = struct.Struct("<cxHI")  # kind, pad, region, slot: 8 B
#: Optional tail of a CALL frame (a 41-byte CALL): the caller's W3C trace context in binary, trace_id
#: (16 B), parent span_id (8 B), trace flags (1 B). Sent only by a client that traces (``Client(trace=...)``);
#: a worker that does not trace ignores it.
TRACE_STRUCT = struct.Struct("<16s8sB")

#: Bit 15 of a DONE's status: the doorbell was refused and the slot left untouched (no response in
#: it; the slot may not even be the sender's). The low 15 bits are the error's wire code
#: (``schema.errors``). Without this bit, status 0 is success and ``1..0x7FFF`` means an error
#: response descriptor is in the slot.
NO_RESPONSE = 0x8000


def pack_json(kind: bytes, obj: Any) -> bytes:
    """A JSON control message."""
    return kind + json.dumps(obj, separators=(",", ":")).encode()


def unpack_json(frame: bytes) -> Any:
    """The JSON body of a control message; raises ValueError when it is not JSON (or nested too deep)."""
    try:
        return json.loads(bytes(frame[1:]).decode())
    except RecursionError:
        raise ValueError("the JSON body is nested too deeply") from None


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
