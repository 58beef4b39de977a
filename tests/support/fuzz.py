"""Hostile-input fuzzing of a shmrpc worker: ``python -m tests.support.fuzz [--cases 100000] [--seed S]``.

(From the repository root; ``python tests/support/fuzz.py ...`` works too. The suite imports the
same generators as ``support.fuzz``.)

The program starts its own NumPy worker, then plays a hostile process of the same uid:

* ``RawSession``: its own HELLO on the attach socket, regions mapped read-write from the fds it
  receives, its own DEALER under the session token; no help from the SDK.
  Each case writes a request into one of its own slots and rings with a CALL (or sends a
  raw frame), then waits for the answer with a timeout.
* A canary: an honest :class:`shmrpc.client.Client` (B) that fills every byte of two of
  its slots with a seeded pattern before the run. After every case the whole region,
  except the fuzzing session's own slots, must be byte-identical to before.

Case kinds (the same generators back ``tests/e2e/test_fuzz.py``):

========== ==============================================================================
header     random 16-byte header (or one field randomized) over a valid descriptor
desc       a valid descriptor with byte flips, truncation, extension or a splice
tensor     random ops, pipelines, attrs, tensor offsets/shapes/dtypes/nbytes/flags
doorbell   random frames starting with ``C``: wrong lengths, random region/slot/generation
hello      ``H`` + random JSON, a mutated valid HELLO, or garbage, on a fresh attach connection
========== ==============================================================================

Invariants, checked after every case: the worker process is alive; the answer is a
success or a typed error (DONE status, or an ERROR/WELCOME control reply), never
silence (each wait has a timeout: silence is counted as ``hang``); the canary bytes are
intact; and every 500 cases (and at the end) a good request through B succeeds.

Dims are chosen so that no output or intermediate can reach a size that would take the
host's memory: small dims are at most 255 and at most 2 of them; huge ones (>= 2**44)
only ever make allocations the kernel refuses at once (heuristic overcommit; see
docs/reliability.md before running this where ``vm.overcommit_memory`` is 1).

Prints progress and a table; writes ``bench/results/fuzz-<date>.json``.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import json
import math
import mmap
import os
import platform
import random
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from shmrpc.client import Client
from shmrpc.schema import SCHEMA_HASH
from shmrpc.schema import messages as m
from shmrpc.schema.descriptor import RequestDesc, StepDesc, TensorRef, decode_request, decode_response, encode_request
from shmrpc.schema.dtypes import DTYPE_CODES, itemsize
from shmrpc.schema.errors import WIRE_CODES
from shmrpc.schema.header import HEADER, Flag
from shmrpc.schema.layout import Geometry
from shmrpc.schema.messages import NO_RESPONSE
from shmrpc.schema.naming import attach_path, endpoint, lock_path, region_prefix, socket_path
from shmrpc.schema.proc import process_start_ticks, read_stat

__all__ = ["FUZZ_SLOTS", "FUZZ_LEASE", "Case", "RawSession", "Fuzzer", "KINDS", "GENERATORS", "start_worker",
           "valid_descs", "machine_facts", "main"]

ROOT = Path(__file__).resolve().parents[2]
#: Worker geometry of a fuzz run: each session leases 4 x 64K and 1 x 1M; room for A, B and a few HELLOs.
FUZZ_SLOTS = "64K:12,1M:3"
FUZZ_LEASE = "4,1"
REPLY_TIMEOUT_S = 1.0
DESC = 4096  # descriptor area (checked against the WELCOME's geometry)
KINDS = ("header", "desc", "tensor", "doorbell", "hello")
DTYPES = tuple(DTYPE_CODES)
SMALL_DIMS = (0, 1, 1, 2, 3, 4, 5, 7, 8, 16, 17, 31, 64, 128, 255)
HUGE_DIMS = (2**44, 2**50, 2**62, 2**63 - 1)
NASTY_INTS = (0, 1, -1, 2**31, 2**32, 2**63 - 1, -(2**63), 2**64, 10**30)


@dataclass
class Case:
    """One fuzz case: what to send, and how it was made (for the report)."""

    kind: str
    header: bytes = b""  # 16 bytes written at slot offset 0
    payload: bytes = b""  # written at offset 16
    fill: bool = True  # fill the data area with random bytes first
    slot_nbytes: int = 0  # at least this big a slot (0: the smallest)
    rid: int | None = None  # the CALL's request_id (None: the header's)
    gen_delta: int = 0  # added to the slot's generation in the CALL
    frame: bytes = b""  # doorbell/hello: the raw frame
    note: str = ""


# ------------------------------------------------------------ generators (rng: random.Random or hypothesis' Random)


def valid_descs() -> list[tuple[bytes, int]]:
    """A few valid requests (descriptor bytes, bytes of data area they need) to mutate."""
    D = DESC
    f4 = (TensorRef("x", "float32", (4,), D, 16), TensorRef("y", "float32", (4,), D + 64, 16))
    out = [
        (encode_request(RequestDesc((StepDesc("vector_add", 0, (("x", "x"), ("y", "y")), (("out", "out"),)),), f4,
                                    ("out",))), 256),
        (encode_request(RequestDesc((StepDesc("scale", 3, (("x", "x"),), (("out", "out"),), (("a", 2.0), ("b", 1.0))),),
                                    f4[:1], ("out",))), 128),
        (encode_request(RequestDesc((StepDesc("scale", 0, (("x", "x"),), (("out", "t"),), (("a", 2.0),)),
                                     StepDesc("vector_add", 0, (("x", "t"), ("y", "y")), (("out", "out"),))), f4,
                                    ("out",))), 256),
        (encode_request(RequestDesc((StepDesc("gemm", 0, (("x", "x"), ("w", "w")), (("out", "out"),)),),
                                    (TensorRef("x", "float32", (2, 3), D, 24), TensorRef("w", "float32", (3, 4), D + 64, 48)),
                                    ("out",))), 256),
        (encode_request(RequestDesc((StepDesc("echo", 0, (("x", "x"),), (("out", "out"),)),),
                                    (TensorRef("b", "uint8", (100,), D, 100), TensorRef("x", "uint8", (100,), D, 100)),
                                    ("out",))), 128),
        (encode_request(RequestDesc((StepDesc("softmax", 0, (("x", "x"),), (("out", "out"),)),),
                                    (TensorRef("x", "float16", (4, 8), D, 64),), ("out",))), 256),
    ]
    return out


_VALID = valid_descs()


def _header(rid: int, op: int, plen: int, flags: int, gen: int) -> bytes:
    return HEADER.pack(rid & 0xFFFFFFFF, op & 0xFFFF, plen & 0xFFFFFFFF, flags & 0xFFFF, gen & 0xFFFFFFFF)


def gen_header(rng: random.Random) -> Case:
    """A valid descriptor under a random (or partly random) header."""
    payload, need = rng.choice(_VALID)
    rid = rng.getrandbits(32)
    fields = [rid, 0, len(payload), 0, -1]  # -1: the slot's generation, filled in at ring time
    mode = rng.random()
    if mode < 0.3:
        raw = bytes(rng.getrandbits(8) for _ in range(16))
        return Case("header", header=raw, payload=payload, rid=rid if rng.random() < 0.5 else None, note="random16")
    i = rng.randrange(5)
    fields[i] = rng.choice((rng.getrandbits(32), rng.getrandbits(16), 0, 1, 0xFFFF, 0xFFFFFFFF,
                            len(payload) + rng.randint(-8, 8), 1 << rng.randrange(16)))
    return Case("header", header=_pack_header_fields(fields), payload=payload, rid=rid, note=f"field{i}")


def _pack_header_fields(fields: list[int]) -> bytes:
    """Header bytes; a generation of -1 is patched with the slot's at ring time (marker: rid echoed)."""
    rid, op, plen, flags, gen = fields
    return _header(rid, op, plen, flags, 0xFFFFFFFF if gen == -1 else gen) + (b"G" if gen == -1 else b"")


def gen_desc(rng: random.Random) -> Case:
    """A valid descriptor, mutated: byte flips, truncation, extension, splice of two."""
    payload, need = rng.choice(_VALID)
    b = bytearray(payload)
    how = rng.choice(("flip", "flip", "flip", "truncate", "extend", "splice", "set"))
    if how == "flip":
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif how == "set":
        for _ in range(rng.randint(1, 4)):
            j = rng.randrange(max(1, len(b) - 4))
            b[j:j + 4] = struct.pack("<I", rng.choice((0, 0xFFFFFFFF, 0x7FFFFFFF, len(b), rng.getrandbits(32))))
    elif how == "truncate":
        del b[rng.randrange(len(b)):]
    elif how == "extend":
        b += bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 64)))
    else:
        other, _ = rng.choice(_VALID)
        j = rng.randrange(len(b))
        b[j:] = other[rng.randrange(len(other)):]
    payload = bytes(b[:DESC - 16])
    rid = rng.getrandbits(32)
    plen = max(1, len(payload)) if rng.random() < 0.9 else rng.randint(0, DESC)
    return Case("desc", header=_pack_header_fields([rid, 0, plen, 0, -1]), payload=payload, rid=rid, note=how)


def _dims(rng: random.Random) -> tuple[int, ...]:
    r = rng.random()
    if r < 0.05:
        return tuple(rng.choice((-1, -(2**63), 2**63 - 1)) if k == 0 else 4 for k in range(rng.randint(1, 3)))
    if r < 0.07:  # a huge dim next to a zero one: 0 bytes, passes nbytes, must fail before any allocation
        d = [0, rng.choice(HUGE_DIMS)]
        rng.shuffle(d)
        return tuple(d)
    if r < 0.13:
        return tuple(1 for _ in range(rng.choice((0, 9, 12))))  # scalar, too many dims
    return tuple(rng.choice(SMALL_DIMS) for _ in range(rng.choice((1, 1, 2, 2, 2))))


def _attr_value(rng: random.Random, kind: str) -> Any:
    r = rng.random()
    if r < 0.6:
        if kind == "float":
            return rng.choice((0.0, 1.0, -1.0, 1e-5, 2.5, float("nan"), float("inf"), -float("inf"), 1e308))
        if kind == "int":
            return rng.choice((1, 2, 8, 32, 128, 0, -1, 3, 2**31, 2**63 - 1))
        if kind == "bool":
            return rng.random() < 0.5
        return rng.choice(("", "x", "a" * 128))
    return rng.choice((1.5, 7, True, "zz", "\u00e9", -(2**63)))


def gen_tensor(rng: random.Random, op_table: dict[str, dict[str, Any]], slot_nbytes: int = 65536) -> Case:
    """A structurally valid descriptor with random ops, bindings, attrs, tensor geometry and flags."""
    ops = sorted(op_table)
    n_steps = rng.choice((1, 1, 1, 2, 3))
    tensors: list[TensorRef] = []
    names: list[str] = []
    steps = []
    cursor = DESC
    for i in range(n_steps):
        op = rng.choice(ops) if rng.random() < 0.97 else rng.choice(("nope", "", "x" * 200))
        spec = op_table.get(op, {"inputs": ["x"], "outputs": ["out"], "attrs": {}, "code": 0})
        bind = []
        for p in spec["inputs"]:
            if names and rng.random() < 0.4:
                bind.append((p, rng.choice(names)))
                continue
            if rng.random() < 0.03:
                continue  # an unbound parameter
            tname = f"t{len(tensors)}" if rng.random() < 0.95 else rng.choice(names or ["dup"])
            dt = rng.choice(("float32", "float32", "float16", "float64")) if rng.random() < 0.7 else rng.choice(DTYPES)
            shape = _dims(rng)
            try:
                nb = math.prod(shape) * itemsize(dt)
            except OverflowError:
                nb = 0
            if rng.random() < 0.08 or not 0 <= nb < 2**64:
                nb = rng.choice((0, 1, 16, 64, 2**32, 2**64 - 1, max(0, nb + rng.choice((-1, 1)))))
            off = (cursor + 63) // 64 * 64
            if rng.random() < 0.08:
                off = rng.choice((0, 16, 64, DESC - 64, DESC + 4, slot_nbytes, slot_nbytes - 64, 2**63, 2**64 - 1,
                                  rng.getrandbits(64)))
            elif 0 <= nb < 2**32:
                cursor = off + nb
            resident = "" if rng.random() < 0.97 else rng.choice(("w", "shared/w", "nope"))
            tensors.append(TensorRef(tname, dt, shape, off & (2**64 - 1), nb & (2**64 - 1), resident))
            names.append(tname)
            bind.append((p, tname))
        outs = [(p, f"s{i}.{p}") for p in spec["outputs"]]
        if rng.random() < 0.05:
            outs = [(p, rng.choice(names or ["z"])) for p in spec["outputs"]]
        attrs = [(a, _attr_value(rng, d["kind"])) for a, d in spec["attrs"].items() if rng.random() < 0.6]
        if rng.random() < 0.05:
            attrs.append(("zz", 1.0))
        code = spec["code"] if rng.random() < 0.5 else (0 if rng.random() < 0.9 else rng.getrandbits(16))
        steps.append(StepDesc(op, code, tuple(bind), tuple(outs), tuple(attrs)))
        names.extend(o for _, o in outs)
    last_outs = [o for _, o in steps[-1].outputs]
    outputs = tuple(last_outs) if rng.random() < 0.9 else tuple(rng.sample(names, k=min(len(names), 2)))
    keep: tuple[str, ...] = ()
    flags = 0
    if rng.random() < 0.2:
        flags |= Flag.IN_PLACE
    if rng.random() < 0.2:  # (a guessed room: refusals for outputs that did not fit are counted apart)
        flags |= Flag.GUESS
    if rng.random() < 0.04:
        keep = outputs[:1]
        flags |= Flag.KEEP if rng.random() < 0.8 else 0
    if rng.random() < 0.02:
        outputs = ()
    try:
        payload = encode_request(RequestDesc(tuple(steps), tuple(tensors), outputs, keep))
    except Exception:  # noqa: BLE001 - the encoder refused (e.g. an int out of range): send garbage instead
        payload = b"\x00" * 16
    need = max([t.offset + t.nbytes for t in tensors if t.offset + t.nbytes < 2**21], default=DESC)
    rid = rng.getrandbits(32)
    op0 = steps[0].op_code if rng.random() < 0.9 else rng.getrandbits(16)
    return Case("tensor", header=_pack_header_fields([rid, op0, len(payload), int(flags), -1]), payload=payload,
                rid=rid, slot_nbytes=need, note=steps[0].op)


def gen_doorbell(rng: random.Random, n_slots: int = 15) -> Case:
    """A raw frame starting with ``C``: well formed with random numbers, or of a wrong length."""
    if rng.random() < 0.3:
        n = rng.choice((1, 2, 8, 15, 17, 32, 100, rng.randrange(200)))
        return Case("doorbell", frame=b"C" + bytes(rng.getrandbits(8) for _ in range(n)), note="length")
    region = rng.choice((0, 1, 1, 2, 3, 0xFFFF))
    slot = rng.randrange(n_slots + 2) if rng.random() < 0.8 else rng.getrandbits(32)
    gen = rng.choice((0, 1, 2, 3, rng.getrandbits(32)))
    return Case("doorbell", frame=m.pack_call(region, slot, rng.getrandbits(32), gen), note="call")


def _json_value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if r < 0.2:
        return rng.choice(NASTY_INTS)
    if r < 0.3:
        return rng.choice((0.5, -1.0, 1e300, float("inf"), -float("inf"), float("nan")))
    if r < 0.45:
        return rng.choice(("", "1", "abc", "\u0000", "ff" * 8, SCHEMA_HASH))
    if r < 0.55:
        return rng.choice((None, True, False))
    if r < 0.7 and depth < 3:
        return [_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 3:
        return {rng.choice(("protocol", "pid", "k", "")): _json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return 7


def gen_hello(rng: random.Random) -> Case:
    """``H`` + a mutated valid HELLO (one field changed or dropped), random JSON, or garbage."""
    r = rng.random()
    if r < 0.15:
        return Case("hello", frame=b"H" + bytes(rng.getrandbits(8) for _ in range(rng.randrange(64))), note="garbage")
    if r < 0.35:
        return Case("hello", frame=b"H" + json.dumps(_json_value(rng)).encode(), note="json")
    pid = os.getpid()
    hello: dict[str, Any] = {"protocol": m.PROTOCOL_VERSION, "schema_hash": SCHEMA_HASH, "pid": pid, "uid": os.getuid(),
                             "start_ticks": process_start_ticks(pid)}
    for _ in range(rng.choice((0, 1, 1, 1, 2))):
        k = rng.choice(list(hello) + ["extra"])
        if rng.random() < 0.2:
            hello.pop(k, None)
        else:
            hello[k] = _json_value(rng) if rng.random() < 0.7 else rng.choice((1, 2, pid + 1, 0, -1))
    return Case("hello", frame=b"H" + json.dumps(hello).encode(), note="mutated")


GENERATORS: dict[str, Callable[..., Case]] = {"header": gen_header, "desc": gen_desc, "tensor": gen_tensor,
                                              "doorbell": gen_doorbell, "hello": gen_hello}


def describe(case: Case) -> str:
    """A readable one-line account of a case (the descriptor decoded where it parses)."""
    if case.kind in ("hello", "doorbell"):
        return f"{case.kind} frame {case.frame[:200]!r}"
    try:
        desc: Any = decode_request(case.payload)
    except Exception:  # noqa: BLE001
        desc = case.payload[:64]
    return f"{case.kind} ({case.note}) header {case.header[:16].hex()} rid {case.rid} desc {desc}"


# ------------------------------------------------------------ the hostile session


def attach(name: str, frame: bytes, timeout_s: float) -> tuple[bytes | None, list[int]]:
    """Send one raw packet on worker ``name``'s attach socket; (the answer or None after silence, its fds)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.settimeout(timeout_s)
        s.connect(str(attach_path(name)))
        s.send(frame)
        try:
            reply, fds, _, _ = socket.recv_fds(s, m.ATTACH_MAX_NBYTES, 8)
        except TimeoutError:
            return None, []
    return reply, fds


class RawSession:
    """A DEALER that speaks the protocol by hand and maps the region read-write, as any process of the uid can."""

    def __init__(self, name: str, timeout_s: float = REPLY_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._maps: dict[int, tuple[mmap.mmap, memoryview, Geometry]] = {}
        try:
            pid = os.getpid()
            w, fds = attach(name, m.pack_json(m.HELLO, {"protocol": m.PROTOCOL_VERSION, "schema_hash": SCHEMA_HASH,
                                                        "pid": pid, "uid": os.getuid(),
                                                        "start_ticks": process_start_ticks(pid)}), timeout_s)
            if w is None or w[:1] != m.WELCOME:
                raise RuntimeError(f"no WELCOME: {w!r}")
            self.welcome = m.unpack_json(w)
            self.sock.setsockopt(zmq.ROUTING_ID, self.welcome["token"].encode())
            self.sock.connect(endpoint(name))
            default = self.welcome["geometry"]
            for r, fd in zip(self.welcome["regions"], fds):  # the pool, and this session's own region if any
                geo = Geometry.from_json(r.get("geometry", default))
                assert geo.desc_nbytes == DESC
                try:
                    mm = mmap.mmap(fd, r["nbytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
                self._maps[r["index"]] = (mm, memoryview(mm), geo)
            #: (region, slot, generation), smallest slot first
            self.lease: list[tuple[int, int, int]] = sorted(
                (tuple(x) for x in self.welcome["lease"]), key=lambda x: self.slot_nbytes(x[0], x[1]))  # type: ignore[misc]
        except BaseException:
            self.close()
            raise

    def regions(self) -> dict[int, tuple[memoryview, Geometry]]:
        """Mapped regions by index: (whole-region view, geometry)."""
        return {i: (mv, g) for i, (_, mv, g) in self._maps.items()}

    def slot_nbytes(self, region: int, index: int) -> int:
        """Size of slot ``index`` of ``region``."""
        return self._maps[region][2].slot_nbytes(index)

    def slot(self, region: int, index: int) -> memoryview:
        """A view of one slot."""
        _, mv, g = self._maps[region]
        off = g.slot_offset(index)
        return mv[off:off + g.slot_nbytes(index)]

    def recv(self) -> bytes | None:
        """The next frame, or None after ``timeout_s`` of silence."""
        if not self.sock.poll(int(self.timeout_s * 1000)):
            return None
        return self.sock.recv()

    def close(self) -> None:
        """BYE, unmap, close the socket."""
        try:
            self.sock.send(m.BYE, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        for mm, mv, _ in self._maps.values():
            mv.release()
            mm.close()
        self._maps.clear()
        self.sock.close(linger=100)
        self.ctx.term()


# ------------------------------------------------------------ running cases


@dataclass
class Fuzzer:
    """Runs cases against worker ``name`` (pid ``pid``) and checks the invariants after each."""

    name: str
    pid: int
    seed: int = 0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)
    by_kind: dict[str, collections.Counter[str]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.noise = self.rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
        self.a = RawSession(self.name)
        self.hs_ctx = zmq.Context()
        try:
            self.b = Client(self.name, timeout_s=REPLY_TIMEOUT_S)
            self._canary_loans = [self.b.loan(1000), self.b.loan(100_000)]
            for ln in self._canary_loans:
                mv = ln._s.mv
                assert mv is not None
                mv[:] = np.frombuffer(self.noise, np.uint8, len(mv)).tobytes()[::-1]
            self._watch = self._watched()
            self._snap = [w.copy() for w in self._watch]
            self.canary_nbytes = 8 * sum(int(w.size) for w in self._watch)
        except BaseException:
            self.close()
            raise

    def _watched(self) -> list[np.ndarray]:
        """u64 views of every byte the fuzzing session must not change: B's canary slots (through B's own
        mapping, wherever its region is) and every region the session maps, except the session's own slots."""
        out = []
        for ln in self._canary_loans:
            assert ln._s.mv is not None
            out.append(np.frombuffer(ln._s.mv, np.uint64))
        own = {(r, s) for r, s, _ in self.a.lease}
        for ri, (mv, g) in self.a.regions().items():
            cuts = sorted((g.slot_offset(s), g.slot_offset(s) + g.slot_nbytes(s)) for r, s in own if r == ri)
            pos = 0
            whole = np.frombuffer(mv, np.uint64)
            for lo, hi in cuts + [(g.region_nbytes, g.region_nbytes)]:
                if lo > pos:
                    out.append(whole[pos // 8:lo // 8])
                pos = hi
        return out

    def close(self) -> None:
        """Give everything back."""
        self._watch, self._snap = [], []
        for ln in getattr(self, "_canary_loans", []):
            ln.release()
        if hasattr(self, "b"):
            self.b.close()
        self.hs_ctx.term()
        self.a.close()

    # -------------------------------------------------------- invariants

    def worker_alive(self) -> bool:
        """The worker process still exists (not a zombie either)."""
        fields = read_stat(self.pid)
        return bool(fields) and fields[0] not in ("Z", "X")

    def canary_intact(self) -> bool:
        """Every byte outside the fuzzing session's slots is as it was."""
        return all(np.array_equal(w, c) for w, c in zip(self._watch, self._snap))

    def good_call(self) -> bool:
        """An honest request through B gets the right answer."""
        x = np.arange(17, dtype=np.float32)
        return bool(np.array_equal(self.b.call("scale", x=x, a=2.0, b=1.0)["out"], 2 * x + 1))

    # -------------------------------------------------------- one case

    def run(self, case: Case) -> str:
        """Run one case; returns its outcome (``ok``, an error class, ``refused:<class>``, ``ERROR:<kind>`` ...)."""
        if case.kind == "hello":
            out = self._hello(case)
        elif case.kind == "doorbell":
            out = self._doorbell(case)
        else:
            out = self._ring(case)
        self.counts[out] += 1
        self.by_kind.setdefault(case.kind, collections.Counter())[out] += 1
        if out == "hang":
            self.violations.append(f"no answer within {REPLY_TIMEOUT_S}s: {describe(case)}")
        if not self.worker_alive():
            self.violations.append(f"worker died after {describe(case)}")
        elif not self.canary_intact():
            self.violations.append(f"bytes outside the slot changed after {describe(case)}")
            self._snap = [w.copy() for w in self._watch]
        return out

    def _pick_slot(self, nbytes: int) -> tuple[int, int, int]:
        for r, s, g in self.a.lease:
            if self.a.slot_nbytes(r, s) >= nbytes:
                return r, s, g
        return self.a.lease[-1]

    def _ring(self, case: Case) -> str:
        region, index, gen = self._pick_slot(case.slot_nbytes)
        mv = self.a.slot(region, index)
        try:
            if case.fill:
                n = min(len(mv), case.slot_nbytes + 4096, len(self.noise)) - DESC
                start = int(self.rng.integers(0, len(self.noise) - n)) if n > 0 else 0
                mv[DESC:DESC + max(0, n)] = self.noise[start:start + max(0, n)]
            mv[16:16 + len(case.payload)] = case.payload
            hdr = case.header
            if hdr.endswith(b"G"):  # the generator asked for the slot's real generation
                hdr = hdr[:12] + struct.pack("<I", gen)
            mv[:16] = hdr[:16]
            rid = case.rid if case.rid is not None else struct.unpack_from("<I", hdr)[0]
            self.a.sock.send(m.pack_call(region, index, rid, (gen + case.gen_delta) & 0xFFFFFFFF))
            return self._answer(rid, mv)
        finally:
            mv.release()

    def _answer(self, rid: int, mv: memoryview | None) -> str:
        while True:
            f = self.a.recv()
            if f is None:
                return "hang"
            if f[:1] == m.ERROR:
                return "ERROR:" + str(m.unpack_json(f).get("kind"))
            if f[:1] != m.DONE or len(f) != m.DONE_STRUCT.size:
                return f"unexpected:{f[:1]!r}"
            _, _, got, status = m.unpack_done(f)
            if got != rid:
                continue  # a reply to an earlier stray doorbell
            if status & NO_RESPONSE:
                cls = WIRE_CODES.get(status & 0x7FFF)
                return "refused:" + (cls.__name__ if cls else f"code{status}")
            if mv is None:
                return "done-without-slot"
            return self._response(rid, status, mv)

    def _response(self, rid: int, status: int, mv: memoryview) -> str:
        rid_h, _, plen, flags, _ = HEADER.unpack_from(mv)
        if rid_h != rid or not flags & Flag.RESPONSE or plen > DESC - 16:
            return "bad-response-header"
        try:
            resp = decode_response(bytes(mv[16:16 + plen]))
        except Exception:  # noqa: BLE001
            return "bad-response-desc"
        if resp.status != status:
            return "status-mismatch"
        if status == 0:
            if any(t.offset < DESC or t.offset + t.nbytes > len(mv) for t in resp.outputs):
                return "output-outside-slot"
            return "ok"
        cls = WIRE_CODES.get(status)
        return cls.__name__ if cls else f"code{status}"

    def _doorbell(self, case: Case) -> str:
        self.a.sock.send(case.frame)
        # a CALL, or a traced CALL (a CALL followed by a trace context): the worker answers both with a DONE
        if len(case.frame) in (m.CALL_STRUCT.size, m.CALL_STRUCT.size + m.TRACE_STRUCT.size):
            _, region, slot, rid, gen = m.CALL_STRUCT.unpack_from(case.frame)
            if (region, slot, gen) in self.a.lease:
                v = self.a.slot(region, slot)
                try:
                    return self._answer(rid, v)
                finally:
                    v.release()
            return self._answer(rid, None)
        return self._answer(-1, None)

    def _hello(self, case: Case) -> str:
        f, fds = attach(self.name, case.frame, REPLY_TIMEOUT_S)
        for fd in fds:
            os.close(fd)
        if f is None:
            return "hang"
        if f[:1] == m.WELCOME:  # end the session it opened, under its token
            bye = self.hs_ctx.socket(zmq.DEALER)
            bye.setsockopt(zmq.ROUTING_ID, m.unpack_json(f)["token"].encode())
            bye.connect(endpoint(self.name))
            bye.send(m.BYE)
            bye.close(linger=1000)
            return "WELCOME"
        if f[:1] == m.ERROR:
            return "ERROR:" + str(m.unpack_json(f).get("kind"))
        return f"unexpected:{f[:1]!r}"


# ------------------------------------------------------------ the program


def start_worker(name: str, slots: str = FUZZ_SLOTS, lease: str = FUZZ_LEASE) -> subprocess.Popen[str]:
    """Start a NumPy worker and wait for its ready line."""
    args = [sys.executable, "-m", "shmrpc.server", "serve", "--name", name, "--slots", slots, "--lease", lease,
            "--backend", "numpy", "--no-mlock", "--log-level", "ERROR"]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline() if p.stdout else ""
    if "ready" not in line or not socket_path(name).exists():
        p.kill()
        p.wait()
        raise RuntimeError(f"worker {name} did not start: {line}")
    return p


def stop_worker(p: subprocess.Popen[str], timeout_s: float = 30.0) -> int | str:
    """SIGTERM and wait; SIGKILL (and say so) when it does not drain in time."""
    p.send_signal(signal.SIGTERM if timeout_s > 0 else signal.SIGKILL)
    try:
        rc = p.wait(timeout_s if timeout_s > 0 else 10)
        if timeout_s > 0:
            return rc
        raise subprocess.TimeoutExpired(p.args, 0)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        name = p.args[p.args.index("--name") + 1]  # type: ignore[union-attr]
        for f in Path("/dev/shm").glob(region_prefix(name) + "*"):
            f.unlink(missing_ok=True)
        for f in (socket_path(name), lock_path(name)):
            f.unlink(missing_ok=True)
        return f"did not exit within {timeout_s:.0f} s of SIGTERM (killed)" if timeout_s > 0 else "killed"


def machine_facts() -> dict[str, Any]:
    """CPU, cores, Python and library versions, git commit."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {"cpu": cpu, "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "numpy": np.__version__, "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "platform": platform.platform(),
            "commit": commit, "overcommit_memory": Path("/proc/sys/vm/overcommit_memory").read_text().strip()}


def main(argv: list[str] | None = None) -> int:
    """Run the fuzzer; exit status 1 when an invariant broke."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated case kinds")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/fuzz-<date>.json; '-' for none)")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so the worker is stopped on the way out
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    kinds = args.kinds.split(",")
    rng = random.Random(seed)
    name = "fuzz-" + uuid.uuid4().hex[:10]
    good_end = canary = False
    crashed = 0
    print(f"fuzz: seed {seed}, {args.cases} cases of {kinds}, worker {name}", flush=True)
    started = _dt.datetime.now(_dt.timezone.utc)
    counts: collections.Counter[str] = collections.Counter()
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    violations: list[str] = []
    restarts: list[dict[str, Any]] = []
    good_fail = 0
    canary_nbytes = 0
    t0 = time.perf_counter()
    last = t0
    i = 0
    while True:
        worker = start_worker(name)
        fz: Fuzzer | None = None
        restart = False
        try:
            fz = Fuzzer(name, worker.pid, seed + len(restarts))
            canary_nbytes = fz.canary_nbytes
            op_table = fz.a.welcome["op_table"]
            while i < args.cases:
                kind = kinds[i % len(kinds)]
                case = gen_tensor(rng, op_table) if kind == "tensor" else GENERATORS[kind](rng)
                out = fz.run(case)
                i += 1
                for v in fz.violations:
                    print(f"    VIOLATION at case {i}:", v[:400], flush=True)
                violations += fz.violations
                fz.violations.clear()
                if not fz.worker_alive() or (out == "hang" and kind != "hello"):
                    # a request that never ends holds its slot in flight for good (and blocks the drain):
                    # note it, and go on with a fresh worker
                    restarts.append({"case": i, "kind": kind, "outcome": out, "alive": fz.worker_alive()})
                    restart = True
                    break
                if i % 500 == 0:
                    good_fail += not fz.good_call()
                now = time.perf_counter()
                if now - last > 5 or i == args.cases:
                    last = now
                    print(f"  {i:>7} cases  {i / (now - t0):8.0f}/s  violations {len(violations)}  "
                          f"worker restarts {len(restarts)}", flush=True)
            if not restart:
                good_end = fz.good_call()
                canary = fz.canary_intact() and not any("outside the slot" in v for v in violations)
                crashed = sum(not r["alive"] for r in restarts)
        finally:
            if fz is not None:
                counts.update(fz.counts)
                for k, c in fz.by_kind.items():
                    by_kind[k].update(c)
                fz.close()
            # the first stuck worker shows whether SIGTERM still drains; later ones are just killed
            rc = stop_worker(worker, (3.0 if len(restarts) == 1 else 0.0) if restart else 30.0)
        if restart:
            restarts[-1]["sigterm"] = rc
            continue
        break
    elapsed = time.perf_counter() - t0
    n_done = sum(counts.values())
    print(f"\n{n_done} cases in {elapsed:.1f} s ({n_done / elapsed:.0f} cases/s), seed {seed}\n")
    print(f"{'kind':<10} {'outcome':<34} {'cases':>8}")
    for k in sorted(by_kind):
        for o, n in sorted(by_kind[k].items(), key=lambda x: -x[1]):
            print(f"{k:<10} {o:<34} {n:>8}")
    print(f"\nworker restarts after a hang or crash: {len(restarts)} {restarts}")
    print(f"worker crashes: {int(crashed)}   hangs: {counts.get('hang', 0)}   canary intact: {canary} "
          f"({canary_nbytes} bytes)   good call at end: {good_end}   periodic good-call failures: {good_fail}   "
          f"worker exit on SIGTERM: {rc}   violations: {len(violations)}")
    for v in violations[:20]:
        print("  VIOLATION", v[:300])
    result = {
        "program": "tests/support/fuzz.py", "date": started.isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", "tests.support.fuzz", *(argv if argv is not None else sys.argv[1:])]),
        "seed": seed, "cases": n_done, "elapsed_s": round(elapsed, 2), "cases_per_s": round(n_done / elapsed, 1),
        "worker": {"slots": FUZZ_SLOTS, "lease": FUZZ_LEASE, "backend": "numpy", "exit_on_sigterm": rc},
        "worker_restarts": restarts, "worker_crashes": int(crashed), "hangs": counts.get("hang", 0), "canary_intact": canary,
        "canary_nbytes": canary_nbytes, "good_call_at_end": good_end, "periodic_good_call_failures": good_fail,
        "violations": violations[:50], "outcomes": counts, "outcomes_by_kind": {k: dict(v) for k, v in by_kind.items()}, "machine": machine_facts(),
    }
    out = args.out or str(ROOT / "bench" / "results" / f"fuzz-{started.date().isoformat()}.json")
    if out != "-":
        Path(out).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
        print(f"wrote {out}")
    ok = not violations and not restarts and not crashed and canary and good_end and not good_fail and rc == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
