"""The op table seen from the server: the plan query's answer and the ops listed by ``shmrpc status``.

A plan query (``shmrpc.schema.planquery``) runs the ops' shape rules over the input specs a
client sends and answers with the outputs' specs, so the client can size its slot; it runs
the same planning a request gets (``backend.plan``), so its errors are the call's errors.
"""

from __future__ import annotations

import logging
from typing import Any

from shmrpc import kernels
from shmrpc.kernels._errors import is_op_failure
from shmrpc.schema.control import ErrorReply, Manage
from shmrpc.schema.errors import InternalError, InvalidRequestError, RequestError, UnknownOpError
from shmrpc.schema.planquery import decode_plan_query, encode_plan_answer

from ._dispatch import error_response, kernel_error, resident_name

__all__ = ["answer_plan", "op_summary"]


log = logging.getLogger("shmrpc.server")


def _error(e: RequestError, id: int | None) -> bytes:
    """The ERROR answering a plan query with ``e``: its texts as a CALL's error response carries them (cut short,
    lone surrogates escaped: :func:`._dispatch.error_response`)."""
    r = error_response(e)
    return ErrorReply(r.status, "refused_request", r.message, r.field, id, op=r.op, step=r.step,
                      tensor=r.tensor).encode()


def answer_plan(backend: Any, client: int, req: Manage) -> bytes:
    """The MANAGED answer (or ERROR) to plan query ``req`` of ``client``, echoing its id."""
    try:
        q = decode_plan_query(req)
    except ValueError as e:
        return _error(InvalidRequestError(str(e), field="plan"), req.id)
    steps = []
    for i, (op, ins, outs, attrs) in enumerate(q.steps):
        if op not in kernels.REGISTRY:
            return _error(UnknownOpError(f"op {op!r} is not in the worker's op table", op=op, step=i,
                                         field=f"steps[{i}].op"), req.id)
        steps.append(kernels.StepSpec(op, ins, outs, attrs))
    try:
        specs = {n: kernels.TensorSpec(shape, dt) for n, (shape, dt) in q.inputs.items()}
        resident = {n: resident_name(client, n) for n in q.resident}
        plan = backend.plan(steps, specs, list(q.outputs), keep=list(q.keep), resident=resident)
    except kernels.OpError as e:
        if e.step < 0 and e.field in ("outputs", "keep"):
            return _error(InvalidRequestError(e.message, tensor=e.tensor, field=e.field), req.id)
        return _error(kernel_error(e, q.steps[0][0]), req.id)
    except BaseException as e:  # noqa: BLE001 - a bug must still be answered (the client waits for this id)
        if not is_op_failure(e):
            raise
        log.error("plan query failed unexpectedly", exc_info=e)
        return _error(InternalError(f"the plan query failed: {type(e).__name__}: {e}", op=q.steps[0][0]), req.id)
    return encode_plan_answer({n: (s.shape, s.dtype) for n, s in plan.outputs.items()}, req.id)


def op_summary() -> dict[str, dict[str, Any]]:
    """name -> {code, backends, builtin, module} of every op the worker serves, by code."""
    return {n: {"code": s.code, "backends": list(s.backends), "builtin": s.builtin, "module": s.module}
            for n, s in sorted(kernels.REGISTRY.items(), key=lambda kv: kv[1].code)}
