"""Client processes of the same uid for the attacks of tests/e2e/test_trust.py: ``python attack_procs.py ROLE NAME ...``.

Each role connects to worker NAME as an ordinary client (its own HELLO, its own session), prints one line when it is
set, then follows commands, one JSON object a line on stdin, answering each with one JSON line on stdout. Roles:

``holder NAME NBYTES``
    borrow a pool slot of NBYTES (``Client.loan``), fill its tensor area with 0xAB; prints
    ``{"region", "slot", "generation"}``. Commands: ``{"do": "release"}`` ends the loan (the slot goes back);
    ``{"do": "call"}`` sends a request from the loan and prints its answer's check.
``attacker NAME``
    a client that turns on the others through the pool region it maps; prints ``{"pool": [[slot, nbytes], ...]}``.
    Commands: ``release`` (a RELEASE for ``region``/``slot``), ``read`` (how many bytes of pool slot ``slot``'s
    tensor area are 0xAB), ``acquire`` (borrow ``nbytes``; the slot and whether all of it is zero), ``scribble``
    (random bytes over pool slots ``slots`` for ``secs``), ``digest`` (a hash of the pool region without ``skip``).
``victim NAME SECS``
    checked ``scale`` calls for SECS seconds of 100,000 float32 (borrowed from the pool's 1M class) once told ``{"do": "go"}``;
    prints the count of right answers, typed refusals (by class) and anything else.
``sharer NAME``
    puts and drops resident tensors on command: ``{"do": "put", "name", "value", "n", "shared"}`` (a float32 array
    of ``n`` times ``value``), ``{"do": "drop", "name"}``; answers ``{"ok": true}`` or the refusal's class and field.
``keeper NAME FLAG``
    submit a ``t_wait`` request (the test's users' op, waiting for file FLAG) that keeps its output as the private
    ``kept`` and the shared ``shared/kept``; prints ``{"submitted": true}`` and waits to be killed or told ``bye``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from shmrpc.client import Client, Pipeline
from shmrpc.schema import messages as m
from shmrpc.schema.errors import RequestError


def say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def commands() -> Iterator[dict[str, Any]]:
    for line in sys.stdin:
        if line.strip():
            yield json.loads(line)


def holder(name: str, nbytes: int) -> None:
    c = Client(name, timeout_s=10)
    loan = c.loan(nbytes)
    s = loan._s
    loan._live()[c.geometry.desc_nbytes:] = b"\xab" * (s.nbytes - c.geometry.desc_nbytes)
    say({"region": s.region, "slot": s.index, "generation": s.generation})
    for cmd in commands():
        if cmd["do"] == "release":
            loan.release()
            say({"released": True})
        elif cmd["do"] == "call":
            out = c.call("scale", x=np.ones(4, np.float32), a=3.0)["out"]
            say({"ok": bool(np.all(out == 3.0))})
    c.close()


def attacker(name: str) -> None:
    c = Client(name, timeout_s=10, on_busy="fail")
    pool = c._regions[0]
    geo = pool.geometry
    d = geo.desc_nbytes
    say({"pool": [[i, geo.slot_nbytes(i)] for i in range(geo.n_slots)]})
    loans = []
    for cmd in commands():
        do = cmd["do"]
        if do == "release":
            c._t.send(m.SLOT_STRUCT.pack(m.RELEASE, cmd["region"], cmd["slot"]))
            say({"sent": True})
        elif do == "read":
            v = np.frombuffer(pool.slot(cmd["slot"]), np.uint8)[d:]
            say({"ab": int(np.count_nonzero(v == 0xAB)), "of": int(v.size)})
        elif do == "acquire":
            try:
                loan = c.loan(cmd["nbytes"], timeout_s=1)
            except RequestError as e:
                say({"error": type(e).__name__})
                continue
            loans.append(loan)
            s = loan._s
            say({"region": s.region, "slot": s.index, "zero": not np.frombuffer(loan._live(), np.uint8).any()})
        elif do == "scribble":
            rng = np.random.default_rng(cmd["seed"])
            views = [np.frombuffer(pool.slot(i), np.uint8) for i in cmd["slots"]]
            junk = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
            n, end = 0, time.monotonic() + cmd["secs"]
            while time.monotonic() < end:
                for v in views:
                    at = int(rng.integers(0, v.size - 64))
                    ln = int(rng.integers(1, min(v.size - at, junk.size)))
                    v[at:at + ln] = junk[:ln]  # header, descriptor, tensors: anywhere in the slot
                    n += 1
            say({"writes": n})
        elif do == "digest":
            h = hashlib.sha256()
            h.update(pool.buf[:geo.slot_offset(0)])
            for i in range(geo.n_slots):
                if i not in cmd["skip"]:
                    h.update(pool.slot(i))
            say({"digest": h.hexdigest()})
    c.close()


def victim(name: str, secs: float) -> None:
    c = Client(name, timeout_s=10)
    x = np.full(100_000, 7.0, np.float32)  # 400 KB in, 400 KB out: beyond a 64K lease, borrowed from the 1M class
    say({"ready": True})
    next(iter(commands()))
    right, refused, other = 0, {}, []
    end = time.monotonic() + secs
    while time.monotonic() < end:
        try:
            right += bool(np.array_equal(c.call("scale", x=x, a=2.0)["out"], 2 * x))
        except RequestError as e:
            refused[type(e).__name__] = refused.get(type(e).__name__, 0) + 1
        except Exception as e:  # noqa: BLE001 - the test asserts there is none (a Timeout, a crash)
            other.append(repr(e))
    say({"right": right, "refused": refused, "other": other})
    c.close()


def sharer(name: str) -> None:
    c = Client(name, timeout_s=10)
    say({"ready": True})
    for cmd in commands():
        try:
            if cmd["do"] == "put":
                c.put(cmd["name"], np.full(cmd.get("n", 4), cmd["value"], np.float32), shared=cmd.get("shared", True))
            else:
                c.drop(cmd["name"])
            say({"ok": True})
        except RequestError as e:
            say({"error": type(e).__name__, "field": e.field})
    c.close()


def keeper(name: str, flag: str) -> None:
    c = Client(name, timeout_s=30)
    p = Pipeline(outputs=()).then("t_wait", outputs={"out": "kept"}, path=flag).then(
        "t_wait", inputs={"x": "x"}, outputs={"out": "shared/kept"}, path=flag)
    c.submit(p, x=np.ones(4, np.float32), keep=("kept", "shared/kept"))
    say({"submitted": True})
    for cmd in commands():
        if cmd["do"] == "bye":
            c._t.send(m.BYE)  # BYE behind the CALL, without waiting for its answer (the process lives on)
            say({"bye": True})
    time.sleep(60)


if __name__ == "__main__":
    role, name, *rest = sys.argv[1:]
    if role == "holder":
        holder(name, int(rest[0]))
    elif role == "attacker":
        attacker(name)
    elif role == "victim":
        victim(name, float(rest[0]))
    elif role == "sharer":
        sharer(name)
    elif role == "keeper":
        keeper(name, rest[0])
    else:
        sys.exit(f"unknown role {role}")
