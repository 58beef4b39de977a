"""The pyzmq peer's two modes side by side: messages copied (pyzmq's default) or not (``copy=False``).

    python bench/zmq_copy_probe.py --sizes 64,4096,65536,1048576 --rounds 3 --iters 5000 --out FILE.json

The peer of ``shmrpc bench`` (``benchtool/_peers.py``) is a DEALER client and a ROUTER echo server over ``ipc://``.
Per round, size and mode this starts that server in its own process (the same loop as the peer's, in the mode asked
for), runs ``--iters`` round trips from this process and keeps the p50; the two modes alternate within a round. It
prints the medians over the rounds and their ratio, and writes them with the machine's facts as JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import secrets
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import zmq

from shmrpc.bench._report import machine_facts, now_iso


def _server(address: str, copy: bool, ready: Any) -> None:
    """The peer's echo loop, in one mode: view the payload, read it, send it back."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    ready.set()
    while True:
        if copy:
            ident, msg = sock.recv_multipart()
            np.frombuffer(msg, dtype=np.uint8)[::4096].sum()
            sock.send_multipart([ident, msg])
        else:
            ident, frame = sock.recv_multipart(copy=False)
            np.frombuffer(frame.buffer, dtype=np.uint8)[::4096].sum()
            sock.send_multipart([ident, frame], copy=False)


def _p50_us(address: str, copy: bool, nbytes: int, iters: int) -> float:
    """p50 of ``iters`` round trips of ``nbytes`` (after a tenth as many unmeasured), µs."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    payload = np.ones(nbytes, np.uint8)
    times = []
    try:
        for i in range(iters + iters // 10):
            t = time.perf_counter()
            if copy:
                sock.send(payload)
                sock.recv()
            else:
                sock.send(payload, copy=False)
                sock.recv(copy=False)
            if i >= iters // 10:
                times.append(time.perf_counter() - t)
    finally:
        sock.close()
        ctx.term()
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,4096,65536,1048576")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    started = now_iso()
    got: dict[int, dict[str, list[float]]] = {n: {"copy": [], "nocopy": []} for n in sizes}
    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="zmq-copy-probe-") as tmp:
        for r in range(args.rounds):
            for n in sizes:
                for mode in (("copy", "nocopy") if r % 2 == 0 else ("nocopy", "copy")):
                    address = f"ipc://{tmp}/s-{secrets.token_hex(4)}"
                    ready = spawn.Event()
                    server = spawn.Process(target=_server, args=(address, mode == "copy", ready), daemon=True)
                    server.start()
                    try:
                        if not ready.wait(30):
                            raise SystemExit("the echo server did not start")
                        got[n][mode].append(_p50_us(address, mode == "copy", n, args.iters))
                    finally:
                        server.kill()
                        server.join(10)
    rows = []
    print(f"{'size':>9} {'copy p50 µs':>12} {'copy=False p50 µs':>18} {'copy / copy=False':>18}")
    for n in sizes:
        c, nc = statistics.median(got[n]["copy"]), statistics.median(got[n]["nocopy"])
        rows.append({"nbytes": n, "copy_p50_us": round(c, 2), "nocopy_p50_us": round(nc, 2),
                     "copy_over_nocopy": round(c / nc, 3), "rounds": got[n]})
        print(f"{n:>9} {c:>12.2f} {nc:>18.2f} {c / nc:>18.3f}")
    doc = {"date": started, "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
           "machine": machine_facts(), "pyzmq": zmq.__version__, "libzmq": zmq.zmq_version(), "iters": args.iters,
           "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
