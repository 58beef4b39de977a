"""The worker's hot path in pieces: grouping a turn's requests by plan, a batch's per-request results and errors,
the header check on plain tuples, and the plain-number metrics (in-flight gauge, batch sizes) as scraped."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from shmrpc import kernels
from shmrpc.kernels import StepSpec, TensorSpec
from shmrpc.schema.errors import InternalError, InvalidRequestError, KernelError, StaleSlotError
from shmrpc.schema.header import HEADER, Header
from shmrpc.server import metrics as metrics_mod
from shmrpc.server._batch import Pending, group_by_plan
from shmrpc.server._dispatch import Dispatcher, check_header, resident_name
from shmrpc.server.metrics import Metrics


def _plan(backend: Any, n: int = 4, a: float = 2.0) -> kernels.Plan:
    return backend.plan([StepSpec("scale", {"x": "x"}, {"out": "out"}, {"a": a})],
                        {"x": TensorSpec((n,), "float32")}, ["out"])


def _pending(plan: kernels.Plan, tag: int) -> Pending:
    prep = SimpleNamespace(plan=plan, desc=SimpleNamespace(steps=[SimpleNamespace(op="scale")]))
    return Pending(b"id", SimpleNamespace(tag=tag), memoryview(b""), (tag, 0, 1), SimpleNamespace(prep=prep),  # type: ignore[arg-type]
                   0.0, 0)


def test_requests_group_by_equal_plans_in_arrival_order_and_up_to_max_batch() -> None:
    with kernels.select_backend("numpy") as be:
        p4, p4_again, p8, p4_other_attr = _plan(be), _plan(be), _plan(be, 8), _plan(be, a=3.0)
        assert p4 is not p4_again and p4 == p4_again  # two clients' requests: two plan objects, one plan
        items = [_pending(p, i) for i, p in enumerate([p4, p8, p4_again, p4_other_attr, p4, p4, p8])]
        groups = group_by_plan(items, max_batch=3)
        assert [[p.slot.tag for p in g] for g in groups] == [[0, 2, 4], [1, 6], [3], [5]]  # type: ignore[attr-defined]
        assert [[p.slot.tag for p in g] for g in group_by_plan(items, 64)] == [[0, 2, 4, 5], [1, 6], [3]]  # type: ignore[attr-defined]
        assert all(len(g) == 1 for g in group_by_plan(items, 1))
        assert group_by_plan([], 64) == []


class _Scripted(kernels.Backend):
    """A backend whose run_batch answers what the test says."""

    name = "numpy"

    def __init__(self, answer: Any) -> None:
        super().__init__()
        self.answer = answer

    def run_batch(self, plan: Any, items: Any) -> Any:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def test_a_batch_returns_each_requests_own_result_or_typed_error() -> None:
    with kernels.select_backend("numpy") as np_be:
        plan = _plan(np_be)
    items: list[Any] = [(_pending(plan, i).primed.prep, ({}, {})) for i in range(4)]
    d = Dispatcher(_Scripted([{"kernel": 1e-6}, kernels.KernelRuntimeError("boom", op="scale", step=0, tensor="x"),
                              ValueError("a bug"), {}]), desc_nbytes=1024)
    ok, kerr, bug, empty = d.run_batch(plan, items)
    assert ok == {"kernel": 1e-6} and empty == {}
    assert isinstance(kerr, KernelError) and (kerr.op, kerr.step, kerr.tensor) == ("scale", 0, "x")
    assert isinstance(bug, InternalError) and "a bug" in bug.message
    assert not d.fatal
    d = Dispatcher(_Scripted([kernels.KernelFatalError("sticky", op="scale"), {}, {}, {}]), desc_nbytes=1024)
    first = d.run_batch(plan, items)[0]
    assert isinstance(first, KernelError) and d.fatal.startswith("sticky")
    broken: Any
    for broken in (RuntimeError("backend bug"), [{}]):  # raises, or answers for fewer requests than it got
        d = Dispatcher(_Scripted(broken), desc_nbytes=1024)
        assert all(isinstance(r, InternalError) for r in d.run_batch(plan, items))


def test_the_default_run_batch_computes_each_request() -> None:
    with kernels.select_backend("numpy") as be:
        plan = _plan(be)
        d = Dispatcher(be, desc_nbytes=1024)
        xs = [np.arange(4, dtype=np.float32) + i for i in range(3)]
        outs = [np.zeros(4, np.float32) for _ in xs]
        prep = _pending(plan, 0).primed.prep
        res = d.run_batch(plan, [(prep, ({"x": x}, {"out": o})) for x, o in zip(xs, outs)])
        assert all(isinstance(r, dict) for r in res)
        for x, o in zip(xs, outs):
            np.testing.assert_array_equal(o, 2 * x)


def test_check_header_takes_the_plain_tuple_and_the_named_one() -> None:
    raw = HEADER.unpack_from(HEADER.pack(7, 2, 100, 0, 3))
    for h in (raw, Header(*raw)):
        check_header(h, 7, 3, 1024)
        with pytest.raises(InvalidRequestError) as e:
            check_header(h, 8, 3, 1024)
        assert e.value.field == "request_id"
        with pytest.raises(StaleSlotError) as e2:
            check_header(h, 7, 4, 1024)
        assert e2.value.field == "generation"
    with pytest.raises(InvalidRequestError) as e3:
        check_header(HEADER.unpack_from(HEADER.pack(7, 2, 0, 0, 3)), 7, 3, 1024)
    assert e3.value.field == "payload_length"


def _families(m: Metrics) -> dict[str, float]:
    return {f"{s.name}{sorted(s.labels.items())}": s.value for fam in m.registry.collect() for s in fam.samples}


def test_in_flight_and_batch_sizes_are_exported() -> None:
    m = Metrics()
    m.inflight.inc()
    m.inflight.inc()
    m.inflight.dec()
    m.observe_batch("scale", 6)
    m.observe_batch("scale", 2)
    got = _families(m)
    assert got["shmrpc_requests_in_flight[]"] == 1
    assert got["shmrpc_batch_size_count[('op', 'scale')]"] == 2
    assert got["shmrpc_batch_size_sum[('op', 'scale')]"] == 8
    assert got["shmrpc_batch_size_bucket[('le', '2.0'), ('op', 'scale')]"] == 1
    assert got["shmrpc_batch_size_bucket[('le', '8.0'), ('op', 'scale')]"] == 2
    assert m.snapshot()["inflight"] == 1


def test_budgets_set_after_requests_apply_to_their_ops() -> None:
    m = Metrics()
    m.observe("scale", "ok", 0.5, 0, 0)
    m.set_budgets(0.1, {})
    m.observe("scale", "ok", 0.5, 0, 0, {"kernel": 0.4, "total": 0.45})
    m.observe("scale", "ok", 0.05, 0, 0)
    assert m.snapshot()["over_budget"] == {"scale": 1}


def test_a_bound_run_is_made_once_and_its_errors_map_as_runs_do() -> None:
    with kernels.select_backend("numpy") as be:
        plan = _plan(be)
        d = Dispatcher(be, desc_nbytes=1024)
        prep: Any = _pending(plan, 0).primed.prep
        prep.keep_as = {}
        x, out = np.arange(4, dtype=np.float32), np.zeros(4, np.float32)
        bound = d.bind(prep, ({"x": x}, {"out": out}))
        assert bound is not None
        assert d.run_bound(prep, bound)["total"] >= 0.0
        np.testing.assert_array_equal(out, 2 * np.arange(4))
        x += 1  # the slot's contents change between two requests; the views do not
        d.run_bound(prep, bound)
        np.testing.assert_array_equal(out, 2 * np.arange(1, 5))
        assert d.bind(SimpleNamespace(plan=None), ({}, {})) is None  # type: ignore[arg-type]
        assert d.run_bound(prep, None) == {}

    def raising(e: Exception) -> Any:
        def bound() -> dict[str, float]:
            raise e
        return bound

    d = Dispatcher(_Scripted([]), desc_nbytes=1024)
    for exc, cls in ((kernels.KernelRuntimeError("boom", op="scale", step=0, tensor="x"), KernelError),
                     (kernels.KernelInputError("gone", tensor="w", field="resident"), KernelError),
                     (ValueError("a bug"), InternalError)):
        with pytest.raises(cls) as ei:
            d.run_bound(prep, raising(exc))
        assert ei.value.op == "scale"
    assert not d.fatal
    with pytest.raises(KernelError):
        d.run_bound(prep, raising(kernels.KernelFatalError("sticky", op="scale")))
    assert d.fatal.startswith("sticky")


@pytest.mark.timeout(60)
def test_a_worker_serving_repeated_requests_uses_the_resident_of_the_time(worker_name: str) -> None:
    """Real worker process: the same request again (a primed slot, a bound run) sees a replaced or dropped resident."""
    import signal
    import subprocess
    import sys

    from shmrpc.client import Client, Resident
    from shmrpc.schema.errors import RequestError

    args = [sys.executable, "-m", "shmrpc.server", "serve", "--name", worker_name, "--slots", "64K:4", "--lease", "1",
            "--backend", "numpy", "--no-mlock", "--log-level", "WARNING"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        x = np.arange(4, dtype=np.float32)
        with Client(worker_name, timeout_s=10) as c:  # one slot leased: every call goes through the same slot
            c.put("w", np.full(4, 1.0, np.float32))
            for _ in range(3):
                np.testing.assert_array_equal(c.call("vector_add", x=x, y=Resident("w"))["out"], x + 1.0)
            c.put("w", np.full(4, 10.0, np.float32))
            for _ in range(2):
                np.testing.assert_array_equal(c.call("vector_add", x=x, y=Resident("w"))["out"], x + 10.0)
            c.drop("w")
            with pytest.raises(RequestError):
                c.call("vector_add", x=x, y=Resident("w"))
            np.testing.assert_array_equal(c.call("vector_add", x=x, y=x)["out"], 2 * x)  # the worker goes on
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err


def test_equal_batchable_plans_of_several_clients_are_one_object() -> None:
    from shmrpc.schema.descriptor import RequestDesc, StepDesc, TensorRef, encode_request

    def desc(n: int, resident: str = "") -> bytes:
        x = TensorRef("x", "float32", (n,), 1024, 4 * n)
        y = TensorRef("y", "float32", (n,), 0, 0, resident) if resident else TensorRef("y", "float32", (n,), 2048, 4 * n)
        return encode_request(RequestDesc((StepDesc("vector_add", 0, (("x", "x"), ("y", "y")), (("out", "out"),), ()),),
                                          (x, y), ("out",)))

    d = Dispatcher(kernels.select_backend("numpy"), desc_nbytes=1024)
    a, b = d.prepare(desc(16), 0, 0, 4096, client=1), d.prepare(desc(16), 0, 0, 4096, client=2)
    assert a is not b and a.batch and a.plan is b.plan  # two clients, one plan object: grouped by identity
    c = d.prepare(desc(32), 0, 0, 4096, client=2)
    assert c.plan is not a.plan and c.plan != a.plan
    # a client's own resident tensor is in its plan: another client's equal-looking request never shares it
    for client in (1, 2):
        d.backend.put(resident_name(client, "w"), np.zeros(16, np.float32), "float32")
    r1, r2 = d.prepare(desc(16, "w"), 0, 0, 4096, client=1), d.prepare(desc(16, "w"), 0, 0, 4096, client=2)
    assert r1.plan is not None and r2.plan is not None and r1.plan != r2.plan and r1.plan is not r2.plan


def test_a_resident_input_is_checked_against_its_tensor_before_the_ops_rules() -> None:
    # the spec a request states for a resident input is the tensor's own, or the request is refused over the resident
    # (field "resident", the input named), before vector_add's rule would refuse the stated shape against x's
    from shmrpc.schema.descriptor import RequestDesc, StepDesc, TensorRef, encode_request

    def desc(n: int, dtype: str = "float32") -> bytes:
        x = TensorRef("x", "float32", (8,), 1024, 32)
        y = TensorRef("y", dtype, (n,), 0, 0, "w")
        return encode_request(RequestDesc((StepDesc("vector_add", 0, (("x", "x"), ("y", "y")), (("out", "out"),), ()),),
                                          (x, y), ("out",)))

    d = Dispatcher(kernels.select_backend("numpy"), desc_nbytes=1024)
    for stated, dtype, why in ((8, "float32", "does not exist"), (4, "float32", "float32 (8,); the request says float32 (4,)"),
                               (8, "float64", "float32 (8,); the request says float64 (8,)")):
        if stated == 4:
            d.backend.put(resident_name(3, "w"), np.zeros(8, np.float32), "float32")
        with pytest.raises(KernelError) as e:
            d.prepare(desc(stated, dtype), 0, 0, 4096, client=3)
        assert (e.value.field, e.value.tensor, e.value.op) == ("resident", "y", "vector_add") and why in str(e.value)
        assert "3/" not in str(e.value)  # the client's own name, not the worker's
    assert d.prepare(desc(8), 0, 0, 4096, client=3).resident == {"y": resident_name(3, "w")}
    with pytest.raises(KernelError) as e:  # another client's tensor of that name is not this one's
        d.prepare(desc(8), 0, 0, 4096, client=4)
    assert e.value.field == "resident"


def test_observations_wait_in_a_queue_until_the_loop_or_a_scrape_folds_them() -> None:
    m = Metrics()
    m.observe("scale", "ok", 0.001, 8, 4, {"kernel": 0.0005, "total": 0.0006})
    assert m._stats.ops == {}  # queued: the request's own answer did not pay for the histograms
    m.fold()
    assert m._stats.ops["scale"].status == {"ok": 1} and not m._stats.queued
    m.observe("scale", "KernelError", 0.002, 0, 0)
    snap = m.snapshot()  # a scrape folds first: every request answered before it is in it
    assert snap["requests"] == {"scale": {"ok": 1, "KernelError": 1}}
    assert (snap["bytes_in"], snap["bytes_out"]) == (8, 4)
    assert _families(m)["shmrpc_stage_seconds_count[('op', 'scale'), ('stage', 'kernel')]"] == 1


def test_observations_never_folded_by_the_loop_fold_once_the_queue_is_long() -> None:
    m = Metrics()
    for _ in range(metrics_mod._FOLD_AT - 1):
        m.observe("scale", "ok", 0.001, 0, 0)
    assert len(m._stats.queued) == metrics_mod._FOLD_AT - 1
    m.observe("scale", "ok", 0.001, 0, 0)
    assert not m._stats.queued and m._stats.ops["scale"].status == {"ok": metrics_mod._FOLD_AT}


def test_a_few_observations_folded_at_a_time() -> None:
    # the spinning loop folds TRICKLE observations at a time while no request waits: the first ones, and only them
    m = Metrics()
    for i in range(5):
        m.observe("scale", "ok", 0.001 * (i + 1), i, 0, {"kernel": 0.0005})
    m.fold_few()
    assert len(m._stats.queued) == 5 - metrics_mod.TRICKLE
    assert m._stats.ops["scale"].status == {"ok": metrics_mod.TRICKLE}
    assert m._stats.bytes_in == sum(range(metrics_mod.TRICKLE))
    m.fold_few(100)
    assert not m._stats.queued and m._stats.ops["scale"].status == {"ok": 5} and m._stats.bytes_in == 10
    m.fold_few()  # nothing queued: nothing to do
    assert m._stats.ops["scale"].duration.sum == pytest.approx(0.015)


def test_scrapes_on_another_thread_lose_and_double_no_observation() -> None:
    # the loop observes (and folds) while scrapes fold on their own thread: every request is counted once
    m = Metrics()
    n, stop = 30_000, threading.Event()
    seen: list[float] = []

    def scrape() -> None:
        while not stop.is_set():
            seen.append(_families(m).get("shmrpc_requests_total[('op', 'scale'), ('status', 'ok')]", 0.0))

    t = threading.Thread(target=scrape)
    t.start()
    try:
        for i in range(n):
            m.observe("scale", "ok", 1e-6, 1, 2, {"kernel": 1e-6})
            if i % 97 == 0:
                m.fold()
    finally:
        stop.set()
        t.join(10)
    assert seen and seen == sorted(seen)  # never a count that goes back
    got = _families(m)
    assert got["shmrpc_requests_total[('op', 'scale'), ('status', 'ok')]"] == n
    assert got["shmrpc_request_duration_seconds_count[('op', 'scale')]"] == n
    assert got["shmrpc_stage_seconds_count[('op', 'scale'), ('stage', 'kernel')]"] == n
    assert (got["shmrpc_bytes_in_total[]"], got["shmrpc_bytes_out_total[]"]) == (n, 2 * n)


def _scale_payload(a: float, n: int = 4) -> bytes:
    from shmrpc.schema.descriptor import RequestDesc, StepDesc, TensorRef, encode_request

    return encode_request(RequestDesc((StepDesc("scale", 0, (("x", "x"),), (("out", "out"),), (("a", a),)),),
                                      (TensorRef("x", "float32", (n,), 1024, 4 * n),), ("out",)))


def test_requests_differing_in_an_attribute_value_share_their_response_bytes_but_not_their_plan() -> None:
    """Equal plans of two clients are one object (the batch grouping finds them by identity); a plan of another
    attribute value is another object, whatever was made before; the response bytes, which say only where the
    outputs are, are shared by requests that place the same outputs and are each request's own otherwise."""
    from shmrpc.schema.descriptor import decode_response

    with kernels.select_backend("numpy") as be:
        d = Dispatcher(be, desc_nbytes=1024)
        two, three = d.prepare(_scale_payload(2.0), 0, 0, 4096, 1), d.prepare(_scale_payload(3.0), 0, 0, 4096, 1)
        two_again = d.prepare(_scale_payload(2.0), 0, 0, 4096, 2)  # another client: another cache entry
        assert two is not two_again and two.plan is two_again.plan
        assert three.plan is not two.plan and three.plan != two.plan
        assert three.response is two.response and decode_response(two.response).outputs == two.outputs
        eight = d.prepare(_scale_payload(2.0, 8), 0, 0, 4096, 1)
        assert eight.response != two.response and decode_response(eight.response).outputs == eight.outputs
        for prep, a, n in ((two, 2.0, 4), (three, 3.0, 4), (two_again, 2.0, 4), (eight, 2.0, 8)):
            slot = memoryview(bytearray(4096))
            views = d.views(prep, slot)
            views[0]["x"][...] = np.arange(n, dtype=np.float32)
            d.run(prep, slot, views)
            np.testing.assert_array_equal(views[1]["out"], a * np.arange(n, dtype=np.float32))
