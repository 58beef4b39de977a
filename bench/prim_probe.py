"""What the small-request path's building blocks cost on this machine: clock reads, a lane's seq word, slot writes.

    python bench/prim_probe.py [--out FILE.json]

Times, with ``timeit`` (the best of 7 repeats), the operations a round trip through a lane does many times: the clocks
(``time.perf_counter``, ``time.monotonic_ns``, ``time.monotonic``), a seq word read and written through ctypes, a frame
written into an mmap, ``struct.pack_into``, a memoryview slice copied out against a ctypes array's slice, an
``eventfd`` write, a 16-float ``numpy.add`` into its first input, a Python call. Also prints the kernel's clock source
(a clock read that is a system call, not a vDSO read, costs a round trip many times over). ns per operation.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import struct
import sys
import timeit
from pathlib import Path

import numpy as np


def _clocksource() -> str:
    p = Path("/sys/devices/system/clocksource/clocksource0/current_clocksource")
    try:
        return p.read_text().strip()
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--number", type=int, default=200_000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    page = mmap.mmap(-1, 4096)
    mv = memoryview(page)
    slot = mv[1024:2048]
    raw = (ctypes.c_char * 1024).from_buffer(slot)
    word = ctypes.c_uint64.from_buffer(page, 128)
    frame, efd = bytes(16), os.eventfd(0, os.EFD_NONBLOCK)
    x, y = (np.frombuffer(raw, np.float32, 16, off) for off in (0, 64))
    h = struct.Struct("<IHIHI")

    def f() -> None:
        pass

    env = {"time": __import__("time"), "word": word, "page": page, "frame": frame, "h": h, "slot": slot, "raw": raw,
           "os": os, "efd": efd, "np": np, "x": x, "y": y, "f": f, "add": np.add}
    cases = {
        "time.perf_counter()": "time.perf_counter()",
        "time.monotonic_ns()": "time.monotonic_ns()",
        "time.monotonic()": "time.monotonic()",
        "seq word read (ctypes .value)": "word.value",
        "seq word write (ctypes .value =)": "word.value = 5",
        "16 B frame into the mmap (slice assignment)": "page[16:32] = frame",
        "struct.pack_into, a 16 B header": "h.pack_into(slot, 0, 1, 2, 3, 4, 5)",
        "104 B out of a memoryview slice (bytes(mv[a:b]))": "bytes(slot[16:120])",
        "104 B out of a ctypes array (raw[a:b])": "raw[16:120]",
        "os.eventfd_write": "os.eventfd_write(efd, 1)",
        "numpy.add of 16 float32, into its first input": "add(x, y, x)",
        "a Python call of a function doing nothing": "f()",
    }
    try:
        got = {k: round(min(timeit.repeat(stmt, globals=env, number=args.number, repeat=7)) / args.number * 1e9, 1)
               for k, stmt in cases.items()}
    finally:
        os.close(efd)  # (the page goes with the process: the views of it in env export its buffer)
    clock = _clocksource()
    print(f"clock source: {clock}")
    for k, v in got.items():
        print(f"{k:<52} {v:8.1f} ns")
    if args.out:
        from shmrpc.bench._report import write_probe

        write_probe({"mode": "prim-probe", "clocksource": clock, "number": args.number, "ns": got}, None, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
