"""The plan query's messages: round trip, and malformed bodies refused naming the key."""

from __future__ import annotations

from typing import Any

import pytest

from shmrpc.schema import messages as m
from shmrpc.schema.control import Manage, Managed
from shmrpc.schema.descriptor import StepDesc
from shmrpc.schema.planquery import decode_plan_answer, decode_plan_query, encode_plan_answer, encode_plan_query


def test_round_trip() -> None:
    steps = [StepDesc("gemm", 10, (("x", "x"), ("w", "w")), (("out", "y"),), (("alpha", 1.0),))]
    msg = encode_plan_query(steps, {"x": ((4, 8), "float32"), "w": ((8, 16), "float32")}, ["w"], ["y"], [])
    frame = Manage(**{**msg.__dict__, "id": 7}).encode()
    assert frame[:1] == m.MANAGE
    got = Manage.decode(frame)
    assert (got.action, got.id) == ("plan", 7)
    q = decode_plan_query(got)
    assert q.steps == (("gemm", {"x": "x", "w": "w"}, {"out": "y"}, {"alpha": 1.0}),)
    assert q.inputs == {"x": ((4, 8), "float32"), "w": ((8, 16), "float32")}
    assert (q.resident, q.outputs, q.keep) == (("w",), ("y",), ())
    answer = encode_plan_answer({"y": ((4, 16), "float32")}, 7)
    assert answer[:1] == m.MANAGED
    reply = Managed.decode(answer)
    assert reply.id == 7 and decode_plan_answer(reply) == {"y": ((4, 16), "float32")}


@pytest.mark.parametrize(("body", "key"), [
    ([], "object"),
    ({"steps": 3}, "steps"),
    ({"steps": []}, "steps"),
    ({"steps": [["gemm", {}, {}]]}, r"steps\[0\]"),
    ({"steps": [["gemm", {"x": 1}, {}, {}]]}, r"steps\[0\].inputs"),
    ({"steps": [["gemm", {}, {}, {}]], "inputs": {"x": [[4], "complex64"]}}, r"inputs\['x'\]"),
    ({"steps": [["gemm", {}, {}, {}]], "inputs": {"x": [[-1], "float32"]}}, r"inputs\['x'\]"),
    ({"steps": [["gemm", {}, {}, {}]], "inputs": {}, "outputs": "y"}, "outputs"),
])
def test_malformed_queries_are_refused_naming_the_key(body: Any, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        decode_plan_query(Manage.from_json({"action": "plan", **body} if isinstance(body, dict) else body))


def test_malformed_answers_are_refused() -> None:
    for body in ({}, {"outputs": {"y": [[4], "nope"]}}):
        with pytest.raises(ValueError, match="plan answer"):
            decode_plan_answer(Managed.from_json(body))
    with pytest.raises(ValueError, match="outputs"):
        decode_plan_answer(Managed.from_json({"outputs": []}))
