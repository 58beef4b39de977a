"""The JSON control messages as typed definitions both sides build and parse through.

Each JSON message (``schema.messages`` lists the kind bytes) is one frozen dataclass here:
``Acquire(nbytes=4096, id=7).encode()`` gives the frame, ``Acquire.decode(frame)`` gives it back.

Parsing rules (the same for every message):

- the frame's first byte must be the message's kind and the rest a JSON object;
- every field present must have its declared JSON type (a bool is not an int); a required field
  must be present; otherwise :class:`MessageError` (a ``ValueError``) whose ``field`` names it;
- keys this version does not know are ignored, so a newer peer may add fields (forward compatible).

Correlation: ACQUIRE and MANAGE carry an ``id`` the client chooses; the worker echoes it in the
GRANT, MANAGED or ERROR that answers them, so a client matches replies by id (a late GRANT whose
request gave up is given back with RELEASE). ERROR carries ``id`` only when it answers one of them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar, TypeVar

from . import messages as m

__all__ = [
    "MessageError", "ControlMessage", "Hello", "Welcome", "Acquire", "Grant", "Manage", "Managed",
    "ErrorReply", "State", "MESSAGES", "ERROR_KINDS", "decode",
]

#: Every value ERROR's ``kind`` takes, and when. A refused ACQUIRE or MANAGE carries the typed error's wire
#: ``code`` (``schema.errors``) with kind ``refused_request``; the client raises that error.
ERROR_KINDS: dict[str, str] = {
    "bad_message": "a malformed control message, an unknown kind byte, more than one frame, HELLO on ZeroMQ",
    "protocol_mismatch": "HELLO's protocol or schema_hash differs from the worker's",
    "refused": "HELLO's identity does not match the kernel's, the uid is not admitted, or the region failed",
    "too_many_clients": "the uid is at its --max-clients-per-uid",
    "stopping": "the worker is shutting down",
    "no_session": "ACQUIRE or MANAGE from a routing id that never said HELLO (or whose session ended)",
    "refused_request": "ACQUIRE or MANAGE refused with a typed error (its ``code``): busy, too large, no such name",
}


class MessageError(ValueError):
    """A control message that does not parse; ``field`` names the offending field (or ``kind``/``body``)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "list": (list,), "dict": (dict,),
    "int | None": (int, type(None)), "str | None": (str, type(None)), "dict | None": (dict, type(None)),
    "list | None": (list, type(None)), "bool | None": (bool, type(None)), "Any": (object,),
}

T = TypeVar("T", bound="ControlMessage")


@dataclasses.dataclass(frozen=True)
class ControlMessage:
    """Base of the JSON control messages: ``encode`` and ``decode`` over the dataclass fields."""

    KIND: ClassVar[bytes] = b""
    NAME: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this message (optional fields left out while None)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def encode(self) -> bytes:
        """The frame: kind byte, then compact JSON."""
        return self.KIND + json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls: type[T], frame: bytes) -> T:
        """Parse ``frame``; raises :class:`MessageError` naming the field that is wrong."""
        if bytes(frame[:1]) != cls.KIND:
            raise MessageError(f"expected {cls.NAME} ({cls.KIND!r}), got kind {bytes(frame[:1])!r}", "kind")
        try:
            body = json.loads(bytes(frame[1:]).decode())
        except (ValueError, RecursionError) as e:
            raise MessageError(f"{cls.NAME} body is not JSON ({type(e).__name__})", "body") from None
        return cls.from_json(body)

    @classmethod
    def from_json(cls: type[T], body: Any) -> T:
        """The message from its JSON object; unknown keys are ignored."""
        if not isinstance(body, dict):
            raise MessageError(f"{cls.NAME} body must be a JSON object, not {type(body).__name__}", "body")
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in body:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise MessageError(f"{cls.NAME} lacks field {f.name!r}", f.name)
                continue
            value = body[f.name]
            allowed = _JSON_TYPES[str(f.type)]
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise MessageError(f"{cls.NAME} field {f.name!r} must be {f.type}, not {type(value).__name__}",
                                   f.name)
            kwargs[f.name] = value
        return cls(**kwargs)


@dataclasses.dataclass(frozen=True)
class Hello(ControlMessage):
    """HELLO (attach socket): who the client says it is; each must equal what the kernel says of the peer."""

    KIND: ClassVar[bytes] = m.HELLO
    NAME: ClassVar[str] = "HELLO"
    protocol: int
    schema_hash: str
    pid: int
    uid: int
    start_ticks: int | None
    #: Slots wanted per size class (the worker caps them by --lease-max); None: the default lease.
    lease: list | None = None
    #: Ask for a lane (schema/lane.py): a shared page and two eventfds beside ZeroMQ for synchronous calls.
    lane: bool | None = None


@dataclasses.dataclass(frozen=True)
class Welcome(ControlMessage):
    """WELCOME (attach socket): the session; the regions' fds travel beside it, in the order of ``regions``."""

    KIND: ClassVar[bytes] = m.WELCOME
    NAME: ClassVar[str] = "WELCOME"
    protocol: int
    schema_hash: str
    client_id: int
    token: str
    worker_pid: int
    worker_start_ticks: int | None
    backend: str
    regions: list
    geometry: dict
    lease: list
    op_table: dict
    #: A lane was granted: three more fds follow the regions' (the page, the worker's eventfd, the client's).
    lane: bool | None = None


@dataclasses.dataclass(frozen=True)
class Acquire(ControlMessage):
    """ACQUIRE: borrow one more slot of at least ``nbytes`` in all (its descriptor area included)."""

    KIND: ClassVar[bytes] = m.ACQUIRE
    NAME: ClassVar[str] = "ACQUIRE"
    nbytes: int
    wait_s: float = 0.0
    id: int | None = None


@dataclasses.dataclass(frozen=True)
class Grant(ControlMessage):
    """GRANT: the borrowed slot (``slot_nbytes`` is the whole slot), echoing the ACQUIRE's ``id``."""

    KIND: ClassVar[bytes] = m.GRANT
    NAME: ClassVar[str] = "GRANT"
    region: int
    slot: int
    generation: int
    slot_nbytes: int
    id: int | None = None


@dataclasses.dataclass(frozen=True)
class Manage(ControlMessage):
    """MANAGE: ``action`` "list" (resident tensors), "drop" (``name``), or "plan": the output specs of a
    request described by ``steps``, ``inputs``, ``resident``, ``outputs`` and ``keep`` (their contents
    are checked by :mod:`shmrpc.schema.planquery`)."""

    KIND: ClassVar[bytes] = m.MANAGE
    NAME: ClassVar[str] = "MANAGE"
    action: str
    name: str = ""
    id: int | None = None
    steps: list | None = None
    inputs: dict | None = None
    resident: list | None = None
    outputs: list | None = None
    keep: list | None = None


@dataclasses.dataclass(frozen=True)
class Managed(ControlMessage):
    """MANAGED: ``resident`` ({name: {shape, dtype}}) after "list", ``dropped`` (the name) after "drop",
    ``outputs`` ({name: [shape, dtype]}) after "plan"."""

    KIND: ClassVar[bytes] = m.MANAGED
    NAME: ClassVar[str] = "MANAGED"
    resident: dict | None = None
    dropped: str | None = None
    id: int | None = None
    outputs: dict | None = None


@dataclasses.dataclass(frozen=True)
class ErrorReply(ControlMessage):
    """ERROR: a control message was refused; ``kind`` is one of :data:`ERROR_KINDS`, ``code`` a wire error code."""

    KIND: ClassVar[bytes] = m.ERROR
    NAME: ClassVar[str] = "ERROR"
    code: int
    kind: str
    message: str
    field: str = ""
    id: int | None = None
    #: Where a refused plan query's request fails (as a CALL's error response would say); absent otherwise.
    op: str | None = None
    step: int | None = None
    tensor: str | None = None


@dataclasses.dataclass(frozen=True)
class State(ControlMessage):
    """STATE: the worker's state (what ``shmrpc status`` prints)."""

    KIND: ClassVar[bytes] = m.STATE
    NAME: ClassVar[str] = "STATE"
    name: str
    pid: int
    uptime_s: float
    backend: str | None
    socket: str
    regions: list
    clients: list
    slots_leased: int
    in_flight: int
    pending_acquires: int
    counters: dict
    resident: dict
    extra: dict | None = None

    @classmethod
    def from_json(cls, body: Any) -> State:
        """As the base, with the keys this version does not name kept in ``extra``."""
        out = super().from_json(body)
        known = {f.name for f in dataclasses.fields(cls)}
        return dataclasses.replace(out, extra={k: v for k, v in body.items() if k not in known} or None)

    def to_json(self) -> dict[str, Any]:
        """The JSON object, ``extra`` keys merged back in."""
        out = super().to_json()
        out.update(out.pop("extra", None) or {})
        return out


#: Every JSON control message by kind byte.
MESSAGES: dict[bytes, type[ControlMessage]] = {
    c.KIND: c for c in (Hello, Welcome, Acquire, Grant, Manage, Managed, ErrorReply, State)
}


def decode(frame: bytes) -> ControlMessage:
    """Parse any JSON control message by its kind byte; raises :class:`MessageError`."""
    cls = MESSAGES.get(bytes(frame[:1]))
    if cls is None:
        raise MessageError(f"{bytes(frame[:1])!r} is not a JSON control message", "kind")
    return cls.decode(frame)
