"""``Client.call``'s steady path (a plan per call signature): results stay right whatever changes between calls."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import pytest

from shmrpc.client import AsyncClient, Client, InvalidRequestError, KernelError, Pipeline, Resident
from shmrpc.client._callplan import read_outputs, steady_key
from shmrpc.schema.descriptor import ResponseDesc, TensorRef
from shmrpc.schema.errors import RequestError

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def test_a_repeated_signature_carries_each_calls_own_values(worker: WorkerProc) -> None:
    rng = np.random.default_rng(12)
    with Client(worker.name, timeout_s=10) as c:
        for _ in range(5):  # same op, shapes, dtypes: one plan, new bytes every time
            x, y = rng.standard_normal((2, 16)).astype(np.float32)
            np.testing.assert_array_equal(c.call("vector_add", x=x, y=y)["out"], x + y)
        for shape, dt in (((3, 5), np.float32), ((16,), np.float64), ((7,), np.int32), ((0,), np.float32)):
            x = rng.integers(-9, 9, shape).astype(dt)
            np.testing.assert_array_equal(c.call("vector_add", x=x, y=x)["out"], x + x)
        x = np.arange(8, dtype=np.float32)
        for a, b in ((2.0, 1.0), (0.5, 0.0), (2.0, 1.0)):
            np.testing.assert_allclose(c.call("scale", x=x, a=a, b=b)["out"], a * x + b)
        out = c.call("vector_add", x=x, y=x, in_place=True)["out"]
        np.testing.assert_array_equal(out, 2 * x)
        np.testing.assert_array_equal(x, np.arange(8, dtype=np.float32))  # the caller's array is never written


def test_signatures_taking_turns_each_copy_their_own_inputs(worker: WorkerProc) -> None:
    # the kept loan holds input views per plan (at most 16, then it starts again): twenty signatures in turn, each
    # call's own values, the views of one plan never used for another's shape or dtype
    rng = np.random.default_rng(5)
    sigs = [((n,), dt) for n in (1, 3, 8, 16, 33) for dt in (np.float32, np.float64, np.int32, np.int16)]
    assert len(sigs) == 20
    with Client(worker.name, timeout_s=10) as c:
        for _ in range(3):
            for shape, dt in sigs:
                x, y = rng.integers(-99, 99, (2, *shape)).astype(dt)
                np.testing.assert_array_equal(c.call("vector_add", x=x, y=y)["out"], x + y)
                np.testing.assert_allclose(c.call("scale", x=x.astype(np.float32), a=0.5)["out"], 0.5 * x)
        assert c._kept and 0 < len(c._kept[0]._in_views) <= 16


def test_attribute_types_are_part_of_the_signature(worker: WorkerProc) -> None:
    # 1 == 1.0 == True in Python, but they travel as different attribute types: each gets its own plan
    keys = [steady_key("scale", {"a": a}, False, (), None) for a in (1, 1.0, True)]
    assert all(k is not None for k in keys) and len({k[0] for k in keys if k is not None}) == 3
    assert Pipeline().then("scale", a=1) != Pipeline().then("scale", a=True)
    assert Pipeline().then("scale", a=2.0) == Pipeline().then("scale", a=2.0)
    x = np.arange(4, dtype=np.float32)
    results = []
    for a in (1, 1.0, True):
        with Client(worker.name, timeout_s=10) as fresh:
            try:
                results.append(("ok", fresh.call("scale", x=x, a=a)["out"].tolist()))
            except RequestError as e:
                results.append(("error", e.field))
    with Client(worker.name, timeout_s=10) as c:  # one client, all three in a row: what fresh clients get
        for a, want in zip((1, 1.0, True, 1), results + results[:1]):
            try:
                got = ("ok", c.call("scale", x=x, a=a)["out"].tolist())
            except RequestError as e:
                got = ("error", e.field)
            assert got == want, a


@pytest.mark.parametrize("value", [None, (1, 2), [1.0], {"a": 1}, b"2"])
def test_an_attribute_that_cannot_travel_is_refused_by_the_client_naming_it(worker: WorkerProc, value: object) -> None:
    # an attribute is a bool, int, float or str: anything else is refused before it is encoded (it went out as an
    # empty string, or raised TypeError from a cache key), on every path, and the client goes on
    x = np.arange(4, dtype=np.float32)
    with Client(worker.name, timeout_s=10) as c:
        calls = [lambda: c.call("scale", x=x, a=value), lambda: c.submit("scale", x=x, a=value).result(10),
                 lambda: Pipeline().then("scale", a=value)]
        with c.loan(4096) as req:
            req.array("x", 4, np.float32)[...] = x
            calls.append(lambda: req.send("scale", a=value))
            for f in calls:
                with pytest.raises(InvalidRequestError) as ei:
                    f()
                assert ei.value.field == "a" and type(value).__name__ in str(ei.value)
            np.testing.assert_allclose(req.send("scale", a=2.0)["out"], 2 * x)
        np.testing.assert_allclose(c.call("scale", x=x, a=3.0)["out"], 3 * x)


def test_inputs_the_steady_path_does_not_take_still_work(worker: WorkerProc) -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    with Client(worker.name, timeout_s=10) as c:
        np.testing.assert_array_equal(c.call("echo", x=[1.0, 2.0, 3.0])["out"], np.array([1.0, 2.0, 3.0]))
        masked = np.ma.masked_array(base, mask=np.zeros_like(base, dtype=bool))  # a subclass: converted first
        np.testing.assert_array_equal(c.call("echo", x=masked)["out"], base)
        np.testing.assert_allclose(c.call("scale", x=base, a=3.0)["out"], 3 * base)
        c.put("w", [[1.0, 2.0], [3.0, 4.0]])  # converted once, then uploaded
        np.testing.assert_array_equal(c.call("vector_add", x=np.ones((2, 2)), y=Resident("w"))["out"],
                                      np.array([[2.0, 3.0], [4.0, 5.0]]))
        with pytest.raises(InvalidRequestError) as ei:
            c.call("echo", x=np.array([object()], dtype=object))
        assert ei.value.field == "dtype" and ei.value.tensor == "x"
        np.testing.assert_array_equal(c.call("echo", x=base)["out"], base)  # the client goes on


def test_inputs_of_any_strides_take_the_steady_path_and_arrive_in_c_order(worker: WorkerProc) -> None:
    # a strided view, a transposed (Fortran-ordered) array, a reversed one and a broadcast one (stride 0) are copied
    # into the slot by the plan's one copy, read in C order: each call's values, and the plan of a contiguous array of
    # the same shape and dtype serves them (no second plan, no conversion first)
    rng = np.random.default_rng(21)
    base = rng.standard_normal((6, 8)).astype(np.float32)
    before = base.copy()
    cases = {
        "strided": base[:, ::2],
        "transposed": base[:4, :6].T,
        "fortran": np.asfortranarray(base[:6, :4]),
        "reversed": base[::-1, 1:5],
        "broadcast": np.broadcast_to(base[0, :4], (6, 4)),
    }
    with Client(worker.name, timeout_s=10) as c:
        for name, a in cases.items():
            assert not a.flags.c_contiguous, name
            want = np.ascontiguousarray(a)
            y = rng.standard_normal(a.shape).astype(np.float32)
            got = c.call("vector_add", x=a, y=y)
            np.testing.assert_array_equal(got["out"], want + y, err_msg=name)
            np.testing.assert_array_equal(c.call("echo", x=a)["out"], want, err_msg=name)
        np.testing.assert_array_equal(c.call("vector_add", x=base[:, :4].copy(), y=base[:, 4:].copy())["out"],
                                      base[:, :4] + base[:, 4:])
        # one plan per signature: (6, 4) float32 twice for vector_add, once for echo, whatever the strides
        vec_keys = [k for k in c._plans if k[0] == "vector_add"]
        echo_keys = [k for k in c._plans if k[0] == "echo"]
        assert len(vec_keys) == 1 and len(echo_keys) == 1, (vec_keys, echo_keys)
        assert vec_keys[0][4:] == ("x", (6, 4), np.dtype(np.float32), "y", (6, 4), np.dtype(np.float32))
        assert c._kept, "the steady path keeps its loan"
        # the general path (a future) takes them as they are too: no contiguous copy first, the same values
        for name, a in cases.items():
            np.testing.assert_array_equal(c.submit("echo", x=a).result()["out"], np.ascontiguousarray(a), err_msg=name)
        for name, a in cases.items():  # a masked array beside it sends the call the general way: the same copy
            y = np.ma.masked_array(a)  # (a subclass: the general path, as a plain view of its data, strides and all)
            got = c.call("vector_add", x=a, y=y)["out"]
            np.testing.assert_array_equal(got, 2 * np.ascontiguousarray(a), err_msg=name)
        c.put("wt", cases["transposed"])
        np.testing.assert_array_equal(c.call("vector_add", x=np.zeros((6, 4), np.float32), y=Resident("wt"))["out"],
                                      np.ascontiguousarray(cases["transposed"]))
        np.testing.assert_array_equal(base, before)  # the caller's arrays are only read


def test_a_0d_array_keeps_its_shape_on_every_path(worker: WorkerProc) -> None:
    # call()'s steady path sent a 0-d array as it is and the general path made it 1-d (np.ascontiguousarray): both
    # keep the shape the caller gave now
    x = np.array(3.0, np.float32)
    with Client(worker.name, timeout_s=10) as c:
        got = [c.call("echo", x=x)["out"], c.submit("echo", x=x).result()["out"], c.call("echo", x=3.0)["out"],
               c.call("scale", x=x, a=2.0)["out"]]
        assert [(g.shape, g.dtype) for g in got] == [((), np.dtype(np.float32))] * 2 + [((), np.dtype(np.float64))] + [
            ((), np.dtype(np.float32))]
        assert [g.item() for g in got] == [3.0, 3.0, 3.0, 6.0]


def test_views_keep_their_slot_and_copies_do_not(worker: WorkerProc) -> None:
    x = np.arange(16, dtype=np.float32)
    with Client(worker.name, timeout_s=10) as c:
        views = [c.call("scale", x=x, a=float(i), copy=False)["out"] for i in range(3)]
        for i, v in enumerate(views):  # three live views: three slots, none overwritten by a later call
            np.testing.assert_array_equal(v, i * x)
        free_with_views = len(c._slots.free)
        del views, v  # the slots go back at the next take
        np.testing.assert_array_equal(c.call("scale", x=x, a=5.0)["out"], 5 * x)
        assert len(c._slots.free) + len(c._kept) >= free_with_views + 3  # (the call keeps its loan for the next)



def test_a_call_keeps_its_loan_for_the_next_call(worker: WorkerProc) -> None:
    """A call() whose outputs were copied out keeps its loan (slot open, output views made) for the next call;
    every call still carries its own values and gets its own answer, whatever its signature."""
    rng = np.random.default_rng(7)
    with Client(worker.name, timeout_s=10) as c:
        x, y = rng.standard_normal((2, 16)).astype(np.float32)
        np.testing.assert_array_equal(c.call("vector_add", x=x, y=y)["out"], x + y)
        assert len(c._kept) == 1
        slot = c._kept[0]._s
        for i in range(4):  # other values, other signatures: the same slot, the right answers
            x, y = rng.standard_normal((2, 8 + i)).astype(np.float32)
            np.testing.assert_array_equal(c.call("vector_add", x=x, y=y)["out"], x + y)
            np.testing.assert_allclose(c.call("scale", x=x, a=float(i))["out"], i * x)
            assert [k._s for k in c._kept] == [slot]
        out = c.call("scale", x=x, a=3.0, copy=False)["out"]  # a view handed out: the loan is not kept
        assert c._kept == [] and out.base is not None
        np.testing.assert_allclose(c.call("scale", x=x, a=5.0)["out"], 5 * x)
        np.testing.assert_allclose(out, 3 * x)  # the view's slot was not the next call's
        with pytest.raises(RequestError) as ei:  # a refused call gives its slot back instead of keeping it
            c.call("vector_add", x=x, y=np.zeros(3, np.float32))
        assert ei.value.field == "shape" and c._kept == []
        np.testing.assert_allclose(c.call("scale", x=x, a=2.0)["out"], 2 * x)
        assert len(c._kept) == 1
    assert c._kept == []  # close gave it back


def test_a_kept_call_slot_serves_other_requests_first(spawn_worker: Callable[..., WorkerProc]) -> None:
    """The kept loan's slot counts as free: a loan, a submit, or a call that fits only there takes it (not a
    slot borrowed from the worker's pool), and a small call does not hold a large slot."""
    w = spawn_worker("--lease-max", "4,1,1,0")
    x = np.arange(16, dtype=np.float32)
    with Client(w.name, timeout_s=10, lease=(1,)) as c:  # one own slot (64 KiB)
        np.testing.assert_array_equal(c.call("scale", x=x, a=2.0)["out"], 2 * x)
        (kept,) = c._kept
        with c.loan(1024) as req:
            assert req._s is kept._s and not req._s.borrowed
            req.array("x", 16, np.float32)[...] = x
            np.testing.assert_array_equal(req.send("scale", a=3.0)["out"], 3 * x)
        np.testing.assert_array_equal(c.call("scale", x=x, a=2.0)["out"], 2 * x)
        fut = c.submit("scale", x=x, a=4.0)
        np.testing.assert_array_equal(fut.result(10)["out"], 4 * x)
        assert fut._loan._s is kept._s and c._kept == [fut._loan]  # kept again by the future, for the next request
    with Client(w.name, timeout_s=10, lease=(1, 1)) as c:  # a 64 KiB and a 1 MiB slot
        big = np.arange(100_000, dtype=np.float32)
        np.testing.assert_array_equal(c.call("scale", x=big, a=2.0)["out"], 2 * big)
        assert c._kept[0]._s.nbytes == 1 << 20
        np.testing.assert_array_equal(c.call("scale", x=x, a=2.0)["out"], 2 * x)
        assert c._kept[0]._s.nbytes == 64 << 10
        assert sorted(s.nbytes for s in c._slots.free) == [1 << 20]


def _resp(*outs: TensorRef) -> ResponseDesc:
    return ResponseDesc(outputs=tuple(outs))


def test_a_response_is_checked_against_the_slot_and_the_outputs_asked() -> None:
    good = TensorRef("out", "float32", (4,), 4096, 16)
    assert read_outputs(_resp(good), ("out",), 8192).outputs[0][1:] == (np.dtype(np.float32), 4, 4096, (4,))
    cases = {
        "outputs": (_resp(good._replace(name="other")), ("out",)),
        "offset": (_resp(good._replace(offset=8190)), ("out",)),
        "shape": (_resp(good._replace(shape=(5,))), ("out",)),
    }
    for field, (resp, asked) in cases.items():
        with pytest.raises(RequestError) as ei:
            read_outputs(resp, asked, 8192)
        assert ei.value.field == field


def test_a_response_rewritten_in_the_slot_is_checked_again(worker: WorkerProc) -> None:
    """A response already checked once is remembered by its bytes: other bytes in the slot (a process writing
    there after the DONE) are a new key, checked in full, and a bad one is a RequestError naming the field."""
    from shmrpc.schema.descriptor import decode_response, encode_response
    from shmrpc.schema.header import HEADER, HEADER_NBYTES, unpack_from

    with Client(worker.name, timeout_s=10) as c, c.loan(4096) as req:
        req.array("x", 64, np.float32)[...] = 1.0
        for _ in range(2):  # the second time from the remembered check
            np.testing.assert_array_equal(req.send("echo")["out"], 1.0)
        mv = req._s.mv
        h = unpack_from(mv)
        good = decode_response(bytes(mv[HEADER_NBYTES:HEADER_NBYTES + h.payload_length]))
        t = good.outputs[0]
        for bad, field in ((t._replace(shape=(65,)), "shape"), (t._replace(offset=len(mv) - 8), "offset"),
                           (t._replace(name="tuo"), "outputs")):
            payload = encode_response(ResponseDesc(outputs=(bad,)))
            mv[HEADER_NBYTES:HEADER_NBYTES + len(payload)] = payload
            HEADER.pack_into(mv, 0, *h._replace(payload_length=len(payload)))
            with pytest.raises(RequestError) as e:
                req._response(h.request_id)
            assert e.value.field == field
        np.testing.assert_array_equal(req.send("echo")["out"], 1.0)  # the worker rewrites it: all well again


def test_a_loan_send_that_raises_keeps_no_view_of_its_slot_in_the_error(worker: WorkerProc) -> None:
    # Loan.send makes fresh views of the last response while the request runs; an error it raises (and whoever keeps
    # it, with its traceback) must not hold them: the slot goes back when the loan ends
    x = np.arange(16, dtype=np.float32)
    with Client(worker.name, timeout_s=10) as c:
        req = c.loan(4096)
        req.array("x", 16, np.float32)[:] = x
        np.testing.assert_array_equal(req.send("scale", a=2.0)["out"], 2 * x)
        np.testing.assert_array_equal(req.send("echo")["out"], x)  # another response: scale's views kept as older
        req.resident("y", "no-such-tensor", (16,), np.float32)
        with pytest.raises(RequestError) as ei:  # the worker's answer is an error, after one with views
            req.send("vector_add")
        assert ei.value.field or ei.value.tensor, ei.value  # named, by the worker
        kept = ei.value  # its traceback runs through send's frame
        s = req._s
        req.release()
        assert s.mv is None, "a view of the slot outlived the loan"
        assert kept.__traceback__ is not None
        np.testing.assert_array_equal(c.call("scale", x=x, a=3.0)["out"], 3 * x)


def test_a_client_calling_with_ever_new_signatures_keeps_bounded_caches(worker: WorkerProc,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # every size, and every attribute value sent from one loan, is a new signature: each cache of the client is
    # emptied when it is full rather than holding them all (a stream of random sizes grew a client's memory by ~8 MiB)
    from shmrpc.client import _caches, _slot

    assert _slot._decode.cache_info().maxsize == _caches.CACHE_ENTRIES
    monkeypatch.setattr(_caches, "CACHE_ENTRIES", 4)
    rng = np.random.default_rng(3)
    with Client(worker.name, timeout_s=10) as c:
        seen = []
        for n in range(1, 15):
            x = rng.standard_normal(n).astype(np.float32)
            np.testing.assert_allclose(c.call("scale", x=x, a=2.0, b=1.0)["out"], 2 * x + 1, rtol=1e-6)
            seen.append((len(c._plans), len(c._desc_cache), len(c._sizer)))
        assert max(max(s) for s in seen) <= 4 and min(s[0] for s in seen[4:]) >= 1
        with c.loan(64 << 10) as loan:
            x = loan.array("x", (8,), np.float32)
            x[:] = np.arange(8)
            for a in range(10):
                out = loan.send("scale", a=float(a), b=0.0)["out"]
                np.testing.assert_array_equal(out, a * np.arange(8, dtype=np.float32))
                del out
                assert len(loan._memo) <= 4


def test_submit_sends_a_planned_signature_by_its_plan(worker: WorkerProc) -> None:
    # submit() (and AsyncClient, which submits) takes the plan of a signature as call() does: the first submit plans
    # it, the next ones copy their inputs through its offsets; each future has its own slot and its own values, several
    # in flight at once
    rng = np.random.default_rng(33)
    with Client(worker.name, timeout_s=10) as c:
        xs = [rng.standard_normal(16).astype(np.float32) for _ in range(8)]
        ys = [rng.standard_normal(16).astype(np.float32) for _ in range(8)]
        np.testing.assert_array_equal(c.submit("vector_add", x=xs[0], y=ys[0]).result()["out"], xs[0] + ys[0])
        keys = [k for k in c._plans if k[0] == "vector_add"]
        assert len(keys) == 1, keys
        futs = [c.submit("vector_add", x=x, y=y) for x, y in zip(xs, ys)]  # 8 in flight, 8 slots
        for f, x, y in zip(futs, xs, ys):
            np.testing.assert_array_equal(f.result()["out"], x + y)
        assert [k for k in c._plans if k[0] == "vector_add"] == keys  # no second plan
        # views instead of copies, a transposed input, a resident one, an attribute
        view = c.submit("vector_add", x=xs[1], y=ys[1], _copy=False).result()["out"]
        np.testing.assert_array_equal(view, xs[1] + ys[1])
        del view
        m = rng.standard_normal((4, 6)).astype(np.float32)
        np.testing.assert_array_equal(c.submit("echo", x=m.T).result()["out"], m.T)
        c.put("b", ys[2])
        np.testing.assert_array_equal(c.submit("vector_add", x=xs[2], y=Resident("b")).result()["out"], xs[2] + ys[2])
        np.testing.assert_allclose(c.submit("scale", x=xs[3], a=2.0).result()["out"], 2 * xs[3])
        # a signature the worker refuses: its own typed error through the future, nothing kept, the client goes on
        with pytest.raises(KernelError) as ei:
            c.submit("vector_add", x=xs[0], y=np.ones(5, np.float32)).result()
        assert ei.value.field == "shape"
        np.testing.assert_array_equal(c.submit("vector_add", x=xs[4], y=ys[4]).result()["out"], xs[4] + ys[4])


def test_a_future_takes_the_kept_loan_and_leaves_it_for_the_next_request(worker: WorkerProc) -> None:
    # submit() of a plan takes the kept loan as call() does, and a future answered and copied out leaves its loan (slot
    # and views) for the next request; an error, a future handing out views, or a second future in flight at once
    # gives its slot back instead; each request its own values throughout, AsyncClient's too
    rng = np.random.default_rng(34)
    with Client(worker.name, timeout_s=10) as c:
        xs = rng.standard_normal((6, 16)).astype(np.float32)
        ys = rng.standard_normal((6, 16)).astype(np.float32)
        np.testing.assert_array_equal(c.call("vector_add", x=xs[0], y=ys[0])["out"], xs[0] + ys[0])
        (loan,) = c._kept
        free = len(c._slots.free)
        for x, y in zip(xs, ys):
            fut = c.submit("vector_add", x=x, y=y)
            assert fut._loan is loan and c._kept == []  # taken while in flight
            np.testing.assert_array_equal(fut.result()["out"], x + y)
            assert c._kept == [loan]
        assert len(c._slots.free) == free and len(loan._in_views) == 1  # no other slot, the views made once
        with pytest.raises(KernelError) as ei:  # a refused request: its slot goes back, nothing kept
            c.submit("vector_add", x=xs[0], y=np.ones(5, np.float32)).result()
        assert ei.value.field == "shape" and c._kept == []
        np.testing.assert_array_equal(c.submit("vector_add", x=xs[1], y=ys[1]).result()["out"], xs[1] + ys[1])
        (loan,) = c._kept
        view = c.submit("vector_add", x=xs[2], y=ys[2], _copy=False).result()["out"]  # views of its slot: not kept
        assert c._kept == []
        np.testing.assert_array_equal(c.submit("vector_add", x=xs[3], y=ys[3]).result()["out"], xs[3] + ys[3])
        np.testing.assert_array_equal(view, xs[2] + ys[2])  # the next request did not write into the view's slot
        del view
        two = [c.submit("vector_add", x=x, y=y) for x, y in zip(xs[:2], ys[:2])]  # two in flight: two slots
        assert two[0]._loan is not two[1]._loan
        for f, x, y in zip(two, xs, ys):
            np.testing.assert_array_equal(f.result()["out"], x + y)
        assert len(c._kept) == 1  # one kept, the other slot given back

    async def run() -> None:
        async with await AsyncClient.connect(worker.name, timeout_s=10) as ac:
            for x, y in zip(xs, ys):
                np.testing.assert_array_equal((await ac.call("vector_add", x=x, y=y))["out"], x + y)
            assert len(ac.client._kept) == 1
            outs = await asyncio.gather(*(ac.call("vector_add", x=x, y=y) for x, y in zip(xs, ys)))
            for out, x, y in zip(outs, xs, ys):
                np.testing.assert_array_equal(out["out"], x + y)

    asyncio.run(run())


def test_calls_taking_turns_between_plans_get_each_their_own_outputs(worker: WorkerProc) -> None:
    """Three signatures in turn through one kept loan: the worker serves each from its kept checks and the loan
    each answer from its kept views of that plan's last response; every output is still the call's own."""
    rng = np.random.default_rng(5)
    with Client(worker.name, timeout_s=10) as c:
        for i in range(30):
            x = rng.standard_normal(16).astype(np.float32)
            y = rng.standard_normal(8).astype(np.float32)
            k = i % 3
            if k == 0:
                np.testing.assert_array_equal(c.call("scale", x=x, a=2.0, b=1.0)["out"], 2 * x + 1)
            elif k == 1:
                np.testing.assert_array_equal(c.call("vector_add", x=y, y=y)["out"], 2 * y)
            else:
                out = c.call("echo", x=x[:4].reshape(2, 2))["out"]
                assert out.shape == (2, 2)
                np.testing.assert_array_equal(out, x[:4].reshape(2, 2))
        loan = c._kept[0]
        assert len(loan._out_older) == 2  # the other two plans' last responses, kept by the loan


def test_a_call_that_borrowed_a_pool_slot_gives_it_back_at_once(spawn_worker: Callable[..., WorkerProc]) -> None:
    # a call() larger than the client's lease borrows the pool's slot; views of it alive in call()'s frame when its
    # loan ended parked the slot, and it went back only at this client's next take: an idle client held the pool's
    # only large slot and another client's call waited its whole timeout for it (BusyError)
    from wire import worker_state

    w = spawn_worker(slots="64K:16,16M:1", lease="4,0")
    x = np.arange(300_000, dtype=np.float32)  # 1.2 MB: the pool's 16M slot
    with Client(w.name, timeout_s=10) as a:
        for _ in range(3):  # the first call and the steady path's
            np.testing.assert_array_equal(a.call("scale", x=x, a=2.0, b=0.0)["out"], 2 * x)
        held = [s for c in worker_state(w.name)["clients"] for s in c["slots"] if s[0] == 0]
        assert held == [], held  # region 0, the pool: nothing held by the idle client
        with Client(w.name, timeout_s=3) as b:
            np.testing.assert_array_equal(b.call("echo", x=x)["out"], x)
