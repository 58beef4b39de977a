"""A lane: a doorbell beside ZeroMQ for one client's synchronous calls (opt-in, ``HELLO.lane``).

A lane is one 4096-byte page shared by the worker and one client (a memfd the worker
creates and hands over with the WELCOME, never named), and two eventfds: the
worker's doorbell (one per worker, shared by every lane) and the client's.

Page layout (little-endian; the two seq words in native order, which is little-endian on
every host shmrpc supports; each side writes only its own cache lines)::

    offset  size  written by  field
    ------  ----  ----------  -----------------------------------------------------------
         0     8  client      call_seq    u64: bumped once per request, after call_frame
         8     4  client      call_len    u32: bytes of call_frame (the worker refuses > 64)
        16    64  client      call_frame  a CALL frame exactly as on ZeroMQ (messages.pack_call)
        96     8  client      client_awake u64: CLOCK_MONOTONIC ns until which the client polls done_seq (0: none)
       104     8  client      call_soon   u64: the call_seq of a request the client is about to ring (0: none)
       128     8  worker      done_seq    u64: set to the call_seq it answers, after done_frame
       136     4  worker      done_len    u32: bytes of done_frame
       144    64  worker      done_frame  a DONE frame exactly as on ZeroMQ (messages.pack_done)
       224     8  worker      worker_awake u64: CLOCK_MONOTONIC ns until which the worker polls call_seq (0: none)
       232     8  worker      taken_seq   u64: the call_seq the worker has taken and is working on (0: none yet)

Ringing: the client writes call_frame and call_len, then call_seq (# NOTE: order is
important here: the seq is the publication point), then writes 1 to the worker's
eventfd. Answering: the worker writes done_frame and done_len, then done_seq, then
writes 1 to the client's eventfd. The worker may also write the client's eventfd with no
new done_seq (a PULSE: an answer due soon, schema/messages.py); the client then finds no
DONE and waits again. The side that waits may spin on the other's seq word for a bounded
time; when it stops spinning it blocks in poll() on its eventfd (with the peer's pidfd),
and after every wake-up reads the seq word again.

Early wake: a worker whose last answer in a lane came soon after it took that request
(within EARLY_WAKE_NS) writes taken_seq when it takes the next one and wakes a client
that does not poll at once, before running the request, so that the client's wake-up
(about 10 µs on a host whose idle CPUs halt) overlaps the request's work instead of
following it. A client woken with no DONE in the page whose taken_seq is the call_seq
it rang polls done_seq for at most EARLY_SPIN_NS (saying so in client_awake, so the
DONE may skip its eventfd write), then blocks again: a core is busy only while an
answer that the worker said is near is pending, and for a bounded time. A client that
ignores taken_seq only gets an extra wake-up, never a lost one.

Early ring: a client about to ring a request whose inputs it copies into the slot first
(``call()``) may write call_soon (the call_seq it will ring) and the worker's eventfd before
the copies, unless the worker says it polls. A worker that finds a lane's call_soon at the
lane's next call_seq, with no new request yet, reads the lanes until a request is there, for
at most SOON_NS: its wake-up overlaps the client's copies. It says nothing in worker_awake
(the ring still writes the doorbell). It does so once per call_seq of a lane, so a client
that announces requests it never rings costs the worker at most one such poll per request it
does ring.

Linger: a worker that answers a lane's request reads the lanes for its linger time
(LINGER_NS unless ``serve --lane-linger-us`` says otherwise; 0: never) after the DONE
instead of sleeping, and says so in worker_awake, when the client came back soon after
the lane's answer before: the worker took the request within the linger time of that
answer if it lingered after it, within twice the linger time if it slept (the take then
counts its own wake-up). A linger in vain (the next request came after it ended) gives
the lane's next request no chance to be lingered after, and each further one in a row
twice as many (3, 7, ... up to 63 requests), until a linger pays again. A client that
comes back at once finds the worker awake (no wake-up of the worker's, no doorbell write
of its own); a lane whose client comes back later costs a linger in vain less and less
often, so a core is busy only while a lane's requests follow each other closely, and
at most the linger time per request.

Follow: a blocking client whose ring finds the worker polling (it lingers or spins: worker_awake
read before the ring) and whose last answer came within EARLY_SPIN_NS of its ring says in
client_awake that it polls until EARLY_SPIN_NS from its ring and polls done_seq that long
before it blocks. A client sending back to back to a lingering worker then has no wake-up on
either side of its round trip, and the DONE needs no eventfd write. Its core is busy only while
a request is pending, the worker's is busy too, and at most EARLY_SPIN_NS per request.

Awake words: a side that will poll the other's seq word until a time T says so in
its awake word (the client before its call_seq, for the request it rings; the
worker just before a DONE, for the next request, while it spins, ``serve --spin-us``, or
lingers: a client that sees the DONE sees the word too).
The other side, after its own seq store, reads the clock and that word, and skips
its eventfd write when the clock is more than AWAKE_MARGIN_NS before T: a poller
needs no wake-up, and the write is a system call. What makes a skipped write
safe is the rule the advertising side keeps: it never blocks, from the moment it
writes T, until it has read the other's seq word once at a time after T (a
blocking wait that would pass T is cut short at T). A seq store made more than
AWAKE_MARGIN_NS before T is visible by then, so no wake-up is lost, whether or
not either side spins; a stale or zero awake word only makes the reader ring.

The worker trusts nothing in the page: call_seq is only compared for change,
call_len is bounded, the frame is copied out and then goes through exactly the
checks a CALL from ZeroMQ goes through (lease, owner, generation, header,
descriptor). The client, in turn, checks that done_frame answers its request.
"""

from __future__ import annotations

import ctypes
import mmap
import struct
from typing import Any

__all__ = [
    "LANE_NBYTES", "FRAME_MAX", "CALL_SEQ", "CALL_LEN", "CALL_FRAME", "DONE_SEQ", "DONE_LEN", "DONE_FRAME",
    "CLIENT_AWAKE", "WORKER_AWAKE", "TAKEN_SEQ", "CALL_SOON", "AWAKE_MARGIN_NS", "EARLY_WAKE_NS", "EARLY_SPIN_NS",
    "SOON_NS", "LINGER_NS", "SEQ", "LEN",
    "post", "read_frame", "seq_word",
]

LANE_NBYTES = 4096
FRAME_MAX = 64  # the longest frame either side accepts (a CALL is 16 B, a DONE 14 B)
CALL_SEQ, CALL_LEN, CALL_FRAME = 0, 8, 16
DONE_SEQ, DONE_LEN, DONE_FRAME = 128, 136, 144
CLIENT_AWAKE, WORKER_AWAKE = 96, 224  # each in a cache line its writer owns
TAKEN_SEQ = 232  # the worker's line
CALL_SOON = 104  # the client's line
# A ring or answer within this much of the other side's advertised end of polling still wakes it: the margin
# covers the time a seq store takes to be seen by another core (nanoseconds) many times over.
AWAKE_MARGIN_NS = 50_000
# Early wake: the worker wakes a blocking client when it takes a request if the lane's last request was answered within
# this long of its take; a client so woken polls for the DONE at most EARLY_SPIN_NS before it blocks again. The spin
# outlasts the margin by as much as a prediction may miss: a DONE within EARLY_SPIN_NS - AWAKE_MARGIN_NS of the
# client's wake-up skips its eventfd write.
EARLY_WAKE_NS = 50_000
EARLY_SPIN_NS = 150_000
# Early ring: how long a worker polls the lanes for a request a client said it is about to ring.
SOON_NS = 50_000
# Linger: how long a worker reads the lanes after answering a lane whose client came back within this long after its
# previous answer (the default of ``serve --lane-linger-us``). Longer than AWAKE_MARGIN_NS, so that a client coming
# back within the difference skips the doorbell.
LINGER_NS = 100_000
SEQ = struct.Struct("<Q")  # for reading a seq word in tests and tools; the two sides use seq_word()


def seq_word(buf: Any, offset: int) -> ctypes.c_uint64:
    """The seq word at ``offset`` of ``buf`` (a writable buffer: the page's mmap) as one aligned 8-byte integer.

    # NOTE: never write a seq word with struct.pack_into: CPython clears the bytes first, then writes
    # them, so a reader can see 0 (or half a value) in between and take it for a new request.
    # ``c_uint64.value`` is one aligned store or load (x86-64 and aarch64, both little-endian).
    """
    return ctypes.c_uint64.from_buffer(buf, offset)
LEN = struct.Struct("<I")


def post(page: Any, word: ctypes.c_uint64, seq_at: int, seq: int, frame: bytes) -> None:
    """Write ``frame`` then its length then ``seq`` (through ``word``, its seq_word) into the half of ``page`` (the
    page's mmap, or a memoryview of it) starting at ``seq_at``."""
    n = len(frame)
    page[seq_at + 16:seq_at + 16 + n] = frame
    LEN.pack_into(page, seq_at + 8, n)
    # NOTE: order is important here: the seq word last, it publishes the frame.
    word.value = seq


def read_frame(page: mmap.mmap, seq_at: int) -> bytes | None:
    """A private copy of the frame in the half of ``page`` (the page's mmap: its slices are bytes) at ``seq_at``;
    None if its length is out of bounds."""
    (n,) = LEN.unpack_from(page, seq_at + 8)
    if n > FRAME_MAX:
        return None
    return page[seq_at + 16:seq_at + 16 + n]
