"""A user's op that prints 4 KiB to stdout per call (tests/with_ray/test_ray.py starts a worker with it)."""
from collections.abc import Mapping
from typing import Any

from shmrpc.kernels.api import OpCall, OpSpec, TensorSpec, register_op


def _rule(i: Mapping[str, TensorSpec], a: Mapping[str, Any]) -> dict[str, TensorSpec]:
    return {"out": i["x"]}


def _chatty(call: OpCall) -> dict[str, Any]:
    print("x" * 4096, flush=True)
    return {"out": call.inputs["x"] * 1}


CHATTY = register_op(OpSpec("chatty", inputs=("x",), outputs=("out",), infer=_rule, numpy=_chatty, cupy=_chatty,
                            doc="echo, printing 4 KiB to stdout"))
