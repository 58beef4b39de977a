"""A worker run by tests/e2e/test_lifecycle.py with a SIGTERM storm: `python procs_worker_storm.py SERVE-ARGS...`.

Runs ``shmrpc serve SERVE-ARGS`` in this process, traced: from the first call of ``Worker.stop`` (the
worker stopping itself, e.g. after an unrecoverable backend error) until ``serve_forever`` returns, the
worker sends itself SIGTERM at every line its main thread runs. A SIGTERM then lands inside the worker's
own stop, where a handler that took a lock the interrupted code held would wait on itself. Prints
``storm`` on stderr once it begins.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any

from shmrpc.server._loop import Worker
from shmrpc.server.cli import main

_STOP, _SERVE = Worker.stop.__code__, Worker.serve_forever.__code__
_armed = False


def _storm(frame: FrameType, event: str, arg: Any) -> Any:
    global _armed
    if _armed:
        if event == "return" and frame.f_code is _SERVE:
            _armed = False
        else:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before kill() returns, at this very line
    elif event == "call" and frame.f_code is _STOP:
        _armed = True
        print("storm", file=sys.stderr, flush=True)
    return _storm


if __name__ == "__main__":
    sys.settrace(_storm)  # the main thread only
    sys.exit(main(sys.argv[1:]))
