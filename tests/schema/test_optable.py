"""The op table entry format: build and parse round trip, and malformed tables are refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shmrpc.schema.optable import AttrEntry, OpEntry, build_op_table, parse_op_table

SCALE = OpEntry("scale", 3, ("x",), ("out",), {"a": AttrEntry("float", 1.0), "n": AttrEntry("int", required=True)},
                inplace=True, doc="out = a * x")
ECHO = OpEntry("echo", 1, ("x",), ("out",), alias=True)


def test_round_trip_through_json() -> None:
    table = build_op_table([SCALE, ECHO])
    assert list(table) == ["echo", "scale"]  # listed by code
    assert table["scale"]["attrs"]["n"] == {"kind": "int", "default": None, "required": True}
    assert parse_op_table(json.loads(json.dumps(table))) == {"echo": ECHO, "scale": SCALE}


def test_unknown_keys_are_ignored() -> None:
    table = build_op_table([ECHO])
    table["echo"]["since"] = "2.0"
    assert parse_op_table(table)["echo"] == ECHO


def _bad(**change: Any) -> dict[str, Any]:
    entry = SCALE.to_json()
    entry.update(change)
    return {"scale": entry}


@pytest.mark.parametrize("table, words", [
    ([], "must be an object"),
    ({"scale": []}, "the entry must be an object"),
    (_bad(code=0), "code"),
    (_bad(code=65536), "code"),
    (_bad(code=True), "code"),
    (_bad(code="3"), "code"),
    (_bad(inputs="x"), "inputs"),
    (_bad(outputs=[1]), "outputs"),
    (_bad(attrs=[]), "attrs"),
    (_bad(attrs={"a": {"kind": "complex"}}), "kind"),
    (_bad(attrs={"a": {"kind": "float", "default": "1"}}), "default"),
    (_bad(attrs={"a": {"kind": "int", "default": True}}), "default"),
    (_bad(attrs={"a": {"kind": "int", "required": 1}}), "required"),
    (_bad(inplace=1), "inplace"),
    (_bad(doc=None), "doc"),
    ({"": SCALE.to_json()}, "op name"),
    ({"scale": SCALE.to_json(), "twin": SCALE.to_json()}, "share code 3"),
])
def test_malformed_tables_name_what_is_wrong(table: Any, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        parse_op_table(table)


def test_build_refuses_a_code_twice() -> None:
    with pytest.raises(ValueError, match="twice"):
        build_op_table([SCALE, OpEntry("other", 3, (), ())])


def test_backends_round_trip_and_default() -> None:
    e = OpEntry("rope", 0x1234, ("x",), ("out",), backends=("cupy",))
    back = parse_op_table(json.loads(json.dumps(build_op_table([e]))))["rope"]
    assert back.backends == ("cupy",) and not back.builtin
    old = {"echo": {"code": 1, "inputs": ["x"], "outputs": ["out"]}}  # an older worker's entry
    assert parse_op_table(old)["echo"].backends == ()


def test_backends_of_the_wrong_type_is_an_error_naming_the_key() -> None:
    with pytest.raises(ValueError, match="'rope': backends"):
        parse_op_table({"rope": {"code": 4097, "backends": "cupy"}})
