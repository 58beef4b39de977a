"""A minimal shmrpc client written from docs/protocol.md alone: no import of the shmrpc package.

    python examples/raw_client.py NAME     # a worker started with `shmrpc serve --name NAME`

It honours ``SHMRPC_RUNTIME_DIR`` and ``XDG_RUNTIME_DIR`` as §1 says; it finds and verifies the worker, says HELLO on
the attach socket and maps the regions of the WELCOME, makes one ``scale`` and one ``vector_add`` call (the header,
the FlatBuffers descriptor built with the ``flatbuffers`` package from ``schema/shmrpc.fbs``, the tensors; the CALL
and the DONE over ZeroMQ), sends five requests the document says are refused and checks each answer, and says BYE.
The schema hash is computed from ``schema/shmrpc.fbs`` as §5 says. It exits non-zero at the first answer that is not
the one the document gives: ``tests/e2e/test_raw_client.py`` runs it against a worker, so the document cannot drift
from the worker without a test failing. Written to check that the document is enough to write a client in another
language (it took about 300 lines here).
"""

import fcntl
import hashlib
import json
import mmap
import os
import re
import socket
import stat
import struct
import sys

import flatbuffers
import numpy as np
import zmq
from flatbuffers.table import Table

PROTOCOL = 4
FBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "schema", "shmrpc.fbs")
HEADER = struct.Struct("<IHIHI")          # §4: request_id, op_code, payload_length, flags, generation
CALL = struct.Struct("<cxHIII")           # §2: 'C', pad, region, slot, request_id, generation
DONE = struct.Struct("<cxHIIH")           # §2: 'D', pad, region, slot, request_id, status
SB_HEAD = struct.Struct("<8sII8sIIQQQ")   # §3 superblock
RESPONSE, ERROR, IN_PLACE, KEEP, GUESS = 1, 2, 4, 8, 16
NO_RESPONSE = 0x8000
F32 = 12                                  # DType float32
ERRORS = {1: "InvalidRequestError", 2: "StaleSlotError", 3: "RequestTooLargeError", 4: "UnknownOpError",
          5: "BusyError", 6: "KernelError", 7: "ResourceError", 8: "InternalError"}


class ConnectError(Exception):
    pass


def schema_hash(path=FBS):
    """§5: the first 16 hex digits of SHA-256 over the .fbs's tokens joined by one space, comments left out."""
    with open(path, encoding="utf-8") as f:
        text = f.read().lstrip("\ufeff")
    out, i = [], 0
    while i < len(text):
        if text[i] == '"':
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = len(text) if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = len(text) if j < 0 else j + 2
        else:
            out.append(text[i])
            i += 1
    tokens = re.findall(r'"(?:\\.|[^"\\])*"|[A-Za-z0-9_.+-]+|\S', "".join(out))
    return hashlib.sha256(" ".join(tokens).encode()).hexdigest()[:16]


SCHEMA_HASH = schema_hash()


# ---------------------------------------------------------------- §1 finding and verifying the worker
def runtime_dir():
    if os.environ.get("SHMRPC_RUNTIME_DIR"):
        return os.environ["SHMRPC_RUNTIME_DIR"]
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "shmrpc")
    return f"/tmp/shmrpc-{os.getuid()}"


def start_ticks(pid):
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rpartition(b")")[2].split()[19])   # field 22


def attach(name, lease=None):
    uid = os.getuid()
    d = runtime_dir()
    st = os.stat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o066:
        raise ConnectError(f"{d}: not a private directory of uid {uid} (owner {st.st_uid}, mode {st.st_mode:o})")
    path = os.path.join(d, f"{name}.attach")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ConnectError(f"no worker named {name!r} ({path} does not exist)") from None
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != uid:
        raise ConnectError(f"{path}: not a socket of uid {uid}")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(10)
    try:
        s.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        raise ConnectError(f"no worker listens on {path}") from None
    wpid, wuid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    if wuid != uid:
        raise ConnectError(f"{path}: worker runs as uid {wuid}, not {uid}")
    hello = {"protocol": PROTOCOL, "schema_hash": SCHEMA_HASH, "pid": os.getpid(), "uid": uid,
             "start_ticks": start_ticks(os.getpid())}
    if lease is not None:
        hello["lease"] = lease
    s.send(b"H" + json.dumps(hello).encode())
    data, anc, _, _ = s.recvmsg(1 << 20, socket.CMSG_SPACE(64 * 4))
    s.close()
    fds = []
    for level, typ, cdata in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"{len(cdata) // 4}i", cdata[: len(cdata) - len(cdata) % 4]))
    try:
        if data[:1] == b"E":
            err = json.loads(data[1:])
            raise ConnectError(f"worker refused HELLO: {err}")
        if data[:1] != b"W":
            raise ConnectError(f"unexpected reply kind {data[:1]!r}")
        w = json.loads(data[1:])
        if w["protocol"] != PROTOCOL or w["schema_hash"] != SCHEMA_HASH:
            raise ConnectError(f"protocol mismatch: {w['protocol']} {w['schema_hash']}")
        if w["worker_pid"] != wpid:
            raise ConnectError(f"WELCOME says pid {w['worker_pid']}, the kernel {wpid}")
        if len(fds) < len(w["regions"]):
            raise ConnectError(f"{len(fds)} fds for {len(w['regions'])} regions")
        regions = {}
        for r, fd in zip(w["regions"], fds):
            regions[r["index"]] = map_region(fd, r, w, wpid, uid)
    finally:
        for fd in fds:
            os.close(fd)
    return w, regions


def map_region(fd, r, w, wpid, uid):
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o600:
        raise ConnectError(f"region {r['index']}: not a 0600 file of uid {uid}")
    if st.st_size != r["nbytes"]:
        raise ConnectError(f"region {r['index']}: {st.st_size} bytes, announced {r['nbytes']}")
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) != fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW:
        raise ConnectError(f"region {r['index']}: not sealed (seals {seals:#x})")
    mm = mmap.mmap(fd, r["nbytes"], mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    magic, ver, desc, shash, pid, ncls, ticks, _epoch, nbytes = SB_HEAD.unpack_from(mm, 0)
    geom = r.get("geometry") or w["geometry"]
    classes = [list(struct.unpack_from("<QQ", mm, SB_HEAD.size + 16 * i)) for i in range(ncls)]
    if (magic != b"SHMRPC\0\1" or ver != 1 or shash != bytes.fromhex(SCHEMA_HASH) or pid != wpid
            or nbytes != r["nbytes"] or desc != geom["desc_nbytes"] or classes != geom["classes"]
            or (w["worker_start_ticks"] is not None and ticks != w["worker_start_ticks"])):
        raise ConnectError(f"region {r['index']}: superblock does not match the WELCOME")
    return mm, geom


def slot_offset(geom, slot):
    pos, i = 4096, 0
    for size, n in geom["classes"]:
        for _ in range(n):
            if i == slot:
                return pos, size
            pos += size
            i += 1
    raise ValueError(f"no slot {slot}")


# ---------------------------------------------------------------- §5 descriptors (FlatBuffers, by the .fbs)
def _vec_of_offsets(b, offs):
    b.StartVector(4, len(offs), 4)
    for o in reversed(offs):
        b.PrependUOffsetTRelative(o)
    return b.EndVector()


def _table(b, n_slots, fields):
    """One table of ``n_slots`` fields, of ``(slot, kind, value)``: kind is the builder's ``Prepend<kind>Slot``
    (``"UOffsetTRelative"`` for a child already built, ``"Uint8"``, ``"Uint16"``, ``"Uint64"``, ``"Float64"``)."""
    b.StartObject(n_slots)
    for slot, kind, value in fields:
        getattr(b, f"Prepend{kind}Slot")(slot, value, 0)
    return b.EndObject()


def build_request(steps, inputs, outputs, keep=()):
    """steps: [(op, op_code, {param: tensor}, {param: tensor}, {attr: float})];
    inputs: [(name, dtype_code, shape, offset, nbytes)]. Tables by the .fbs's field order (slot = declaration index)."""
    b = flatbuffers.Builder(1024)
    ref = "UOffsetTRelative"

    def bindings(m):  # Binding {param, tensor}
        offs = []
        for p, t in m.items():
            ps, ts = b.CreateString(p), b.CreateString(t)
            offs.append(_table(b, 2, [(0, ref, ps), (1, ref, ts)]))
        return _vec_of_offsets(b, offs)

    step_offs = []
    for op, code, ins, outs, attrs in steps:  # Step {op, op_code, inputs, outputs, attrs}
        op_s, ins_v, outs_v = b.CreateString(op), bindings(ins), bindings(outs)
        # Attr {name, kind (0: float_), f, i, s}
        attr_offs = [_table(b, 5, [(0, ref, b.CreateString(k)), (1, "Uint8", 0), (2, "Float64", float(v))])
                     for k, v in attrs.items()]
        attrs_v = _vec_of_offsets(b, attr_offs)
        step_offs.append(_table(b, 5, [(0, ref, op_s), (1, "Uint16", code), (2, ref, ins_v), (3, ref, outs_v),
                                       (4, ref, attrs_v)]))
    steps_v = _vec_of_offsets(b, step_offs)
    t_offs = []
    for name, dt, shape, off, nb in inputs:  # Tensor {name, dtype, shape, offset, nbytes, resident}
        ns = b.CreateString(name)
        b.StartVector(8, len(shape), 8)
        for d in reversed(shape):
            b.PrependInt64(d)
        sv = b.EndVector()
        t_offs.append(_table(b, 6, [(0, ref, ns), (1, "Uint8", dt), (2, ref, sv), (3, "Uint64", off),
                                    (4, "Uint64", nb)]))
    inputs_v = _vec_of_offsets(b, t_offs)
    outputs_v = _vec_of_offsets(b, [b.CreateString(o) for o in outputs])
    keep_v = _vec_of_offsets(b, [b.CreateString(k) for k in keep])
    b.Finish(_table(b, 4, [(i, ref, v) for i, v in enumerate((steps_v, inputs_v, outputs_v, keep_v))]))
    return bytes(b.Output())


def _field(t, i):
    return t.Offset(4 + 2 * i)


def _str(t, i):
    o = _field(t, i)
    return t.String(o + t.Pos).decode() if o else ""


def _tables(t, i):
    o = _field(t, i)
    if not o:
        return []
    start, n = t.Vector(o), t.VectorLen(o)
    return [Table(t.Bytes, t.Indirect(start + 4 * k)) for k in range(n)]


def parse_response(buf):
    """Response {status, message, op, step=-1, tensor, field, outputs:[Tensor]} -> dict."""
    t = Table(buf, flatbuffers.encode.Get(flatbuffers.packer.uoffset, buf, 0))
    u16 = flatbuffers.number_types.Uint16Flags
    o = _field(t, 0)
    status = t.Get(u16, o + t.Pos) if o else 0
    o = _field(t, 3)
    step = t.Get(flatbuffers.number_types.Int32Flags, o + t.Pos) if o else -1
    outs = []
    for tt in _tables(t, 6):
        o = _field(tt, 1)
        dt = tt.Get(flatbuffers.number_types.Uint8Flags, o + tt.Pos) if o else 0
        o = _field(tt, 2)
        shape = [tt.Get(flatbuffers.number_types.Int64Flags, tt.Vector(o) + 8 * k)
                 for k in range(tt.VectorLen(o))] if o else []
        off = tt.Get(flatbuffers.number_types.Uint64Flags, _field(tt, 3) + tt.Pos) if _field(tt, 3) else 0
        nb = tt.Get(flatbuffers.number_types.Uint64Flags, _field(tt, 4) + tt.Pos) if _field(tt, 4) else 0
        outs.append({"name": _str(tt, 0), "dtype": dt, "shape": shape, "offset": off, "nbytes": nb})
    return {"status": status, "message": _str(t, 1), "op": _str(t, 2), "step": step, "tensor": _str(t, 4),
            "field": _str(t, 5), "outputs": outs}


# ---------------------------------------------------------------- §6 one call
class Session:
    def __init__(self, name, lease=None):
        self.welcome, self.regions = attach(name, lease)
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, self.welcome["token"].encode("ascii"))
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(f"ipc://{os.path.join(runtime_dir(), name + '.sock')}")
        self.region, self.slot, self.generation = self.welcome["lease"][0]
        self.mm, self.geom = self.regions[self.region]
        self.base, self.slot_nbytes = slot_offset(self.geom, self.slot)
        self.desc_nbytes = self.geom["desc_nbytes"]
        self.next_id = 1

    def recv(self, timeout_ms=10000):
        while True:
            if not self.sock.poll(timeout_ms):
                raise TimeoutError("no reply from the worker")
            f = self.sock.recv()
            if f[:1] != b"P":          # PULSE: discard
                return f

    def call(self, op, inputs, attrs=None, *, flags=0, hdr_gen=None, call_gen=None, hdr_rid_delta=0):
        """inputs: {param: ndarray} bound to tensors of the same name; returns (done_status, response, outputs)."""
        entry = self.welcome["op_table"][op]
        rid, self.next_id = self.next_id, self.next_id + 1
        mm, base = self.mm, self.base
        pos, tensors = self.desc_nbytes, []
        for name, arr in inputs.items():                      # 1. tensors at 64-aligned offsets
            arr = np.ascontiguousarray(arr)
            mm[base + pos: base + pos + arr.nbytes] = arr.tobytes()
            tensors.append((name, F32, list(arr.shape), pos, arr.nbytes))
            pos = (pos + arr.nbytes + 63) & ~63
        steps = [(op, entry["code"], {p: p for p in inputs}, {o: o for o in entry["outputs"]}, attrs or {})]
        desc = build_request(steps, tensors, entry["outputs"])
        assert len(desc) <= self.desc_nbytes - 16
        mm[base + 16: base + 16 + len(desc)] = desc            # 2. descriptor
        gen = self.generation
        HEADER.pack_into(mm, base, rid + hdr_rid_delta, entry["code"], len(desc), flags,
                         gen if hdr_gen is None else hdr_gen)  # 3. header last
        self.sock.send(CALL.pack(b"C", self.region, self.slot, rid, gen if call_gen is None else call_gen))
        while True:                                            # 4. wait for our DONE
            f = self.recv()
            if f[:1] == b"E":
                raise RuntimeError(f"ERROR {json.loads(f[1:])}")
            k, region, slot, drid, status = DONE.unpack(f)
            if (region, slot, drid) == (self.region, self.slot, rid):
                break
        if status & NO_RESPONSE:
            return status, None, {}
        h = HEADER.unpack_from(mm, base)
        assert h[0] == rid and h[3] & RESPONSE, f"bad response header {h}"
        assert bool(h[3] & ERROR) == (status != 0), (h, status)
        resp = parse_response(bytes(mm[base + 16: base + 16 + h[2]]))
        assert resp["status"] == status, (resp, status)
        outs = {}
        for t in resp["outputs"]:
            assert t["dtype"] == F32 and t["offset"] >= self.desc_nbytes and t["offset"] + t["nbytes"] <= self.slot_nbytes
            outs[t["name"]] = np.frombuffer(mm, np.float32, t["nbytes"] // 4, base + t["offset"]).reshape(t["shape"]).copy()
        return status, resp, outs

    def bye(self):
        self.sock.send(b"B")
        self.sock.close()
        self.zctx.term()
        for mm, _ in self.regions.values():
            mm.close()


def main(name):
    s = Session(name, lease=[1])
    w = s.welcome
    print(f"WELCOME: worker pid {w['worker_pid']} backend {w['backend']} client {w['client_id']} "
          f"regions {[r['index'] for r in w['regions']]} lease {w['lease']}")
    print("ops:", {k: (v["code"], v["inputs"], v["outputs"], list(v["attrs"])) for k, v in w["op_table"].items()
                   if k in ("scale", "vector_add")})
    rng = np.random.default_rng(0)
    x = rng.standard_normal(16).astype(np.float32)
    st, resp, outs = s.call("scale", {"x": x}, {"a": 2.0, "b": 1.0})
    assert st == 0 and np.allclose(outs["out"], 2.0 * x + 1.0), (st, resp, outs)
    print("scale ok:", resp["outputs"])
    va = w["op_table"]["vector_add"]
    y = rng.standard_normal(16).astype(np.float32)
    st, resp, outs = s.call("vector_add", {va["inputs"][0]: x, va["inputs"][1]: y})
    assert st == 0 and np.allclose(outs[va["outputs"][0]], x + y), (st, resp, outs)
    print("vector_add ok:", resp["outputs"])

    bad = [("CALL with a wrong generation", dict(call_gen=s.generation + 7), NO_RESPONSE | 2, None),
           ("header with a wrong generation", dict(hdr_gen=s.generation + 7), 2, "generation"),
           ("header flag RESPONSE on a request", dict(flags=RESPONSE), 1, "flags"),
           ("header flag bit 5 (reserved)", dict(flags=1 << 5), 1, "flags"),
           ("header request_id differs from CALL", dict(hdr_rid_delta=1), 1, "request_id")]
    for what, kw, want_status, want_field in bad:
        st, resp, _ = s.call("scale", {"x": x}, {"a": 2.0}, **kw)
        got = f"status {st:#x} ({ERRORS.get(st & 0x7FFF)}{' NO_RESPONSE' if st & NO_RESPONSE else ''})"
        if resp:
            got += f" field={resp['field']!r} message={resp['message']!r}"
        ok = st == want_status and (want_field is None or resp["field"] == want_field)
        print(f"bad request: {what}: {got} -> {'as documented' if ok else 'NOT AS DOCUMENTED'}")
        if not ok:
            raise SystemExit(f"{what}: not the answer docs/protocol.md gives")
    st, _, outs = s.call("scale", {"x": x}, {"a": 3.0})
    assert st == 0 and np.allclose(outs["out"], 3.0 * x), "slot unusable after errors"
    print("slot usable after the errors: ok")
    s.bye()
    print("BYE sent")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "raw1")
