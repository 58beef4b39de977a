"""shmrpc.client: call a shmrpc worker from Python.

The public surface is here; everything in ``_``-modules is private.

* :class:`Client`: connect by worker name; ``call`` (copy in/out), ``submit`` (futures),
  ``loan`` (the zero-copy path: fill tensors in the slot, read outputs in place).
* :class:`AsyncClient`: the same calls as coroutines for asyncio (``await c.call(...)``,
  ``c.submit(...)`` awaitable, ``async with c.loan(...)``), never blocking the loop.
* :class:`Pool`: calls spread over the workers of ``shmrpc serve --devices`` (one per GPU) by
  fewest in flight; a dead worker's calls fail, new calls go to the others, it rejoins when back.
* :class:`Pipeline`: several ops in one request.
* The error tree (see :mod:`shmrpc.schema.errors`), re-exported.

Example::

    import numpy as np
    from shmrpc.client import Client

    with Client("demo") as c:
        y = c.call("vector_add", x=np.ones(4), y=np.arange(4.0))["out"]
"""

from __future__ import annotations

from shmrpc.schema.errors import (
    BusyError,
    ClientClosedError,
    ClientLimitError,
    ConnectError,
    ForkedClientError,
    InternalError,
    InvalidRequestError,
    KernelError,
    ProtocolMismatchError,
    RequestError,
    RequestTooLargeError,
    ResourceError,
    ShmrpcError,
    StaleSlotError,
    Timeout,
    UnknownOpError,
    WorkerGoneError,
)

from ._async import AsyncClient, AsyncLoan
from ._client import CallFuture, Client, Loan, Resident
from ._pipeline import Pipeline
from ._pool import Pool

__all__ = [
    "Client", "AsyncClient", "AsyncLoan", "Pool", "Loan", "CallFuture", "Pipeline", "Resident",
    "ShmrpcError", "ConnectError", "ProtocolMismatchError", "ClientLimitError", "WorkerGoneError", "Timeout", "ForkedClientError",
    "ClientClosedError", "RequestError", "InvalidRequestError", "StaleSlotError", "RequestTooLargeError",
    "UnknownOpError", "BusyError", "KernelError", "ResourceError", "InternalError",
]
