"""Descriptor <-> arrays: validate a request in a slot, plan it, place its outputs, write the response.

Nothing here trusts the slot. The header is copied out and checked, the
descriptor is copied out (``payload_length`` bytes, at most the slot's
descriptor area) before it is parsed, and every tensor is checked against the
slot's bounds before a NumPy view is made over it. Validated requests are
cached by their descriptor bytes (a copy, so a writer cannot change a cached
entry) and the slot size, which keeps FlatBuffers parsing off the hot path.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shmrpc import kernels
from shmrpc.kernels import Backend, Plan
from shmrpc.kernels._backend_base import BatchLaunch, BoundRun, ItemViews, RunLaunch
from shmrpc.kernels._batch import batchable
from shmrpc.kernels._errors import is_op_failure
from shmrpc.kernels._plan import bounded_put
from shmrpc.schema import dtypes
from shmrpc.schema.descriptor import RequestDesc, ResponseDesc, TensorRef, decode_request, encode_response
from shmrpc.schema.errors import (
    InternalError,
    InvalidRequestError,
    KernelError,
    RequestError,
    RequestTooLargeError,
    ResourceError,
    StaleSlotError,
    UnknownOpError,
)
from shmrpc.schema.header import HEADER_NBYTES, Flag, Header
from shmrpc.schema.layout import TENSOR_ALIGN, align_up, format_size_approx, tensor_align

_KERNEL_ERRORS = (kernels.KernelInputError, kernels.KernelRuntimeError)  # what run_error maps to a KernelError
log = logging.getLogger("shmrpc.server")

__all__ = ["Prepared", "Dispatcher", "kernel_error", "error_response", "encode_error", "resident_name"]

_MAX_MESSAGE = 1000  # characters of an error response's message
_MAX_NAME = 256  # ... of its op, tensor and field
_REQUEST_MASK = Flag.request_mask()
_KEEP = int(Flag.KEEP)
_IN_PLACE = int(Flag.IN_PLACE)


@dataclass(frozen=True)
class Prepared:
    """A validated request: what to run, where its inputs are and where its outputs go."""

    desc: RequestDesc
    plan: Plan | None  # None for alias-only pipelines (echo): nothing to run
    inputs: tuple[TensorRef, ...]  # in-slot inputs (resident ones excluded)
    outputs: tuple[TensorRef, ...]  # placed outputs, in the order requested
    resident: dict[str, str]  # request tensor name -> resident name
    keep_as: dict[str, str]  # output name -> resident name to keep it as
    op: str  # the metrics label: the op's name, "pipeline" for several steps, "put" for an upload (Client.put)
    nbytes_in: int
    nbytes_out: int
    response: bytes  # the success response descriptor, encoded once
    inline: bool = True  # little estimated work: run on the loop thread, not in the executor
    batch: bool = False  # the plan may run as one batch with other requests of an equal plan (kernels' batchable)


def resident_name(client: int, name: str) -> str:
    """The backend's name for a client's resident tensor: ``shared/...`` names are common to all clients,
    others are private (``<client id>/<name>``) and dropped when the client's lease ends."""
    return name if name.startswith("shared/") else f"{client}/{name}"


def kernel_error(e: Exception, default_op: str = "") -> RequestError:
    """Map a kernels exception to the wire error carrying its location."""
    fields = {
        "op": getattr(e, "op", "") or default_op,
        "step": getattr(e, "step", -1),
        "tensor": getattr(e, "tensor", "") or "",
        "field": getattr(e, "field", "") or "",
    }
    msg = str(getattr(e, "message", "") or e)
    if isinstance(e, kernels.KernelResourceError):
        return ResourceError(msg, **fields)
    return KernelError(msg, **fields)


def _text(value: object, limit: int) -> str:
    """``value`` as wire text: at most ``limit`` characters, lone surrogates (a file name decoded with
    ``surrogateescape``, say) and anything else UTF-8 cannot carry written as backslash escapes."""
    try:
        s = value if type(value) is str else str(value)
    except Exception:  # noqa: BLE001 - a user's object whose __str__ fails: its type is all there is to say
        s = f"<{type(value).__name__}>"
    s = s[:limit]
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        s = s.encode("utf-8", "backslashreplace").decode("utf-8")[:limit]
    return s


def error_response(err: RequestError, message_limit: int = _MAX_MESSAGE, name_limit: int = _MAX_NAME) -> ResponseDesc:
    """The response descriptor carrying ``err``: its message cut to ``message_limit`` characters, its op, tensor and
    field to ``name_limit``, every text encodable as UTF-8 (see :func:`_text`)."""
    step = err.step if type(err.step) is int and -1 <= err.step < 1 << 31 else -1
    return ResponseDesc(err.code, _text(err.message, message_limit), _text(err.op, name_limit), step,
                        _text(err.tensor, name_limit), _text(err.field, name_limit))


def encode_error(err: RequestError, room: int) -> bytes:
    """The response descriptor bytes carrying ``err``, at most ``room`` bytes (the slot's descriptor area after the
    header); never raises, so a request that failed is always answered. Its texts are cut shorter until they fit
    (``room`` is at least 240: the smallest descriptor area, 256, less the header); if even that fails, an
    :class:`InternalError` saying so, with the error's op."""
    for message_limit, name_limit in ((_MAX_MESSAGE, _MAX_NAME), (200, 64), (60, 32), (40, 12)):
        try:
            payload = encode_response(error_response(err, message_limit, name_limit))
        except Exception:  # noqa: BLE001 - a field no descriptor can carry: the InternalError below
            break
        if len(payload) <= room:
            return payload
    log.error("the error response of a request could not be encoded in %d bytes: %s", room, type(err).__name__)
    op = _text(getattr(err, "op", ""), 32)
    return encode_response(ResponseDesc(InternalError.code, "the request failed; its error could not be encoded",
                                        op if op.isascii() else ""))


def check_header(h: Header | tuple[int, int, int, int, int], request_id: int, generation: int,
                 desc_nbytes: int) -> None:
    """Check the header the client wrote (a :class:`Header`, or the plain tuple ``HEADER.unpack_from`` gives)
    against its doorbell.

    Raises:
        InvalidRequestError / StaleSlotError naming the header field.
    """
    h_rid, _, payload_length, flags, h_gen = h
    if h_rid != request_id:
        raise InvalidRequestError(
            f"header request_id {h_rid} differs from the doorbell's {request_id}", field="request_id"
        )
    if flags & ~_REQUEST_MASK:
        raise InvalidRequestError(f"header flags 0x{flags:04x} set bits a request may not set", field="flags")
    if h_gen != generation:
        raise StaleSlotError(f"header generation {h_gen} is not the slot's ({generation})", field="generation")
    if payload_length == 0 or payload_length > desc_nbytes - HEADER_NBYTES:
        raise InvalidRequestError(
            f"payload_length {payload_length} is outside 1..{desc_nbytes - HEADER_NBYTES}", field="payload_length"
        )


class Dispatcher:
    """Turns descriptor bytes into :class:`Prepared` requests, with a bounded cache."""

    def __init__(self, backend: Backend, desc_nbytes: int, cache_size: int = 1024, *, memory_limit_nbytes: int = 0,
                 inline_max_flops: int = 0, inline_max_nbytes: int = 0) -> None:
        self.backend = backend
        self.desc_nbytes = desc_nbytes
        self.memory_limit_nbytes = memory_limit_nbytes
        self.inline_max_flops, self.inline_max_nbytes = inline_max_flops, inline_max_nbytes
        self._cache: OrderedDict[tuple[bytes, int, int, int, int], Prepared] = OrderedDict()
        self._cache_size = cache_size
        self._codes = {name: spec.code for name, spec in kernels.REGISTRY.items()}
        self._names = {code: name for name, code in self._codes.items()}
        self._plans: dict[tuple[Any, ...], list[Plan]] = {}  # batchable plans made, by ops and inputs (_intern)
        self._responses: dict[tuple[TensorRef, ...], bytes] = {}  # response descriptor bytes, by the outputs placed
        self.fatal = ""  # set when the backend reports an error it cannot recover from
        self.pipeline_refusal: RequestError | None = None  # the last refusal of a request of several steps (prepare)

    def prepare(self, payload: bytes, op_code: int, flags: int, slot_nbytes: int, client: int) -> Prepared:
        """Validate a request's descriptor for a slot of ``slot_nbytes`` (cached).

        Raises:
            RequestError: the most specific error, naming the field.
        """
        key = (payload, op_code, flags, slot_nbytes, client)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        desc = decode_request(payload)
        try:
            prep = self._prepare(desc, op_code, flags, slot_nbytes, client)
        except RequestError as e:
            if len(desc.steps) > 1:  # counted under "pipeline", as its success would be (not the failing step's op)
                self.pipeline_refusal = e
            elif desc.keep and desc.steps[0].op == "echo":  # Client.put: named and counted as the put, not its echo
                e.op, e.step = "put", -1
            raise
        self._cache[key] = prep
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return prep

    # ------------------------------------------------------------ validation

    def _check_tensor(self, t: TensorRef, i: int, slot_nbytes: int) -> None:
        f = f"inputs[{i}]"
        if any(d < 0 or d > slot_nbytes for d in t.shape):
            # no dimension of a tensor that fits in the slot can exceed the slot's bytes (zero-size ones included)
            raise InvalidRequestError(f"tensor {t.name!r} has a dimension outside 0..{slot_nbytes}: {t.shape}",
                                      tensor=t.name, field=f"{f}.shape")
        want = math.prod(t.shape) * dtypes.itemsize(t.dtype)
        if t.resident:
            return
        if want != t.nbytes:
            raise InvalidRequestError(
                f"tensor {t.name!r}: shape {t.shape} of {t.dtype} is {want} bytes but nbytes says {t.nbytes}",
                tensor=t.name, field=f"{f}.nbytes",
            )
        if t.offset % TENSOR_ALIGN:
            raise InvalidRequestError(
                f"tensor {t.name!r} offset {t.offset} is not a multiple of {TENSOR_ALIGN}", tensor=t.name, field=f"{f}.offset"
            )
        if t.offset < self.desc_nbytes or t.offset + t.nbytes > slot_nbytes:
            raise InvalidRequestError(
                f"tensor {t.name!r} at [{t.offset}, {t.offset + t.nbytes}) is outside the slot's data area "
                f"[{self.desc_nbytes}, {slot_nbytes})", tensor=t.name, field=f"{f}.offset",
            )

    def _code_error(self, message: str, code: int, **where: Any) -> RequestError:
        """An op code that contradicts the op name: UnknownOpError if no op has it, else InvalidRequestError."""
        if code in self._names:
            return InvalidRequestError(f"{message} (op {self._names[code]!r}'s code)", **where)
        return UnknownOpError(f"{message}, which is not in the op table", **where)

    def _steps(self, desc: RequestDesc) -> list[Any]:
        if not desc.steps:
            raise InvalidRequestError("the request names no op", field="steps")
        steps = []
        for i, s in enumerate(desc.steps):
            code = self._codes.get(s.op)
            if code is None:
                raise UnknownOpError(f"op {s.op!r} is not in the worker's op table", op=s.op, step=i, field=f"steps[{i}].op")
            if s.op_code not in (0, code):
                raise self._code_error(f"op {s.op!r} has code {code}, the step says {s.op_code}", s.op_code,
                                       op=s.op, step=i, field=f"steps[{i}].op_code")
            steps.append(kernels.StepSpec(s.op, dict(s.inputs), dict(s.outputs), dict(s.attrs)))
        return steps

    def _prepare(self, desc: RequestDesc, op_code: int, flags: int, slot_nbytes: int, client: int) -> Prepared:
        steps = self._steps(desc)
        first = desc.steps[0].op
        if op_code and op_code != self._codes[first]:
            raise self._code_error(f"header op_code {op_code} is not the code of the first step's op {first!r}", op_code,
                                   op=first, field="op_code")
        names: set[str] = set()
        for i, t in enumerate(desc.inputs):
            if t.name in names:
                raise InvalidRequestError(f"tensor name {t.name!r} appears twice", tensor=t.name, field=f"inputs[{i}].name")
            names.add(t.name)
            self._check_tensor(t, i, slot_nbytes)
        bound = {name for s in desc.steps for _, name in s.inputs}
        for i, t in enumerate(desc.inputs):
            if t.name not in bound:  # sent and never read: the caller meant something else (an attribute, say)
                raise InvalidRequestError(f"tensor {t.name!r} is read by no step", tensor=t.name,
                                          field=f"inputs[{i}].name")
        if not desc.outputs and not desc.keep:
            raise InvalidRequestError("the request asks for no output", field="outputs")
        if bool(desc.keep) != bool(flags & _KEEP):
            raise InvalidRequestError("the KEEP flag and the keep list disagree", field="flags")
        for n in desc.keep:  # a resident tensor's name: later requests name it (Resident(name)), so not empty
            if not n.removeprefix("shared/"):
                raise InvalidRequestError(f"a kept tensor needs a name ({n!r} is empty)", tensor=n, field="keep")
        resident = {t.name: resident_name(client, t.resident) for t in desc.inputs if t.resident}
        specs = {t.name: kernels.TensorSpec(tuple(t.shape), t.dtype) for t in desc.inputs}
        for t in desc.inputs:
            if t.resident:
                self._check_resident(t.name, t.resident, resident[t.name], specs[t.name], first)
        alias_only = all(kernels.REGISTRY[s.op].alias for s in steps) and not desc.keep and not resident
        try:
            plan = self.backend.plan(steps, specs, list(desc.outputs), keep=list(desc.keep), resident=resident)
        except kernels.OpError as e:  # a shape rule's refusal or bug (users' rules may raise any OpError)
            if isinstance(e, kernels.KernelInputError) and e.step < 0 and e.field in ("outputs", "keep"):
                # the request's own lists are wrong (a name no step produces, or asked twice): not an op's refusal
                raise InvalidRequestError(e.message, tensor=e.tensor, field=e.field) from None
            raise kernel_error(e, first) from None
        # the cost is known from the plan alone: refuse what would take too much memory before anything runs
        try:
            cost = kernels.estimate(plan)  # an op's cost rule that fails: KernelInputError(field="cost")
            kernels.check_memory(plan, cost, self.memory_limit_nbytes)
        except kernels.OpError as e:
            if isinstance(e, kernels.KernelResourceError) and desc.keep and first == "echo" and len(steps) == 1:
                # Client.put (its step is the worker's business)
                raise ResourceError(f"this put needs {format_size_approx(max(cost.step_nbytes))}, over the worker's "
                                    f"per-request limit of {format_size_approx(self.memory_limit_nbytes)} "
                                    "(--request-memory-limit): put a smaller tensor or ask the worker's owner to raise "
                                    "the limit", op="put", field=e.field) from None
            raise kernel_error(e, first) from None
        # users' ops without a cost rule never run on the loop thread: a slow one holds an executor thread, not the loop
        inline = cost.flops <= self.inline_max_flops and cost.touched_nbytes <= self.inline_max_nbytes and \
            all(st.op.builtin or st.op.cost is not None for st in plan.steps)
        for st in plan.steps:
            for p in st.op.mutates:  # an op updating a resident tensor in place: only the caller's own
                if resident.get(st.inputs[p], "").startswith("shared/"):
                    raise InvalidRequestError(f"op {st.op.name!r} updates its input {p!r} in place; a shared resident "
                                              "tensor cannot be updated, bind one of your own", op=st.op.name,
                                              step=st.index, tensor=p, field="resident")
        in_slot = tuple(t for t in desc.inputs if not t.resident)
        outputs, all_aliased = self._place(desc, plan, in_slot, flags, slot_nbytes, alias_only)
        alias_only = alias_only and all_aliased
        nbytes_in = sum(t.nbytes for t in in_slot)
        nbytes_out = sum(t.nbytes for t in outputs)
        keep_as = {n: resident_name(client, n) for n in desc.keep}
        response = self._responses.get(outputs)
        if response is None:  # requests that differ only in attribute values place the same outputs
            response = encode_response(ResponseDesc(outputs=outputs))
            bounded_put(self._responses, outputs, response, self._cache_size)
        if HEADER_NBYTES + len(response) > self.desc_nbytes:
            raise RequestTooLargeError(
                f"the response descriptor ({len(response)} B) does not fit the descriptor area: ask for fewer outputs",
                field="outputs",
            )
        label = "pipeline" if len(steps) > 1 else ("put" if desc.keep and first == "echo" else first)
        batch = not alias_only and not keep_as and batchable(plan)
        if batch:
            plan = self._intern(plan)
        return Prepared(desc, None if alias_only else plan, in_slot, outputs, resident, keep_as, label,
                        nbytes_in, nbytes_out, response, inline or alias_only, batch=batch)

    def _check_resident(self, req: str, name: str, rname: str, spec: kernels.TensorSpec, first: str) -> None:
        """A resident input names a tensor that exists with the spec the request says, checked before the plan: a
        client's stale record of it (the tensor replaced with another shape or dtype, or dropped) is refused as that
        (``field="resident"``, which tells the client to look the tensor up again), not as an op's shape rule would
        refuse the stale shape. The run checks it again (``Backend._lookup_resident``): a prepared request is served
        again without this."""
        have = self.backend.resident_spec(rname)
        if have is None:
            raise kernel_error(kernels.KernelInputError(f"resident tensor {name!r} (input {req!r}) does not exist; "
                                                        "put it first", tensor=req, field="resident"), first)
        if have != spec:
            raise kernel_error(kernels.KernelInputError(
                f"resident tensor {name!r} (input {req!r}) is {have.dtype} {have.shape}; the request says {spec.dtype} "
                f"{spec.shape}", tensor=req, field="resident"), first)

    def _intern(self, plan: Plan) -> Plan:
        """An equal plan made before, if any, else ``plan`` (remembered): the batchable requests of several clients
        then share one plan object, which the worker's grouping of a turn's requests finds by identity instead of
        comparing plans (about 2 µs each). Plans are immutable, so sharing an equal one changes nothing else."""
        key: tuple[Any, ...] = (tuple(st.op.name for st in plan.steps),
                                tuple((n, s.shape, s.dtype) for n, s in plan.inputs.items()),
                                tuple(tuple(st.attrs.items()) for st in plan.steps))
        try:  # plans that differ in an attribute value only are told apart without comparing them
            made = self._plans.get(key)
        except TypeError:  # an attribute value that cannot be hashed: by ops and inputs, then compared
            key = key[:2]
            made = self._plans.get(key)
        if made is None:
            if len(self._plans) >= self._cache_size:
                self._plans.clear()
            made = self._plans[key] = []
        for p in made:
            if p == plan:
                return p
        if len(made) < 8:
            made.append(plan)
        return plan

    def _place(self, desc: RequestDesc, plan: Plan | None, inputs: tuple[TensorRef, ...], flags: int, slot_nbytes: int,
               alias_only: bool) -> tuple[tuple[TensorRef, ...], bool]:
        """Where each requested output goes in the slot: over its input (alias / in place) or after the inputs."""
        assert plan is not None  # output sizes come from the plan, alias-only pipelines included
        by_name = {t.name: t for t in inputs}
        last = desc.steps[-1]
        last_spec = kernels.REGISTRY[last.op]
        first_param = last_spec.inputs[0] if last_spec.inputs else None
        source = dict(last.inputs).get(first_param or "", "")
        overwrite = alias_only or (flags & _IN_PLACE and last_spec.inplace)
        pos = align_up(max((t.offset + t.nbytes for t in inputs), default=self.desc_nbytes), TENSOR_ALIGN)
        out = []
        aliased = 0
        for name in desc.outputs:
            spec = plan.outputs[name]
            nbytes = math.prod(spec.shape) * dtypes.itemsize(spec.dtype)
            src = by_name.get(source)
            if overwrite and src is not None and src.nbytes == nbytes and src.dtype == spec.dtype and \
                    dict(last.outputs).get(last_spec.outputs[0]) == name:
                out.append(TensorRef(name, spec.dtype, tuple(spec.shape), src.offset, nbytes))
                aliased += 1
                continue
            pos = align_up(pos, tensor_align(nbytes))
            if pos + nbytes > slot_nbytes:
                raise RequestTooLargeError(
                    f"output {name!r} needs {format_size_approx(nbytes)} after the inputs but the slot has "
                    f"{format_size_approx(max(0, slot_nbytes - pos))} left: ask for a larger slot (out_nbytes=) "
                    "or start the worker with larger --slots", tensor=name, field="outputs",
                )
            out.append(TensorRef(name, spec.dtype, tuple(spec.shape), pos, nbytes))
            pos += nbytes
        return tuple(out), aliased == len(out)

    # ------------------------------------------------------------ running

    def views(self, prep: Prepared, slot: memoryview) -> ItemViews:
        """NumPy views of ``prep``'s inputs and outputs inside ``slot`` (bounds were checked by :meth:`prepare`), as
        one :class:`ItemViews` (a pair the backend may remember its checks of, while the worker keeps it)."""
        return ItemViews({t.name: _view(slot, t) for t in prep.inputs}, {t.name: _view(slot, t) for t in prep.outputs})

    def run(self, prep: Prepared, slot: memoryview,
            views: ItemViews | None = None) -> dict[str, float]:
        """Run ``prep`` over ``slot``: inputs read from it, outputs written into it. Returns stage seconds.

        ``views``: the ones :meth:`views` made for this slot and request earlier (made here when None).

        Raises:
            RequestError: a KernelError / ResourceError with the op's location, or InternalError.
        """
        plan = prep.plan
        if plan is None:
            return {}
        ins, outs = self.views(prep, slot) if views is None else views
        return self.run_bound(prep, lambda: self.backend.run(plan, ins, outs, keep_as=prep.keep_as))

    def bind(self, prep: Prepared, views: ItemViews) -> BoundRun | None:
        """The backend's bound run of ``prep`` over ``views`` (:meth:`Backend.bind`); None when there is nothing to run."""
        if prep.plan is None:
            return None
        return self.backend.bind(prep.plan, views[0], views[1], keep_as=prep.keep_as)

    def run_bound(self, prep: Prepared, bound: BoundRun | None) -> dict[str, float]:
        """Call ``bound`` (:meth:`bind`'s, or any run of ``prep``) with :meth:`run`'s error mapping.

        Raises:
            RequestError: a KernelError / ResourceError with the op's location, or InternalError.
        """
        if bound is None:
            return {}
        try:
            return bound() or {}
        except BaseException as e:  # noqa: BLE001 - a backend bug must not take the worker down
            if not is_op_failure(e):
                raise
            err = self.run_error(prep, e)
            if err is e:
                raise
            raise err from (None if isinstance(e, _KERNEL_ERRORS) else e)

    def run_error(self, prep: Prepared, e: BaseException) -> RequestError:
        """The RequestError a run of ``prep`` that raised ``e`` answers with (:meth:`run_bound`'s mapping): a
        KernelInputError / KernelRuntimeError as a KernelError with the op's location (a KernelFatalError also
        marks the backend :attr:`fatal`), a RequestError as itself, anything else as an InternalError."""
        if isinstance(e, _KERNEL_ERRORS):
            if isinstance(e, kernels.KernelFatalError):
                self.fatal = str(e)  # a sticky CUDA error: this process cannot use the GPU any more
            return kernel_error(e, prep.desc.steps[0].op)
        if isinstance(e, RequestError):
            return e
        return InternalError(f"the backend failed: {type(e).__name__}: {e}", op=prep.desc.steps[0].op)


    def run_batch(self, plan: Plan, items: list[tuple[Prepared, ItemViews]]
                  ) -> list[dict[str, float] | RequestError]:
        """Run several requests of one batchable ``plan`` with one ``backend.run_batch``; ``items``: each request's
        :class:`Prepared` and its views. Returns per request, in order, its stage seconds or its own
        RequestError (as :meth:`run` would raise it); one request's failure is not the others'."""
        return self._batch_results(items, lambda: self.backend.run_batch(plan, [views for _, views in items]))

    def launch(self, prep: Prepared, views: ItemViews) -> RunLaunch | None:
        """Start ``prep``'s run without waiting for it (``backend.launch``), or None: run it with :meth:`run_bound`.
        The handle's ``finish`` goes through :meth:`run_bound` (``run_bound(prep, h.finish)``)."""
        if prep.plan is None or prep.keep_as:
            return None
        try:
            return self.backend.launch(prep.plan, *views)
        except Exception:  # noqa: BLE001 - a backend bug: run_bound runs the request and reports it
            log.exception("launch failed")
            return None

    def launch_batch(self, plan: Plan, items: list[tuple[Prepared, ItemViews]]
                     ) -> Launched | None:
        """Start :meth:`run_batch`'s work without waiting for it (``backend.launch_batch``), or None: call
        :meth:`run_batch`. The outputs are written once :meth:`Launched.finish` has returned."""
        try:
            h = self.backend.launch_batch(plan, [views for _, views in items])
        except Exception:  # noqa: BLE001 - a backend bug: run_batch runs the batch and reports it
            log.exception("launch_batch failed")
            return None
        return None if h is None else Launched(self, items, h)

    def _batch_results(self, items: list[tuple[Prepared, Any]], run: Callable[[], list[dict[str, float] | Exception]]
                       ) -> list[dict[str, float] | RequestError]:
        """``run()``'s results per request as :meth:`run_batch` returns them."""
        try:
            results = run()
            if len(results) != len(items):
                raise RuntimeError(f"run_batch answered {len(results)} of {len(items)} requests")
        except BaseException as e:  # noqa: BLE001 - a backend bug must not take the worker down
            if not is_op_failure(e):
                raise
            err = InternalError(f"the backend failed: {type(e).__name__}: {e}", op=items[0][0].desc.steps[0].op)
            return [err] * len(items)
        out: list[dict[str, float] | RequestError] = []
        for (prep, _), r in zip(items, results):
            if not isinstance(r, BaseException):
                out.append(r or {})
                continue
            op = prep.desc.steps[0].op
            if isinstance(r, (kernels.KernelInputError, kernels.KernelRuntimeError)):
                if isinstance(r, kernels.KernelFatalError):
                    self.fatal = str(r)
                out.append(kernel_error(r, op))
            elif isinstance(r, RequestError):
                out.append(r)
            else:
                out.append(InternalError(f"the backend failed: {type(r).__name__}: {r}", op=op))
        return out


class Launched:
    """A batch started by :meth:`Dispatcher.launch_batch`: ``done()`` says whether its device work is over (no
    wait); ``finish()`` (once, on the thread that launched it) waits and returns :meth:`Dispatcher.run_batch`'s
    results."""

    __slots__ = ("_dispatch", "_items", "_h")

    def __init__(self, dispatch: Dispatcher, items: list[tuple[Prepared, Any]], h: BatchLaunch) -> None:
        self._dispatch, self._items, self._h = dispatch, items, h

    def done(self) -> bool:
        try:
            return self._h.done()
        except Exception:  # noqa: BLE001 - finish() reports it
            return True

    def finish(self) -> list[dict[str, float] | RequestError]:
        return self._dispatch._batch_results(self._items, self._h.finish)


def _view(slot: memoryview, t: TensorRef) -> np.ndarray:
    """A NumPy view of tensor ``t`` inside ``slot`` (bounds already checked)."""
    dt = dtypes.numpy_dtype(t.dtype)
    n = t.nbytes // dt.itemsize
    return np.frombuffer(slot, dtype=dt, count=n, offset=t.offset).reshape(t.shape)
