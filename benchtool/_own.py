"""The "each process its own backend" baseline: no server, every client process runs the op itself.

``own`` makes the same backend the worker would (``--backend``: NumPy, or CuPy with its own
CUDA context in every process) and runs the benchmarked op on the payload in its own process:
the inputs are host arrays, the output a host array (the CuPy backend copies in and out, as the
worker does from its slots). What shmrpc's round trip is compared with when the alternative
to a worker is every process doing the work itself.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shmrpc.kernels._dtypes import storage_dtype

from ._shapes import shaped_payload
from ._transport import Transport, TransportUnavailable, payload_of

__all__ = ["OwnBackendTransport"]


class OwnBackendTransport(Transport):
    """Run ``op`` with this process's own backend; ``address`` is unused."""

    key = "own"
    label = "own backend, no server"

    def __init__(self, address: str, op: str = "echo", attrs: dict[str, Any] | None = None, dtype: str = "uint8",
                 backend: str = "auto", shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        super().__init__(address)
        self.shapes = dict(shapes or {})
        from shmrpc import kernels

        spec = kernels.REGISTRY.get(op)
        if spec is None or not spec.inputs or not spec.outputs:
            raise TransportUnavailable(f"op {op!r} has no inputs and outputs to run here")
        try:
            self._backend = kernels.select_backend(backend)
        except Exception as exc:  # noqa: BLE001 - no CuPy / no GPU: this baseline is skipped
            raise TransportUnavailable(f"cannot make the {backend} backend: {type(exc).__name__}: {exc}") from exc
        self._kernels, self.op, self.attrs, self.dtype = kernels, op, dict(attrs or {}), dtype
        self.inputs, self._out_param = tuple(spec.inputs), spec.outputs[0]
        self._plan: Any = None
        self._ins: dict[str, np.ndarray] = {}
        self._out = np.empty(0, np.uint8)

    def prepare(self, nbytes: int) -> None:
        k = self._kernels
        self.nbytes = nbytes
        if self.shapes:  # --shape: the same tensors the shmrpc paths send, as host arrays
            self._ins = {p: shaped_payload(self.shapes[p], self.dtype) for p in self.inputs}
        else:
            arr = payload_of(nbytes, self.dtype)
            self._ins = {p: arr.copy() for p in self.inputs}
        step = k.StepSpec(self.op, {p: p for p in self.inputs}, {self._out_param: "out"}, self.attrs)
        specs = {p: k.TensorSpec(a.shape, self.dtype) for p, a in self._ins.items()}
        self._plan = self._backend.plan([step], specs, ["out"])
        out = self._plan.outputs["out"]
        self._out = np.empty(out.shape, dtype=storage_dtype(str(out.dtype)))  # (bfloat16: its uint16 bits)

    def roundtrip(self) -> Any:
        self._backend.run(self._plan, self._ins, {"out": self._out})
        return self._out

    def reply_bytes(self, reply: Any) -> bytes:
        return np.ascontiguousarray(reply).view(np.uint8).tobytes()

    def payload_bytes(self) -> bytes:
        return payload_of(self.nbytes, self.dtype).tobytes()

    def end_size(self) -> None:
        self._plan, self._ins, self._out = None, {}, np.empty(0, np.uint8)
        self.nbytes = 0

    def close(self) -> None:
        self.end_size()
        self._backend.close()
