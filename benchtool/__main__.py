"""``python -m shmrpc.bench lat|bw ...``: the same as ``shmrpc bench``."""

from __future__ import annotations

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m shmrpc.bench"))
