"""The 16-byte header at the start of every request and response in a slot.

Byte layout (little-endian)::

    offset  0               4       6               10      12              16
            +---------------+-------+---------------+-------+---------------+
            |  request_id   |op_code|payload_length | flags |  generation   |
            |      u32      |  u16  |      u32      |  u16  |      u32      |
            +---------------+-------+---------------+-------+---------------+

* ``request_id``: chosen by the client, echoed in the response.
* ``op_code``: the code of the first step's op, from the op table announced at
  WELCOME (``0`` is never an op; it marks an empty slot).
* ``payload_length``: bytes of FlatBuffers descriptor that follow the header.
* ``flags``: the :class:`Flag` bit set below.
* ``generation`` (the DESIGN's ``reserved`` word): the slot's lease
  generation, told to the client with the lease. The worker bumps it every
  time the slot changes hands and refuses a header whose generation is not the
  slot's current one, so a client writing into a slot it no longer holds
  cannot have that request run.

Flag bits (:class:`Flag`):

====  ==========  =========================================================
bit   name        meaning
====  ==========  =========================================================
0     RESPONSE    set by the worker on every response header
1     ERROR       response only: the descriptor is an error Response
2     IN_PLACE    request: outputs may overwrite the op's first input
3     KEEP        request: some outputs are kept on the worker (``keep``)
4     GUESS       request: the room for the outputs is the client's guess (a refusal
                  for want of room is counted apart from failures; protocol 4)
5-15  (reserved)  must be zero; a request with any of them set is refused
====  ==========  =========================================================
"""

from __future__ import annotations

import enum
import struct
from typing import NamedTuple

__all__ = ["HEADER", "HEADER_NBYTES", "REQUEST_ID", "AFTER_REQUEST_ID", "Flag", "Header", "pack_into", "unpack_from"]

HEADER = struct.Struct("<IHIHI")
HEADER_NBYTES = HEADER.size  # 16
#: The header's first field, the request_id, and the rest of it (op_code, payload_length, flags, generation): a
#: repeated request's or response's header differs from the last one's in its request_id alone.
REQUEST_ID = struct.Struct("<I")
AFTER_REQUEST_ID = struct.Struct("<HIHI")

assert HEADER_NBYTES == 16 and HEADER.format == REQUEST_ID.format + AFTER_REQUEST_ID.format[1:]


class Flag(enum.IntFlag):
    """Bits of the header's ``flags`` word (the DESIGN's ``metadata_flags``)."""

    RESPONSE = 1 << 0
    ERROR = 1 << 1
    IN_PLACE = 1 << 2
    KEEP = 1 << 3
    #: the room left for the outputs is the client's guess (its first call of a signature, sent without asking
    #: the worker for the outputs' sizes): a refusal for outputs that did not fit is expected, and the worker
    #: counts it apart from failed requests (status ``guess_too_small``), since the client sends it again
    GUESS = 1 << 4

    @classmethod
    def request_mask(cls) -> int:
        """Bits a client may set on a request."""
        return int(cls.IN_PLACE | cls.KEEP | cls.GUESS)


class Header(NamedTuple):
    """A decoded header: plain values, copied out of shared memory."""

    request_id: int
    op_code: int
    payload_length: int
    flags: int
    generation: int

    def pack(self) -> bytes:
        """The 16 wire bytes of this header."""
        return HEADER.pack(*self)


def pack_into(buf: memoryview | bytearray, offset: int, header: Header) -> None:
    """Write ``header`` at ``offset`` of ``buf``."""
    HEADER.pack_into(buf, offset, *header)


def unpack_from(buf: memoryview | bytes | bytearray, offset: int = 0) -> Header:
    """Read a header at ``offset`` of ``buf`` (a copy: later writes to ``buf`` do not change it)."""
    return Header(*HEADER.unpack_from(buf, offset))
