"""The shmrpc error tree, shared by the worker and the client, with wire codes.

::

    ShmrpcError
    ├── ConnectError (also ConnectionError)      connect/handshake failed
    │   ├── ProtocolMismatchError                protocol version or schema hash differ
    │   └── ClientLimitError                     the worker already serves as many clients as it may
    ├── WorkerGoneError (also ConnectionError)   the worker died or closed while we waited
    ├── Timeout (also TimeoutError)              no answer within timeout_s
    ├── ForkedClientError                        a Client used in a forked child
    ├── ClientClosedError                        a closed Client, or a released loan, was used
    └── RequestError                             the worker answered a request with an error
        ├── InvalidRequestError                  bad header / descriptor / tensor / slot (carries ``field``)
        │   ├── StaleSlotError                   slot not leased to this client, or old generation
        │   ├── RequestTooLargeError             does not fit any slot (names the option to change)
        │   └── UnknownOpError                   op name or code not in the op table
        ├── BusyError                            no free slot within the caller's patience
        ├── KernelError                          the op refused its inputs or failed (op, step, tensor)
        │   └── ResourceError                    out of device memory / resident-tensor limit
        └── InternalError                        a bug in the worker; the request was not run

Every :class:`RequestError` has a stable wire ``code`` (u16, the Response's
``status``); :func:`from_wire` turns a code and its fields back into the most
specific class. Structured fields (``op``, ``step``, ``tensor``, ``field``)
mean callers need not parse messages.
"""

from __future__ import annotations

__all__ = [
    "ShmrpcError",
    "ConnectError",
    "ProtocolMismatchError",
    "ClientLimitError",
    "WorkerGoneError",
    "Timeout",
    "ForkedClientError",
    "ClientClosedError",
    "RequestError",
    "InvalidRequestError",
    "StaleSlotError",
    "RequestTooLargeError",
    "UnknownOpError",
    "BusyError",
    "KernelError",
    "ResourceError",
    "InternalError",
    "from_wire",
    "WIRE_CODES",
]


class ShmrpcError(Exception):
    """Base of every error shmrpc raises."""


class ConnectError(ShmrpcError, ConnectionError):
    """The worker could not be reached, could not be verified, or refused the handshake.

    Attributes:
        path: the directory, socket or region the problem is about (``""`` when none).
        owner_uid: the uid found owning that path, or running behind that socket (``None`` when
            the problem is not about who owns it).
        field: the HELLO field the worker's refusal named (``""`` when none).
    """

    def __init__(self, message: str = "", *, path: str = "", owner_uid: int | None = None, field: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.owner_uid = owner_uid
        self.field = field


class ProtocolMismatchError(ConnectError):
    """Client and worker speak different protocol versions or schemas; upgrade one side."""


class ClientLimitError(ConnectError):
    """The worker refused the handshake: it serves ``--max-clients`` clients, or ``--max-clients-per-uid``
    of this uid, already. Close an idle client, or ask the worker's owner to raise the limit."""


class WorkerGoneError(ShmrpcError, ConnectionError):
    """The worker process exited (or closed the connection) while a call was pending."""


class Timeout(ShmrpcError, TimeoutError):
    """No answer came within the caller's ``timeout_s``.

    Attributes:
        op: the op of the request that got no answer (the first step's for a pipeline; ``""`` when the wait was for
            something else: a free slot, an answer to a question).
    """

    def __init__(self, message: str = "", *, op: str = "") -> None:
        super().__init__(message)
        self.op = op


class ForkedClientError(ShmrpcError):
    """A Client was used in a process forked after it was created; create a new Client there."""


class ClientClosedError(ShmrpcError):
    """A closed Client, or a released loan or response, was used."""


class RequestError(ShmrpcError):
    """The worker refused or failed a request. Carries the structured location fields."""

    code: int = 0xFFFF

    def __init__(
        self,
        message: str,
        *,
        op: str = "",
        step: int = -1,
        tensor: str = "",
        field: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.op = op
        self.step = step
        self.tensor = tensor
        self.field = field

    def __reduce__(self):  # keeps the keyword fields through pickling
        return (_rebuild, (type(self), self.message, self.op, self.step, self.tensor, self.field))

    def where(self) -> str:
        """The location fields as ``op=... step=... tensor=... field=...`` (empty ones left out)."""
        parts = []
        if self.op:
            parts.append(f"op={self.op}")
        if self.step >= 0:
            parts.append(f"step={self.step}")
        if self.tensor:
            parts.append(f"tensor={self.tensor}")
        if self.field:
            parts.append(f"field={self.field}")
        return " ".join(parts)

    def __str__(self) -> str:
        where = self.where()
        return f"{self.message} [{where}]" if where else self.message


def _rebuild(cls: type[RequestError], message: str, op: str, step: int, tensor: str, field: str) -> RequestError:
    return cls(message, op=op, step=step, tensor=tensor, field=field)


class InvalidRequestError(RequestError):
    """The request in the slot broke the wire contract; ``field`` names what."""

    code = 1


class StaleSlotError(InvalidRequestError):
    """The slot is not leased to this client, or the header's generation is old."""

    code = 2


class RequestTooLargeError(InvalidRequestError):
    """The request does not fit in any slot; the message names the worker option to raise."""

    code = 3


class UnknownOpError(InvalidRequestError):
    """The op name or op code is not in the worker's op table."""

    code = 4


class BusyError(RequestError):
    """Every slot that could hold the request is in use."""

    code = 5


class KernelError(RequestError):
    """The op refused its inputs (shape, dtype, attribute) or failed while running."""

    code = 6


class ResourceError(KernelError):
    """Out of device memory, or the resident-tensor limit would be exceeded."""

    code = 7


class InternalError(RequestError):
    """An unexpected failure inside the worker; the worker keeps serving."""

    code = 8


WIRE_CODES: dict[int, type[RequestError]] = {
    cls.code: cls
    for cls in (
        InvalidRequestError,
        StaleSlotError,
        RequestTooLargeError,
        UnknownOpError,
        BusyError,
        KernelError,
        ResourceError,
        InternalError,
    )
}


def from_wire(code: int, message: str, *, op: str = "", step: int = -1, tensor: str = "", field: str = "") -> RequestError:
    """The most specific :class:`RequestError` for a wire ``code`` (unknown codes give ``RequestError``)."""
    cls = WIRE_CODES.get(code, RequestError)
    err = cls(message, op=op, step=step, tensor=tensor, field=field)
    if cls is RequestError:
        err.code = code
    return err
