"""A peer server for tests of ``ServerProcess``: says ready, waits, and writes ``<address>.unwound`` when its Python
unwinds (what an iceoryx2 node needs to remove its files in /dev/shm)."""

from __future__ import annotations

import time
from typing import Any


def serve(address: str, ready: Any) -> None:
    try:
        ready.set()
        while True:
            time.sleep(0.05)
    finally:
        with open(address + ".unwound", "w") as f:
            f.write("yes")
