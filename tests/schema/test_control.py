"""The JSON control messages (schema/control.py): each round-trips, refuses a malformed body naming the field,
ignores unknown keys, and docs/protocol.md's field table is exactly the code's."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import pytest
from support.protocol_doc import DOC

from shmrpc.schema import messages as m
from shmrpc.schema.control import (
    ERROR_KINDS,
    MESSAGES,
    Acquire,
    ControlMessage,
    ErrorReply,
    Grant,
    Hello,
    Manage,
    Managed,
    MessageError,
    State,
    Welcome,
    decode,
)

EXAMPLES: dict[str, ControlMessage] = {
    "HELLO": Hello(3, "0123456789abcdef", 4242, 1000, 123456, [1, 0]),
    "WELCOME": Welcome(3, "0123456789abcdef", 1, "ab" * 16, 4242, 99, "numpy",
                       [{"index": 1, "name": "memfd:x", "nbytes": 69632}], {"desc_nbytes": 4096, "classes": []},
                       [[1, 0, 1]], {}),
    "ACQUIRE": Acquire(200_000, 1.5, 7),
    "GRANT": Grant(0, 2, 5, 1 << 20, 7),
    "MANAGE": Manage("drop", "w", 8),
    "MANAGED": Managed(resident={"w": {"shape": [2], "dtype": "float32"}}, id=9),
    "ERROR": ErrorReply(5, "refused_request", "no slot", "nbytes", 7),
    "STATE": State("w", 1, 0.5, "numpy", "/run/w.sock", [], [], 0, 0, 0, {}, {}, {"later": 1}),
}


def test_every_json_message_has_an_example() -> None:
    assert sorted(EXAMPLES) == sorted(c.NAME for c in MESSAGES.values())


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_message_round_trips(name: str) -> None:
    msg = EXAMPLES[name]
    frame = msg.encode()
    assert frame[:1] == msg.KIND
    assert type(msg).decode(frame) == msg
    assert decode(frame) == msg


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_unknown_keys_are_ignored(name: str) -> None:
    msg = EXAMPLES[name]
    body = msg.to_json() | {"added_by_a_later_version": [1, 2]}
    got = type(msg).from_json(body)
    if isinstance(got, State):  # STATE keeps what it does not name
        assert got.extra == {"later": 1, "added_by_a_later_version": [1, 2]}
    else:
        assert got == msg


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_required_field_missing_is_refused_by_name(name: str) -> None:
    msg = EXAMPLES[name]
    for f in dataclasses.fields(msg):
        if f.default is not dataclasses.MISSING:
            continue
        body = msg.to_json()
        del body[f.name]
        with pytest.raises(MessageError) as e:
            type(msg).from_json(body)
        assert e.value.field == f.name and f.name in str(e.value)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_field_of_the_wrong_type_is_refused_by_name(name: str) -> None:
    msg = EXAMPLES[name]
    for f in dataclasses.fields(msg):
        if f.name == "extra":
            continue
        bad: Any = True if "int" in str(f.type) or "float" in str(f.type) else 3  # a bool is not a number
        body = msg.to_json() | {f.name: bad}
        with pytest.raises(MessageError) as e:
            type(msg).from_json(body)
        assert e.value.field == f.name, (f.name, e.value)


@pytest.mark.parametrize("frame,field", [
    (m.ACQUIRE + b"[1]", "body"),
    (m.ACQUIRE + b"{", "body"),
    (m.ACQUIRE + b'{"a":' * 10_000 + b"1" + b"}" * 10_000, "body"),
    (m.GRANT + b'{"nbytes": 1}', "kind"),
    (b"Z{}", "kind"),
])
def test_malformed_frames_name_the_field(frame: bytes, field: str) -> None:
    with pytest.raises(MessageError) as e:
        (Acquire.decode if frame[:1] != b"Z" else decode)(frame)
    assert e.value.field == field
    assert isinstance(e.value, ValueError)


def test_ids_are_optional_and_left_out_when_none() -> None:
    assert json.loads(Acquire(4096).encode()[1:]) == {"nbytes": 4096, "wait_s": 0.0}
    assert Acquire.decode(m.ACQUIRE + b'{"nbytes": 4096}') == Acquire(4096)


_ROW = re.compile(r"^\| (\w+) \| (\w+) \| ([\w ]+) \| (yes|no) \|$")
_TYPES = {"int": "int", "float": "number", "str": "str", "list": "list", "dict": "object", "bool": "bool"}


def _doc_type(annotation: str) -> str:
    return " or ".join("null" if t == "None" else _TYPES[t] for t in annotation.split(" | "))


def test_the_docs_field_table_is_the_code() -> None:
    text = DOC.read_text()
    table = text.split("<!-- control-fields -->", 1)[1].split("<!-- /control-fields -->", 1)[0]
    doc = [_ROW.match(line).groups() for line in table.splitlines() if _ROW.match(line)]  # type: ignore[union-attr]
    code = [(cls.NAME, f.name, _doc_type(str(f.type)), "yes" if f.default is dataclasses.MISSING else "no")
            for cls in MESSAGES.values() for f in dataclasses.fields(cls) if f.name != "extra"]
    assert doc == code


def test_the_docs_error_kinds_are_the_code() -> None:
    text = DOC.read_text().split("### 2.2", 1)[1].split("\n## ", 1)[0]
    kinds = re.findall(r"^\| `(\w+)` \|", text, re.MULTILINE)
    assert kinds == list(ERROR_KINDS)
