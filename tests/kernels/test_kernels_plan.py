"""plan(): every error names what is wrong (op, step, tensor, field); plans are pure and immutable."""

from __future__ import annotations

import pytest

from shmrpc.kernels import AttrSpec, KernelInputError, StepSpec, TensorSpec, op_table, select_backend

F32 = TensorSpec((4, 8), "float32")


@pytest.fixture
def be():
    return select_backend("numpy")


def _err(be, steps, inputs, outputs, **kw) -> KernelInputError:
    with pytest.raises(KernelInputError) as ei:
        be.plan(steps, inputs, outputs, **kw)
    return ei.value


def test_unknown_op(be) -> None:
    e = _err(be, [StepSpec("scale", {"x": "a"}, {"out": "b"}), StepSpec("nope", {"x": "b"}, {"out": "c"})], {"a": F32}, ["c"])
    assert (e.op, e.step, e.field) == ("nope", 1, "op")


def test_attr_errors(be) -> None:
    e = _err(be, [StepSpec("scale", {"x": "a"}, {"out": "b"}, {"a": "two"})], {"a": F32}, ["b"])
    assert (e.op, e.step, e.field) == ("scale", 0, "a")
    e = _err(be, [StepSpec("scale", {"x": "a"}, {"out": "b"}, {"c": 1.0})], {"a": F32}, ["b"])
    assert e.field == "c"
    e = _err(be, [StepSpec("scale", {"x": "a"}, {"out": "b"}, {"a": True})], {"a": F32}, ["b"])
    assert e.field == "a"
    e = _err(be, [StepSpec("quantize_int4", {"w": "a"}, {}, {"group_size": 2.5})], {"a": F32}, ["#0.qweight"])
    assert e.field == "group_size"
    assert e.message == "attribute 'group_size' must be an int, got float"
    e = _err(be, [StepSpec("layernorm", {"x": "a", "gamma": "g", "beta": "g"}, {"out": "b"}, {"eps": -1.0})],
             {"a": F32, "g": TensorSpec((8,), "float32")}, ["b"])
    assert (e.field, e.op) == ("eps", "layernorm")


@pytest.mark.parametrize(("kind", "value", "message"), [
    ("int", 2.5, "attribute 'n' must be an int, got float"),
    ("float", "two", "attribute 'n' must be a float, got str"),
    ("bool", 1, "attribute 'n' must be a bool, got int"),
    ("str", 1.0, "attribute 'n' must be a str, got float"),
])
def test_attr_type_error_names_the_kind_with_its_article(kind: str, value: object, message: str) -> None:
    with pytest.raises(KernelInputError) as ei:
        AttrSpec(kind, None).coerce(value, attr="n", op="t", step=2)
    assert (ei.value.message, ei.value.op, ei.value.step, ei.value.field) == (message, "t", 2, "n")


def test_defaults_filled_and_int_accepted_for_float(be) -> None:
    plan = be.plan([StepSpec("scale", {"x": "a"}, {"out": "b"}, {"a": 2})], {"a": F32}, ["b"])
    assert dict(plan.steps[0].attrs) == {"a": 2.0, "b": 0.0}
    assert isinstance(plan.steps[0].attrs["a"], float)


def test_shape_and_dtype_mismatch_name_tensor_field_step(be) -> None:
    steps = [StepSpec("scale", {"x": "a"}, {"out": "t"}), StepSpec("vector_add", {"x": "t", "y": "y"}, {"out": "o"})]
    e = _err(be, steps, {"a": F32, "y": TensorSpec((4, 9), "float32")}, ["o"])
    assert (e.op, e.step, e.tensor, e.field) == ("vector_add", 1, "y", "shape")
    e = _err(be, steps, {"a": F32, "y": TensorSpec((4, 8), "float16")}, ["o"])
    assert (e.step, e.tensor, e.field) == (1, "y", "dtype")
    e = _err(be, [StepSpec("scale", {"x": "a"}, {"out": "b"})], {"a": TensorSpec((3,), "int32")}, ["b"])
    assert (e.tensor, e.field) == ("x", "dtype")
    e = _err(be, [StepSpec("gemm", {"x": "a", "w": "w"}, {"out": "o"})], {"a": F32, "w": TensorSpec((7, 3), "float32")}, ["o"])
    assert (e.tensor, e.field) == ("w", "shape")
    e = _err(be, [StepSpec("quantize_int4", {"w": "a"}, {})], {"a": TensorSpec((100, 8), "float16")}, ["#0.qweight"])
    assert (e.tensor, e.field) == ("w", "shape")


def test_unbound_and_unknown_params(be) -> None:
    e = _err(be, [StepSpec("vector_add", {"x": "a"}, {"out": "o"})], {"a": F32}, ["o"])
    assert (e.step, e.tensor, e.field) == (0, "y", "inputs")
    e = _err(be, [StepSpec("vector_add", {"x": "a", "y": "missing"}, {"out": "o"})], {"a": F32}, ["o"])
    assert (e.tensor, e.field) == ("y", "inputs")
    e = _err(be, [StepSpec("scale", {"x": "a", "z": "a"}, {"out": "o"})], {"a": F32}, ["o"])
    assert (e.tensor, e.field) == ("z", "inputs")


def test_outputs_must_be_produced(be) -> None:
    e = _err(be, [StepSpec("scale", {"x": "a"}, {"out": "b"})], {"a": F32}, ["c"])
    assert (e.tensor, e.field, e.step) == ("c", "outputs", -1)
    e = _err(be, [StepSpec("scale", {"x": "a"}, {"out": "b"})], {"a": F32}, [], keep=["zz"])
    assert (e.tensor, e.field) == ("zz", "keep")
    e = _err(be, [StepSpec("scale", {"x": "a"}, {"out": "a"})], {"a": F32}, ["a"])
    assert e.field == "outputs"  # redefining a tensor
    e = _err(be, [StepSpec("scale", {"x": "a"}, {"out": "b"})], {"a": F32}, [])
    assert e.field == "outputs"


def test_resident_binding_needs_a_spec(be) -> None:
    e = _err(be, [StepSpec("scale", {"x": "a"}, {"out": "b"})], {"a": F32}, ["b"], resident={"w": "weights"})
    assert (e.tensor, e.field) == ("w", "resident")


def test_plan_is_pure_and_immutable(be) -> None:
    steps = [StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "h"}), StepSpec("gelu", {"x": "h"}, {"out": "y"})]
    ins = {"x": TensorSpec((2, 16), "float16"), "w": TensorSpec((16, 4), "float16")}
    p1, p2 = be.plan(steps, ins, ["y", "h"]), be.plan(steps, ins, ["y", "h"])
    assert p1 == p2
    assert list(p1.outputs) == ["y", "h"] and p1.outputs["y"] == TensorSpec((2, 4), "float16")
    with pytest.raises(TypeError):
        p1.outputs["z"] = F32  # type: ignore[index]
    with pytest.raises(AttributeError):
        p1.steps = ()  # type: ignore[misc]


def test_op_table_is_json_and_codes_are_stable() -> None:
    import json

    t = json.loads(json.dumps(op_table()))
    codes = {n: v["code"] for n, v in t.items()}
    assert codes == {"echo": 1, "vector_add": 2, "scale": 3, "gemm": 10, "layernorm": 11, "gelu": 12,
                     "layernorm_gelu": 13, "softmax": 14, "quantize_int4": 15, "gemm_w4a16": 16, "gemm_bias": 17}
    assert t["scale"]["attrs"]["a"] == {"kind": "float", "default": 1.0, "required": False}
    assert t["echo"]["alias"] and t["vector_add"]["inplace"] and not t["gemm"]["inplace"]
