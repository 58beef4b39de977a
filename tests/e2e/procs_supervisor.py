"""The supervisor run by tests/e2e/test_pool.py with a SIGTERM storm: `python procs_supervisor.py SERVE-ARGS...`.

Runs ``shmrpc serve SERVE-ARGS`` (with ``--devices``) in this process, traced: from the moment
the supervisor has started a worker again after one died, the supervisor sends itself SIGTERM
at every line its main thread runs, through its shutdown, until ``Supervisor.run`` returns. A SIGTERM then lands in every window
of the restart and the stop, among them those where the main thread runs Python code with a lock
held: a handler that took a lock there would wait on itself. Prints ``storm`` on stderr once it
begins.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType
from typing import Any

from shmrpc.server import _supervisor
from shmrpc.server.cli import main

_START, _RUN = _supervisor.Supervisor._start.__code__, _supervisor.Supervisor.run.__code__
_armed = False


def _storm(frame: FrameType, event: str, arg: Any) -> Any:
    global _armed
    if _armed:
        if event == "return" and frame.f_code is _RUN:
            _armed = False  # the interpreter's exit puts back SIGTERM's default action: no signal after run()
        else:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before kill() returns, at this very line
    elif event == "return" and frame.f_code is _START and frame.f_locals["ch"].restarts > 0:
        _armed = True
        print("storm", file=sys.stderr, flush=True)
    return _storm


if __name__ == "__main__":
    sys.settrace(_storm)  # the main thread only: the supervisor's stdout relays are not traced
    sys.exit(main(sys.argv[1:]))
