"""The ``shmrpc`` command: a dispatcher that knows neither the worker nor the benchmark tool.

``shmrpc bench ...`` goes to :mod:`shmrpc.bench` (a tool beside the product); everything else
(``serve``, ``status``, ``doctor``, ``--help``, ``--version``) goes to :mod:`shmrpc.server.cli`,
whose module docstring lists the exit statuses.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shmrpc`` command; returns the exit status.

    Example:
        >>> main(["status", "--name", "nobody-here", "-q"])
        1
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":
        try:
            bench = importlib.import_module("shmrpc.bench")
        except ImportError as e:
            print(f"shmrpc bench: the benchmark tool is not installed ({e})", file=sys.stderr)
            return 1
        code: int = bench.main(argv[1:])
        return code
    from shmrpc.server.cli import main as server_main

    return server_main(argv)


if __name__ == "__main__":
    sys.exit(main())
