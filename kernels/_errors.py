"""Errors raised by ``shmrpc.kernels``; they carry structured fields, never wire codes.

::

    OpError                             base; fields op, step, tensor, field
    ├── KernelInputError (also ValueError)    the inputs, attrs or pipeline are wrong
    ├── KernelRuntimeError (also RuntimeError) the op failed while running (CUDA error ...)
    │   ├── KernelFatalError                  a sticky device error: the process must restart
    │   └── KernelResourceError               out of device memory / resident-tensor limit
    └── BackendUnavailable (also RuntimeError) the asked-for backend cannot start here

``step`` is the index of the pipeline step (-1 when not about one step); ``op``,
``tensor`` and ``field`` are strings ("" when not known). The server maps these to
its wire errors; kernels itself knows nothing of the wire. (The base is ``OpError``, not
``KernelError``: that name is the wire error class in ``shmrpc.schema.errors``.)
"""

from __future__ import annotations

import signal

__all__ = [
    "OpError",
    "KernelInputError",
    "KernelRuntimeError",
    "KernelFatalError",
    "KernelResourceError",
    "BackendUnavailable",
    "is_op_failure",
]


class OpError(Exception):
    """Base of every error raised by ``shmrpc.kernels``.

    Parameters
    ----------
    message: one sentence saying what happened and what to do about it.
    op: the op name ("" when not about one op).
    step: the pipeline step index (-1 when not about one step).
    tensor: the tensor (op parameter or request tensor name) at fault, or "".
    field: what about it is wrong: "shape", "dtype", "op", an attr name, "resident" ...
    """

    def __init__(self, message: str, *, op: str = "", step: int = -1, tensor: str = "", field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.op = op
        self.step = step
        self.tensor = tensor
        self.field = field

    def with_context(self, *, op: str | None = None, step: int | None = None) -> OpError:
        """Fill ``op``/``step`` where they are still unknown; returns ``self``."""
        if op is not None and not self.op:
            self.op = op
        if step is not None and self.step < 0:
            self.step = step
        return self

    def __str__(self) -> str:
        where = [f"{k}={v!r}" for k, v in (("op", self.op), ("tensor", self.tensor), ("field", self.field)) if v]
        if self.step >= 0:
            where.insert(0, f"step={self.step}")
        return f"{self.message} ({', '.join(where)})" if where else self.message

    def __reduce__(self):  # keep the fields across pickling (process pools, logging)
        return (_rebuild, (type(self), self.message, self.op, self.step, self.tensor, self.field))


def _rebuild(cls: type[OpError], message: str, op: str, step: int, tensor: str, field: str) -> OpError:
    return cls(message, op=op, step=step, tensor=tensor, field=field)


class KernelInputError(OpError, ValueError):
    """The request's inputs, attributes or pipeline do not satisfy the op's contract; fix the request."""


class KernelRuntimeError(OpError, RuntimeError):
    """The op failed while running (for example a CUDA error); the request may be retried."""


class KernelFatalError(KernelRuntimeError):
    """A sticky device error (the CUDA context is unusable): this request failed and the process must restart."""


class KernelResourceError(KernelRuntimeError):
    """Out of device memory, or the resident-tensor limit would be exceeded; free resident tensors or ask for less."""


class BackendUnavailable(OpError, RuntimeError):
    """The backend asked for cannot run here (no CuPy, no GPU); use ``"auto"`` or ``"numpy"``."""


def is_op_failure(e: BaseException) -> bool:
    """Whether ``e``, raised by an op's own code (its implementation, its shape rule or its cost rule), is that
    request's error (a :class:`KernelRuntimeError` / :class:`KernelInputError` naming the op) rather than something
    to let through: every ``Exception``, and every other ``BaseException`` (``SystemExit``: an op's ``sys.exit()``,
    ``GeneratorExit``, ``asyncio.CancelledError``, a library's own subclass), so none of them ends the worker's
    thread or the worker. The one exception is a ``KeyboardInterrupt`` raised while SIGINT has Python's default
    handler, which a real Ctrl-C may have raised: in a caller's own process (``check_parity``, a backend used
    directly) it stays the caller's. A worker installs its own SIGINT handler (it drains and exits), so there every
    ``KeyboardInterrupt`` is the op's own and fails its request."""
    if not isinstance(e, KeyboardInterrupt):
        return True
    try:
        return signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    except (ValueError, OSError):  # no signal support here: nothing could have raised it but the op
        return True
