"""A descriptor patched from its layout's template is byte for byte the one the encoder makes (client/_desctemplate.py).

The encoder leaves fields equal to their default out, so zero and non-zero numbers, bools and strings lay a message out
differently: every combination is drawn, and every descriptor made from a template is compared with a fresh encoding.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmrpc.client._desctemplate import DescTemplates, layout_key
from shmrpc.client._pipeline import resolve
from shmrpc.schema.descriptor import RequestDesc, TensorRef, decode_request, encode_request
from shmrpc.schema.errors import InvalidRequestError
from shmrpc.schema.optable import AttrEntry, OpEntry

X = (TensorRef("x", "float32", (16,), 4096, 64),)


@pytest.fixture(scope="module")
def table() -> Any:
    return {"t_attrs": OpEntry("t_attrs", 4096, ("x",), ("out",),
                               {"f": AttrEntry("float", 0.0), "g": AttrEntry("float", 1.0), "n": AttrEntry("int", 0),
                                "flag": AttrEntry("bool", False), "s": AttrEntry("str", "")})}


def _encoder(table: Any, calls: list[int]) -> Any:
    def encode(op: str, tensors: Any, attrs: Any, flags: int, keep: tuple[str, ...]) -> Any:
        calls.append(1)
        steps, outputs = resolve(table, op, [t.name for t in tensors], dict(attrs))
        desc = RequestDesc(tuple(steps), tensors, tuple(o for o in outputs if o not in keep), keep)
        return encode_request(desc), steps[0].op_code, flags, desc.outputs
    return encode


numbers = st.one_of(st.just(0.0), st.just(-0.0), st.floats(allow_nan=False, width=64), st.just(float("inf")),
                    st.integers(-(1 << 63), (1 << 63) - 1).map(float))
ints = st.one_of(st.just(0), st.integers(-(1 << 63), (1 << 63) - 1))


@settings(max_examples=300, deadline=None)
@given(f=numbers, g=st.one_of(numbers, st.integers(-1000, 1000)), n=ints, flag=st.booleans(),
       s=st.sampled_from(["", "x", "longer text"]), order=st.permutations(["f", "g", "n", "flag", "s"]),
       again=st.lists(st.tuples(numbers, ints), min_size=1, max_size=4))
def test_patched_descriptors_equal_the_encoders(table: Any, f: float, g: Any, n: int, flag: bool, s: str,
                                                order: list[str], again: list[tuple[float, int]]) -> None:
    calls: list[int] = []
    encode = _encoder(table, calls)
    kinds = {k: a.kind for k, a in table["t_attrs"].attrs.items()}
    t = DescTemplates(encode, lambda op: kinds if op == "t_attrs" else None)
    first = {"f": f, "g": g, "n": n, "flag": flag, "s": s}
    attrs = {k: first[k] for k in order}
    assert t.make("t_attrs", X, attrs, 0, ()) == encode("t_attrs", X, attrs, 0, ())
    for f2, n2 in again:  # the same layout: zero stays zero, non-zero stays non-zero
        nxt = dict(attrs, f=f2 if (f2 != 0) == (f != 0) else f, n=n2 if (n2 != 0) == (n != 0) else n)
        assert layout_key("t_attrs", X, nxt, 0, ()) == layout_key("t_attrs", X, attrs, 0, ())
        before = len(calls)
        got = t.make("t_attrs", X, nxt, 0, ())
        if layout_key("t_attrs", X, attrs, 0, ()) is not None:
            assert len(calls) == before, "a layout with a template was encoded again"
        assert got == encode("t_attrs", X, nxt, 0, ())
        assert dict(decode_request(got[0]).steps[0].attrs)["f"] == float(nxt["f"])


def test_no_template_for_an_unknown_op_or_a_wrong_kind(table: Any) -> None:
    calls: list[int] = []
    encode = _encoder(table, calls)
    kinds = {k: a.kind for k, a in table["t_attrs"].attrs.items()}
    t = DescTemplates(encode, lambda op: kinds if op == "t_attrs" else None)
    for n in (2.5, 3.5, 1 << 64):  # a float for an int attribute, an int past the wire's range: every call
        with pytest.raises(InvalidRequestError) as e:
            t.make("t_attrs", X, {"n": n}, 0, ())
        assert e.value.field == "n"
    with pytest.raises(InvalidRequestError, match="out of the wire's range"):
        t.make("t_attrs", X, {"f": 1 << 1100}, 0, ())
    got = t.make("t_attrs", X, {"n": 7}, 0, ())
    assert got == encode("t_attrs", X, {"n": 7}, 0, ())
    with pytest.raises(InvalidRequestError) as e:  # in a layout that has a template: the encoder says what is wrong
        t.make("t_attrs", X, {"n": 1 << 64}, 0, ())
    assert e.value.field == "n"
