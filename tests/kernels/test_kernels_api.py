"""The public op API: registering users' ops, the checks on a spec, codes, what an op's result must be, the parity helper."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from shmrpc.kernels import REGISTRY, StepSpec, TensorSpec, select_backend
from shmrpc.kernels._registry import unregister
from shmrpc.kernels.api import (
    USER_CODE_MAX,
    USER_CODE_MIN,
    AttrSpec,
    KernelInputError,
    KernelRuntimeError,
    OpCall,
    OpSpec,
    OpSpecError,
    register_op,
    require_float,
    user_code,
)
from shmrpc.kernels.testing import ParityError, check_parity

BUILTIN_CODES = {"echo": 1, "vector_add": 2, "scale": 3, "gemm": 10, "layernorm": 11, "gelu": 12, "layernorm_gelu": 13,
                 "softmax": 14, "quantize_int4": 15, "gemm_w4a16": 16, "gemm_bias": 17}


@pytest.fixture
def fresh() -> Iterator[list[str]]:
    """Names registered by the test are removed after it."""
    names: list[str] = []
    yield names
    for n in names:
        if n in REGISTRY:
            unregister(n)


def _same(inputs: Any, attrs: Any) -> dict[str, TensorSpec]:
    require_float(inputs["x"], "x")
    return {"out": inputs["x"]}


def _relu(call: OpCall) -> dict[str, Any]:
    return {"out": call.xp.maximum(call.inputs["x"], 0, out=call.dest("out"))}


def _spec(name: str, **kw: Any) -> OpSpec:
    base: dict[str, Any] = dict(inputs=("x",), outputs=("out",), infer=_same, numpy=_relu,
                                tolerances={"float32": (0.0, 0.0)}, example={"x": TensorSpec((4, 8), "float32")})
    base.update(kw)
    return OpSpec(name, **base)


def _run(op: str, x: np.ndarray, attrs: dict[str, Any] | None = None) -> np.ndarray:
    be = select_backend("numpy")
    plan = be.plan([StepSpec(op, {"x": "x"}, {"out": "y"}, attrs or {})], {"x": TensorSpec(x.shape, "float32")}, ["y"])
    out = np.empty(x.shape, np.float32)
    be.run(plan, {"x": x}, {"y": out})
    return out


def test_builtin_ops_keep_their_codes_and_are_defined_through_the_api() -> None:
    assert {n: s.code for n, s in REGISTRY.items() if s.builtin} == BUILTIN_CODES
    assert all(s.module.startswith("shmrpc.kernels.") and s.backends == ("numpy", "cupy")
               for n, s in REGISTRY.items() if n in BUILTIN_CODES)


def test_a_user_op_gets_a_stable_code_in_the_users_range_and_runs(fresh: list[str]) -> None:
    spec = register_op(_spec("t_relu"))
    fresh.append("t_relu")
    assert spec.code == user_code("t_relu") and USER_CODE_MIN <= spec.code <= USER_CODE_MAX
    assert not spec.builtin and spec.backends == ("numpy",) and spec.module == __name__
    x = np.array([[-1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(_run("t_relu", x), [[0.0, 2.0]])


def test_an_explicit_code_outside_the_users_range_is_refused(fresh: list[str]) -> None:
    with pytest.raises(OpSpecError, match=r"op 't_low': code 3 is outside the users' range"):
        register_op(_spec("t_low", code=3))


def test_two_ops_with_one_code_name_both(fresh: list[str]) -> None:
    register_op(_spec("t_first", code=0x5000))
    fresh.append("t_first")
    with pytest.raises(OpSpecError, match=r"op 't_second' \(code 20480.*op 't_first' \(code 20480.*share a code"):
        register_op(_spec("t_second", code=0x5000))
    with pytest.raises(OpSpecError, match="share a name"):
        register_op(_spec("t_first", code=0x5001))
    assert "t_second" not in REGISTRY


@pytest.mark.parametrize(("changes", "match"), [
    ({"infer": None}, "infer"),
    ({"numpy": None}, "neither a numpy nor a cupy"),
    ({"numpy": 3}, "numpy implementation is not callable"),
    ({"outputs": ()}, "no outputs"),
    ({"inputs": ("x", "x")}, "names a parameter twice"),
    ({"outputs": ("x",)}, "both inputs and outputs"),
    ({"inputs": ("x-1",), "example": {}}, "identifier"),
    ({"attrs": {"a": AttrSpec("float", "one")}}, "default 'one' is not a float"),
    ({"attrs": {"a": AttrSpec("complex", 1)}}, "kind float, int, str, bool"),
    ({"mutates": ("cache",)}, "not one of its inputs"),
    ({"tolerances": {"float32": 1e-3}}, "tolerances"),
    ({"example": {"y": TensorSpec((2,), "float32")}}, "example"),
    ({"inputs": "x_in", "example": {}}, r"inputs must be a tuple of names, not the string 'x_in' \(for one name write "
                                        r"inputs=\('x_in',\), with the comma\)"),
    ({"outputs": "out"}, "outputs must be a tuple of names, not the string 'out'"),
    ({"mutates": "x"}, "mutates must be a tuple of names, not the string 'x'"),
    ({"attrs": {"copy": AttrSpec("bool", False)}}, "attribute 'copy' is named like a keyword of the client's own"),
    ({"attrs": {"timeout_s": AttrSpec("float", 1.0)}}, "attribute 'timeout_s' is named like a keyword"),
    ({"inputs": ("keep",), "example": {}}, "input 'keep' is named like a keyword"),
    ({"outputs": ("in_place",)}, "output 'in_place' is named like a keyword"),
])
def test_an_invalid_spec_is_refused_naming_the_op_and_the_reason(fresh: list[str], changes: dict[str, Any],
                                                                  match: str) -> None:
    with pytest.raises(OpSpecError, match=match) as e:
        register_op(_spec("t_bad", **changes))
    assert "'t_bad'" in str(e.value)
    assert "t_bad" not in REGISTRY


def test_a_bad_name_is_refused() -> None:
    with pytest.raises(OpSpecError, match="op name '1abc'"):
        register_op(_spec("1abc"))


def test_an_op_returning_the_wrong_shape_or_dtype_or_raising_is_a_kernel_runtime_error(fresh: list[str]) -> None:
    register_op(_spec("t_shape", numpy=lambda c: {"out": c.xp.zeros((1,), c.xp.float32)}))
    register_op(_spec("t_dtype", numpy=lambda c: {"out": c.xp.zeros(c.inputs["x"].shape, c.xp.float64)}))
    register_op(_spec("t_raise", numpy=lambda c: 1 / 0))
    register_op(_spec("t_missing", numpy=lambda c: {}))
    fresh.extend(["t_shape", "t_dtype", "t_raise", "t_missing"])
    x = np.ones((2, 3), np.float32)
    for op, field, text in (("t_shape", "shape", r"shape rule says \(2, 3\)"), ("t_dtype", "dtype", "float64"),
                            ("t_raise", "", "ZeroDivisionError"), ("t_missing", "outputs", "no output 'out'")):
        with pytest.raises(KernelRuntimeError, match=text) as e:
            _run(op, x)
        assert (e.value.op, e.value.step, e.value.field) == (op, 0, field)


def test_an_op_without_the_backends_implementation_is_refused_at_plan_time(fresh: list[str]) -> None:
    register_op(_spec("t_gpu_only", numpy=None, cupy=_relu))
    fresh.append("t_gpu_only")
    with pytest.raises(KernelInputError, match="has no numpy implementation") as e:
        _run("t_gpu_only", np.ones(3, np.float32))
    assert e.value.field == "op"


def test_a_shape_rule_that_returns_garbage_is_an_input_error_naming_it(fresh: list[str]) -> None:
    register_op(_spec("t_rule", infer=lambda i, a: {"nope": i["x"]}))
    fresh.append("t_rule")
    with pytest.raises(KernelInputError, match="shape rule of op 't_rule'") as e:
        _run("t_rule", np.ones(3, np.float32))
    assert e.value.field == "infer"


def test_a_mutating_op_must_be_bound_to_a_resident_tensor(fresh: list[str]) -> None:
    def rule(i: Any, a: Any) -> dict[str, TensorSpec]:
        return {"out": i["x"]}

    def bump(c: OpCall) -> dict[str, Any]:
        c.inputs["acc"] += c.inputs["x"]
        return {"out": c.inputs["acc"].copy()}

    register_op(OpSpec("t_acc", inputs=("x", "acc"), outputs=("out",), infer=rule, numpy=bump, mutates=("acc",)))
    fresh.append("t_acc")
    be = select_backend("numpy")
    spec = TensorSpec((3,), "float32")
    with pytest.raises(KernelInputError, match="must be bound to one of your resident tensors"):
        be.plan([StepSpec("t_acc", {"x": "x", "acc": "a"}, {"out": "y"})], {"x": spec, "a": spec}, ["y"])
    be.put("1/acc", np.zeros(3, np.float32), "float32")
    plan = be.plan([StepSpec("t_acc", {"x": "x", "acc": "a"}, {"out": "y"})], {"x": spec, "a": spec}, ["y"],
                   resident={"a": "1/acc"})
    out = np.empty(3, np.float32)
    for _ in range(3):
        be.run(plan, {"x": np.ones(3, np.float32)}, {"y": out})
    np.testing.assert_array_equal(out, 3.0)  # the resident tensor kept the updates


def test_parity_helper_checks_against_a_reference_and_reports_skips(fresh: list[str]) -> None:
    register_op(_spec("t_relu2", tolerances={"float32": (0.0, 0.0), "float64": (0.0, 0.0)}))
    fresh.append("t_relu2")
    rep = check_parity("t_relu2", shapes=[{"x": (4, 8)}, {"x": (1000,)}],
                       reference=lambda f, a: {"out": np.maximum(f["x"], 0)})
    assert len(rep.compared) == 4 and rep.skipped == {"cupy": "op 't_relu2' has no cupy implementation"}
    with pytest.raises(ParityError, match=r"numpy t_relu2\[float32\].*vs reference"):
        check_parity("t_relu2", dtypes=["float32"], reference=lambda f, a: {"out": f["x"]})


def test_parity_helper_lists_cases_the_rule_refuses(fresh: list[str]) -> None:
    register_op(_spec("t_relu3"))
    fresh.append("t_relu3")
    rep = check_parity("t_relu3", dtypes=["float32", "int32"], reference=lambda f, a: {"out": np.maximum(f["x"], 0)})
    assert len(rep.compared) == 1 and len(rep.refused) == 1 and "int32" in rep.refused[0]


def test_a_users_op_that_writes_into_an_input_fails_and_changes_nothing(fresh: list[str]) -> None:
    """Inputs not named in ``mutates`` are read-only to a users' op on the NumPy backend: one that writes into one (a
    request input, an earlier step's output, a resident tensor) fails with its own error, and the tensor is as it
    was. Built-in ops are not concerned."""
    def scribble(c: OpCall) -> dict[str, Any]:
        c.inputs["x"][...] = 42
        return {"out": c.inputs["x"].copy()}

    register_op(_spec("t_scribble", numpy=scribble))
    fresh.append("t_scribble")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    before = x.copy()
    with pytest.raises(KernelRuntimeError, match="wrote into one of its inputs.*mutates") as e:
        _run("t_scribble", x)
    assert (e.value.op, e.value.step, e.value.field) == ("t_scribble", 0, "inputs")
    np.testing.assert_array_equal(x, before)

    be = select_backend("numpy")
    spec = TensorSpec((2, 3), "float32")
    be.put("shared/w", before, "float32")
    plan = be.plan([StepSpec("t_scribble", {"x": "w"}, {"out": "y"})], {"w": spec}, ["y"], resident={"w": "shared/w"})
    with pytest.raises(KernelRuntimeError, match="wrote into one of its inputs"):
        be.run(plan, {}, {"y": np.empty((2, 3), np.float32)})
    # a pipeline: step 0's output read by the op and then by step 2
    steps = [StepSpec("scale", {"x": "x"}, {"out": "s"}, {"a": 1.0}), StepSpec("t_scribble", {"x": "s"}, {"out": "t"}),
             StepSpec("vector_add", {"x": "s", "y": "s"}, {"out": "y"})]
    plan2 = be.plan(steps, {"x": spec}, ["y"])
    with pytest.raises(KernelRuntimeError, match="wrote into one of its inputs") as e:
        be.run(plan2, {"x": x}, {"y": np.empty((2, 3), np.float32)})
    assert e.value.step == 1
    got = {}
    for name in ("shared/w",):
        plan3 = be.plan([StepSpec("echo", {"x": "w"}, {"out": "y"})], {"w": spec}, ["y"], resident={"w": name})
        got[name] = np.empty((2, 3), np.float32)
        be.run(plan3, {}, {"y": got[name]})
    np.testing.assert_array_equal(got["shared/w"], before)
    # the bound path (the worker's steady one) refuses it too
    run = be.bind(be.plan([StepSpec("t_scribble", {"x": "x"}, {"out": "y"})], {"x": spec}, ["y"]), {"x": x},
                  {"y": np.empty((2, 3), np.float32)})
    with pytest.raises(KernelRuntimeError, match="wrote into one of its inputs"):
        run()
    np.testing.assert_array_equal(x, before)


def test_parity_helper_finds_an_op_that_changes_its_input_and_says_when_it_compares_exactly(
        fresh: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The NumPy run refuses the write itself; a backend whose arrays cannot be read-only (CuPy's) is caught by the
    inputs the helper's request returns after the op (the read-only views turned off here to stand for it)."""
    from shmrpc.kernels import _backend_numpy

    def halve(c: OpCall) -> dict[str, Any]:
        c.inputs["x"] /= 2
        return {"out": c.inputs["x"].copy()}

    register_op(_spec("t_halve", numpy=halve, tolerances={}))
    fresh.append("t_halve")
    with pytest.raises(KernelRuntimeError, match="wrote into one of its inputs"):
        check_parity("t_halve", dtypes=["float32"])
    monkeypatch.setattr(_backend_numpy, "_read_only", lambda st, ins: ins)
    with pytest.raises(ParityError, match=r"t_halve \(numpy\) changed its input 'x'.*mutates"):
        check_parity("t_halve", dtypes=["float32"])
    register_op(_spec("t_relu4", tolerances={}))
    fresh.append("t_relu4")
    rep = check_parity("t_relu4", dtypes=["float32"])
    assert rep.compared == ["t_relu4[float32] {'x': (4, 8)} (compared exactly: the op's tolerances give none "
                            "for float32)"]


def test_a_shape_rule_that_raises_is_the_requests_input_error_naming_op_and_module(fresh: list[str]) -> None:
    def rule(i: Any, a: Any) -> dict[str, TensorSpec]:
        raise RuntimeError("bug in my shape rule")

    register_op(_spec("t_rule_raises", infer=rule))
    fresh.append("t_rule_raises")
    with pytest.raises(KernelInputError, match=r"shape rule of op 't_rule_raises' raised RuntimeError: bug in my "
                                               rf"shape rule \(a bug in the op's module '{__name__}'\)") as e:
        _run("t_rule_raises", np.ones(3, np.float32))
    assert (e.value.op, e.value.step, e.value.field) == ("t_rule_raises", 0, "infer")


def test_an_op_that_exits_or_returns_a_list_is_its_steps_runtime_error(fresh: list[str]) -> None:
    def leave(c: OpCall) -> dict[str, Any]:
        raise SystemExit(5)

    register_op(_spec("t_exit", numpy=leave))
    register_op(_spec("t_list", numpy=lambda c: {"out": c.inputs["x"].tolist()}))
    fresh.extend(["t_exit", "t_list"])
    with pytest.raises(KernelRuntimeError, match="op 't_exit' failed: SystemExit: 5") as e:
        _run("t_exit", np.ones(3, np.float32))
    assert (e.value.op, e.value.step) == ("t_exit", 0)
    with pytest.raises(KernelRuntimeError, match="returned output 'out' as a list, not an array") as e:
        _run("t_list", np.ones(3, np.float32))
    assert (e.value.op, e.value.tensor, e.value.field) == ("t_list", "out", "outputs")


def test_a_failed_warm_up_names_the_op_its_module_and_the_warm_up(fresh: list[str]) -> None:
    register_op(_spec("t_warm", numpy=lambda c: 1 / 0))
    fresh.append("t_warm")
    with pytest.raises(KernelRuntimeError, match=rf"op 't_warm' \(module {__name__}\) failed its warm-up run on its "
                                                 r"`example` inputs: op 't_warm' failed: ZeroDivisionError") as e:
        select_backend("numpy").warmup()
    assert str(e.value).count("op='t_warm'") == 1, e.value  # the op's place said once, at the end


class _LibraryStop(BaseException):
    """A library's own BaseException."""


@pytest.mark.parametrize("exc", [SystemExit("gave up"), GeneratorExit(), _LibraryStop("stop"),
                                 __import__("asyncio").CancelledError()], ids=lambda e: type(e).__name__)
def test_a_base_exception_in_a_rule_or_an_op_is_the_requests_error(fresh: list[str], exc: BaseException) -> None:
    """sys.exit() or any other BaseException raised by a users' op's shape rule or body is its step's error naming
    the op (field "infer" for the rule), not something that ends the caller's thread."""
    def rule(i: Any, a: Any) -> dict[str, TensorSpec]:
        raise exc

    def body(c: OpCall) -> dict[str, Any]:
        raise exc

    register_op(_spec("t_rule_base", infer=rule, example={}))
    register_op(_spec("t_body_base", numpy=body, example={}))
    fresh.extend(["t_rule_base", "t_body_base"])
    with pytest.raises(KernelInputError, match=rf"shape rule of op 't_rule_base' raised {type(exc).__name__}") as e:
        _run("t_rule_base", np.ones(3, np.float32))
    assert (e.value.op, e.value.step, e.value.field) == ("t_rule_base", 0, "infer")
    with pytest.raises(KernelRuntimeError, match=rf"op 't_body_base' failed: {type(exc).__name__}") as e:
        _run("t_body_base", np.ones(3, np.float32))
    assert (e.value.op, e.value.step) == ("t_body_base", 0)


def test_a_keyboard_interrupt_is_the_ops_error_only_where_sigint_is_not_pythons_default(
        fresh: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """In a caller's own process (SIGINT with Python's default handler) a KeyboardInterrupt may be a real Ctrl-C and
    goes through; under a worker's own SIGINT handler it can only be the op's, and fails its request."""
    import signal

    from shmrpc.kernels._errors import is_op_failure

    def body(c: OpCall) -> dict[str, Any]:
        raise KeyboardInterrupt

    register_op(_spec("t_body_kbd", numpy=body, example={}))
    fresh.append("t_body_kbd")
    monkeypatch.setattr(signal, "getsignal", lambda sig: signal.default_int_handler)
    assert not is_op_failure(KeyboardInterrupt()) and is_op_failure(SystemExit()) and is_op_failure(ValueError())
    with pytest.raises(KeyboardInterrupt):
        _run("t_body_kbd", np.ones(3, np.float32))
    monkeypatch.setattr(signal, "getsignal", lambda sig: (lambda *_: None))  # a worker's handler
    assert is_op_failure(KeyboardInterrupt())
    with pytest.raises(KernelRuntimeError, match="op 't_body_kbd' failed: KeyboardInterrupt"):
        _run("t_body_kbd", np.ones(3, np.float32))


def test_a_warm_up_whose_rule_exits_names_the_op_and_the_warm_up(fresh: list[str]) -> None:
    def rule(i: Any, a: Any) -> dict[str, TensorSpec]:
        raise SystemExit("no")

    register_op(_spec("t_warm_rule", infer=rule))
    fresh.append("t_warm_rule")
    with pytest.raises(KernelInputError, match=rf"op 't_warm_rule' \(module {__name__}\) failed its warm-up run on its "
                                               r"`example` inputs: the shape rule of op 't_warm_rule' raised "
                                               r"SystemExit: no"):
        select_backend("numpy").warmup()


def test_a_users_op_reusing_a_builtin_implementation_is_a_users_op(fresh: list[str]) -> None:
    """Built-in-ness follows where register_op is called from, not the implementation's module: an op defined here
    with gelu's rule and implementation gets a users' code (derived or explicit) and this module's name."""
    gelu = REGISTRY["gelu"]
    spec = register_op(OpSpec("t_my_gelu", inputs=("x",), outputs=("out",), infer=gelu.infer, numpy=gelu.numpy))
    fresh.append("t_my_gelu")
    assert spec.code == user_code("t_my_gelu") and not spec.builtin and spec.module == __name__
    spec2 = register_op(OpSpec("t_my_gelu2", code=0x5000, inputs=("x",), outputs=("out",), infer=gelu.infer,
                               numpy=gelu.numpy))
    fresh.append("t_my_gelu2")
    assert spec2.code == 0x5000 and not spec2.builtin
    with pytest.raises(OpSpecError, match="code 12 is outside the users' range"):
        register_op(OpSpec("t_my_gelu3", code=12, inputs=("x",), outputs=("out",), infer=gelu.infer, numpy=gelu.numpy))
    x = np.linspace(-3, 3, 16, dtype=np.float32)
    be = select_backend("numpy")
    want = np.empty_like(x)
    be.run(be.plan([StepSpec("gelu", {"x": "x"}, {"out": "y"})], {"x": TensorSpec(x.shape, "float32")}, ["y"]),
           {"x": x}, {"y": want})
    np.testing.assert_array_equal(_run("t_my_gelu", x), want)


@pytest.mark.parametrize("name", ["self", "op", "copy", "_copy", "timeout_s", "out_nbytes", "in_place", "keep", "inputs",
                                  "outputs"])
def test_the_clients_own_keywords_are_no_inputs_outputs_or_attributes(fresh: list[str], name: str) -> None:
    """Every keyword of Client.call / submit / Loan.send / Pipeline.then other than the op's inputs and attributes is
    the client's own option: an op attribute (or input, or output) named like one would be taken by call() and
    passed to the op by submit(), so register_op refuses it naming the attribute."""
    from shmrpc.kernels.api import RESERVED_NAMES

    assert name in RESERVED_NAMES
    for kw, what in (({"attrs": {name: AttrSpec("float", 1.0)}}, "attribute"),
                     ({"inputs": (name,), "example": {}, "infer": lambda i, a: {"out": i[name]}}, "input"),
                     ({"outputs": (name,)}, "output")):
        with pytest.raises(OpSpecError, match=rf"^op 't_kw': {what} '{name}' is named like a keyword of the client's "
                                              "own"):
            register_op(_spec("t_kw", **kw))
        assert "t_kw" not in REGISTRY


@pytest.mark.parametrize("name", ["pipeline", "put", "unknown"])
def test_an_op_named_like_a_metrics_label_of_the_worker_is_refused(fresh: list[str], name: str) -> None:
    """The worker's metrics count requests by op name, and under these for requests of several steps, uploads and
    requests refused before their op was known: an op of that name would be counted with them."""
    from shmrpc.kernels.api import RESERVED_OP_NAMES

    assert name in RESERVED_OP_NAMES
    with pytest.raises(OpSpecError, match=rf"^op '{name}': the worker's metrics count requests of another kind under "
                                          rf"'{name}' \(names no op may have: pipeline, put, unknown\)"):
        register_op(_spec(name))
    assert name not in REGISTRY
    register_op(_spec(f"t_{name}"))  # only the names themselves
    fresh.append(f"t_{name}")
