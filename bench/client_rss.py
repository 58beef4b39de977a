"""A client's resident memory when every call is a new signature (random sizes), A/B between trees, rounds interleaved.

    python bench/client_rss.py --calls 12000 --rounds 2 --tree before=PATH --tree after= \\
        --out bench/results/client-rss-DATE.json

Starts one NumPy worker (this checkout). Per round and tree, a child process with that tree on ``PYTHONPATH``
(empty: this checkout) makes ``--calls`` ``call()``s, alternating ``echo`` of bytes and ``scale`` of float32, each of
a size drawn log-uniform from 64 B to 16 KiB (so almost every call is a new signature for the client's caches, as in
``bench/soak.py``), and reads its ``RssAnon`` from /proc after a tenth of the calls and at the end. Prints and writes
(``write_probe``) the growth between the two in KiB: what the client's caches of signatures hold once full.
"""

from __future__ import annotations

import sys

from worker_cpu import child_main  # (bench/, beside this program)

_CHILD = r"""
import json, sys
import numpy as np
from shmrpc.client import Client

def rss_anon_kib():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1])

name, calls = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(20261402)
pool = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
first = None
with Client(name, timeout_s=30) as c:
    for i in range(1, calls + 1):
        n = int(np.exp(rng.uniform(np.log(64), np.log(16 << 10))))
        if i % 2:
            out = c.call("echo", x=pool[:n])["out"]
        else:
            out = c.call("scale", x=np.ones(max(1, n // 4), np.float32), a=1.0, b=0.0)["out"]
        del out
        if i == calls // 10:
            first = rss_anon_kib()
    end = rss_anon_kib()
print(json.dumps({"rss_anon_first_kib": first, "rss_anon_end_kib": end, "growth_kib": end - first}))
"""


def main() -> int:
    return child_main(__doc__, "client-rss", "crss", _CHILD, "KiB of the client's RssAnon")


if __name__ == "__main__":
    sys.exit(main())
