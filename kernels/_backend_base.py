"""What every backend shares: planning, resident-tensor bookkeeping, input checks, warmup."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ._dtypes import as_storage, f32_to_bf16, storage_dtype
from ._errors import KernelFatalError, KernelInputError, KernelResourceError, KernelRuntimeError, OpError
from ._plan import Plan, ResolvedStep, build_plan
from ._registry import REGISTRY, StepSpec, TensorSpec

__all__ = ["Backend", "BatchItem", "BatchLaunch", "BoundRun", "ItemViews", "RunLaunch", "can_write", "check_host",
           "check_result", "example_array"]

#: A run of one plan over fixed views: ``bound()`` -> stage seconds, raising what ``Backend.run`` raises.
BoundRun = Callable[[], dict[str, float]]


class ItemViews:
    """One request's views, ``(inputs, outputs)`` by name, as one object that unpacks and indexes as that pair.

    A caller that makes one per request and keeps it, unchanged, for as long as the request's views stay the same
    (the worker: one per slot's validated request) lets a backend remember what it checked of a batch item by the
    object's identity: weakly, so that nothing keeps a region's views alive. Its mappings must not change once it
    is made. Any other pair is checked view by view, as before."""

    __slots__ = ("ins", "outs", "__weakref__")

    def __init__(self, ins: dict[str, np.ndarray], outs: dict[str, np.ndarray]) -> None:
        self.ins, self.outs = ins, outs

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return iter((self.ins, self.outs))

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return (self.ins, self.outs)[i]

    def __len__(self) -> int:
        return 2

    def __repr__(self) -> str:
        return f"ItemViews(ins={list(self.ins)}, outs={list(self.outs)})"


#: A batch item: one request's (inputs, outputs) views, as a pair or as an :class:`ItemViews`.
BatchItem = tuple[Mapping[str, np.ndarray], Mapping[str, np.ndarray]] | ItemViews


class BatchLaunch(Protocol):
    """A batch started on the device by :meth:`Backend.launch_batch`."""

    def done(self) -> bool: ...

    def finish(self) -> list[dict[str, float] | Exception]: ...


class RunLaunch(Protocol):
    """A request started on the device by :meth:`Backend.launch`: ``eta`` (time.perf_counter) is when it should be
    done, 0 when not known; ``finish()`` raises what :meth:`Backend.run` raises."""

    eta: float

    def done(self) -> bool: ...

    def finish(self) -> dict[str, float]: ...


def check_host(arr: Any, spec: TensorSpec, name: str, role: str) -> np.ndarray:
    """``arr`` as the storage dtype of ``spec`` after checking it is a NumPy array of that shape."""
    if not isinstance(arr, np.ndarray):
        raise KernelInputError(f"{role} {name!r} must be a NumPy array, got {type(arr).__name__}", tensor=name, field=role)
    if arr.shape != spec.shape:
        raise KernelInputError(f"{role} {name!r} has shape {arr.shape}, the plan says {spec.shape}", tensor=name, field="shape")
    try:
        return as_storage(arr, spec.dtype)
    except TypeError:
        raise KernelInputError(f"{role} {name!r} has dtype {arr.dtype}, the plan says {spec.dtype}", tensor=name, field="dtype") from None


def _same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype)


def can_write(view: np.ndarray, st: ResolvedStep, ins: Mapping[str, Any], later: Sequence[Any]) -> bool:
    """May step ``st`` write its output straight into host ``view``? Not where ``view`` shares memory with a tensor
    read by a later step (``later``) or with one of the step's inputs (``ins``), unless the op is elementwise and
    in-place-safe and that input is the very same memory. Every array given is a host (NumPy) array."""
    if any(np.may_share_memory(view, a) for a in later):
        return False
    for a in ins.values():
        if np.may_share_memory(view, a) and not (st.op.inplace and st.op.elementwise and _same_memory(view, a)):
            return False
    return True


def check_result(st: ResolvedStep, res: Any, out_specs: Mapping[str, TensorSpec]) -> None:
    """What an op's implementation returned must be its outputs, as the shape rule said (else KernelRuntimeError)."""
    if not isinstance(res, dict):
        raise KernelRuntimeError(f"op {st.op.name!r} returned {type(res).__name__}, not a dict of its outputs",
                                 op=st.op.name, step=st.index, field="outputs")
    for p, spec in out_specs.items():
        a = res.get(p)
        if a is None:
            raise KernelRuntimeError(f"op {st.op.name!r} returned no output {p!r}", op=st.op.name, step=st.index,
                                     tensor=p, field="outputs")
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise KernelRuntimeError(f"op {st.op.name!r} returned output {p!r} as a {type(a).__name__}, not an array",
                                     op=st.op.name, step=st.index, tensor=p, field="outputs")
        shape, dtype = tuple(a.shape), a.dtype
        if shape != spec.shape:
            raise KernelRuntimeError(f"op {st.op.name!r} returned output {p!r} of shape {shape}; its shape rule says "
                                     f"{spec.shape}", op=st.op.name, step=st.index, tensor=p, field="shape")
        if dtype != storage_dtype(spec.dtype):
            raise KernelRuntimeError(f"op {st.op.name!r} returned output {p!r} of dtype {dtype}; its shape rule says "
                                     f"{spec.dtype}", op=st.op.name, step=st.index, tensor=p, field="dtype")


def example_array(spec: TensorSpec, rng: np.random.Generator) -> np.ndarray:
    """A small well-formed array for ``spec`` (floats ~ N(0, 0.5), never all zero; ints in [1, 16))."""
    if spec.dtype in ("float16", "float32", "float64", "bfloat16"):
        f = (rng.standard_normal(spec.shape) * 0.5 + 0.01).astype(np.float32)
        return f32_to_bf16(np, f) if spec.dtype == "bfloat16" else f.astype(spec.dtype)
    if spec.dtype == "bool":
        return rng.integers(0, 2, spec.shape).astype(bool)
    return rng.integers(1, 16, spec.shape).astype(storage_dtype(spec.dtype))


#: Resident tensors a backend keeps: at most one per this many bytes of its limit (131 072 at the worker's default
#: ``--resident-limit`` of 8G), whatever their sizes (a tensor's bookkeeping costs memory of its own).
RESIDENT_NBYTES_PER_TENSOR = 64 << 10
#: ... and never fewer than this many.
RESIDENT_MIN_COUNT = 1024


class Backend:
    """Base of the NumPy and CuPy backends; see ``select_backend`` for the public contract."""

    name: str = ""
    xp: Any = None
    #: True: :meth:`run_batch` runs the items of a batchable plan as one (the worker then parks a turn's
    #: requests of one plan to run them together); False: item by item, and the worker runs each as it comes.
    joins_batches: bool = False
    #: True: a lone parked request is run as a batch of one (:meth:`launch_batch`, else :meth:`run_batch` with one
    #: item), so a backend may serve it as it serves batches (CuPy: the graph of a gathered batch of one, launched
    #: without blocking the worker's loop); False: the worker runs it with :meth:`run`, as an unbatched request.
    batches_singles: bool = False

    def __init__(self, resident_limit_bytes: int | None = None) -> None:
        self._lock = threading.RLock()
        self._resident: dict[str, tuple[Any, TensorSpec]] = {}
        self._resident_bytes = 0
        self.resident_limit_bytes: int | None = resident_limit_bytes
        self.inject_fault: str | None = None
        self.closed = False

    def _consume_injected_fault(self, plan: Plan) -> KernelRuntimeError | None:
        """The error an injected fault (``inject_fault``: ``"cuda_error"`` or ``"fatal"``) turns this run into, once."""
        kind, self.inject_fault = self.inject_fault, None
        if not kind:
            return None
        st0 = plan.steps[0] if plan.steps else None
        cls = KernelFatalError if kind == "fatal" else KernelRuntimeError  # "fatal": as a sticky CUDA error would
        return cls(f"injected fault: the run failed as a {self.name} device error would; "
                   "the backend was reset", op=st0.op.name if st0 else "", step=0 if st0 else -1)

    # -- planning ------------------------------------------------------------------
    def plan(self, steps: Iterable[StepSpec], inputs: Mapping[str, TensorSpec], outputs: Iterable[str],
             keep: Iterable[str] = (), resident: Mapping[str, str] | None = None) -> Plan:
        """Check a pipeline and infer every tensor; pure, the result is immutable and reusable.

        Parameters: ``steps`` in order; ``inputs`` request tensor name -> spec (resident
        ones included, with the spec the server looked up); ``outputs`` the tensors to
        return, in order; ``keep`` tensors to store as resident tensors instead;
        ``resident`` request tensor name -> resident name.
        Returns a :class:`Plan`. Raises KernelInputError (``step``, ``op``, ``tensor``, ``field`` set).
        Example::

            plan = backend.plan([StepSpec("scale", {"x": "a"}, {"out": "b"}, {"a": 2.0})],
                                {"a": TensorSpec((4,), "float32")}, ["b"])
        """
        plan = build_plan(steps, inputs, outputs, keep, resident)
        for st in plan.steps:
            if self.name not in st.op.backends:
                raise KernelInputError(f"op {st.op.name!r} has no {self.name} implementation (it has: "
                                       f"{', '.join(st.op.backends)}); run it on a worker with that backend",
                                       op=st.op.name, step=st.index, field="op")
        return plan

    # -- resident tensors ----------------------------------------------------------
    def put(self, name: str, host_array: np.ndarray, dtype_name: str) -> TensorSpec:
        """Copy ``host_array`` into a resident tensor ``name`` (replacing one of that name).

        Returns its spec. Raises KernelInputError (bad dtype) or KernelResourceError
        (``resident_limit_bytes`` would be exceeded, or out of device memory).
        """
        spec = TensorSpec(tuple(host_array.shape), dtype_name)
        arr = check_host(host_array, spec, name, "resident")
        with self._lock:
            old = self._resident.get(name)
            new_total = self._resident_bytes - (old[1].nbytes if old else 0) + spec.nbytes
            if self.resident_limit_bytes is not None and new_total > self.resident_limit_bytes:
                raise KernelResourceError(
                    f"resident tensor {name!r} ({spec.nbytes} bytes) would bring resident memory to {new_total} bytes, "
                    f"over the limit of {self.resident_limit_bytes}; drop resident tensors or raise the limit",
                    tensor=name, field="resident_limit")
            if old is None:
                self._check_count(name)
            stored = self._to_resident(arr, spec)
            self._resident[name] = (stored, spec)
            self._resident_bytes = new_total
        return spec

    def _check_count(self, name: str) -> None:
        """Refuse one more resident tensor past one per :data:`RESIDENT_NBYTES_PER_TENSOR` of the limit (at least
        :data:`RESIDENT_MIN_COUNT`): each costs the
        worker's memory for its bookkeeping whatever its size, so tiny ones must not be kept without bound (the caller
        holds the lock)."""
        if self.resident_limit_bytes is not None and \
                len(self._resident) >= max(RESIDENT_MIN_COUNT, self.resident_limit_bytes // RESIDENT_NBYTES_PER_TENSOR):
            raise KernelResourceError(
                f"{len(self._resident)} resident tensors are the most the limit of {self.resident_limit_bytes} bytes "
                f"allows ({RESIDENT_MIN_COUNT}, or one per {RESIDENT_NBYTES_PER_TENSOR >> 10} KiB of it if more); drop "
                "resident tensors or raise the limit", tensor=name, field="resident_limit")

    def drop(self, name: str) -> None:
        """Forget resident tensor ``name``; raises KernelInputError(field="resident") when there is none."""
        with self._lock:
            entry = self._resident.pop(name, None)
            if entry is None:
                raise KernelInputError(f"there is no resident tensor {name!r}", tensor=name, field="resident")
            self._resident_bytes -= entry[1].nbytes

    def resident(self) -> dict[str, TensorSpec]:
        """name -> spec of every resident tensor."""
        with self._lock:
            return {k: v[1] for k, v in self._resident.items()}

    def resident_spec(self, name: str) -> TensorSpec | None:
        """The spec of resident tensor ``name`` now, or None when there is none."""
        with self._lock:
            entry = self._resident.get(name)
        return None if entry is None else entry[1]

    @property
    def resident_bytes(self) -> int:
        """Bytes held by resident tensors."""
        return self._resident_bytes

    def _to_resident(self, arr: np.ndarray, spec: TensorSpec) -> Any:
        raise NotImplementedError

    def _lookup_resident(self, plan: Plan) -> dict[str, Any]:
        found: dict[str, Any] = {}
        with self._lock:
            for req, rname in plan.resident.items():
                entry = self._resident.get(rname)
                if entry is None:
                    raise KernelInputError(f"resident tensor {rname!r} (input {req!r}) does not exist; put it first",
                                           tensor=req, field="resident")
                if entry[1] != plan.inputs[req]:
                    raise KernelInputError(f"resident tensor {rname!r} is {entry[1]}, the plan was made for {plan.inputs[req]}",
                                           tensor=req, field="resident")
                found[req] = entry[0]
        return found

    def _keep(self, plan: Plan, env: Mapping[str, Any], keep_as: Mapping[str, str] | None) -> None:
        for name, spec in plan.keep.items():
            rname = (keep_as or {}).get(name, name)
            with self._lock:
                old = self._resident.get(rname)
                new_total = self._resident_bytes - (old[1].nbytes if old else 0) + spec.nbytes
                if self.resident_limit_bytes is not None and new_total > self.resident_limit_bytes:
                    raise KernelResourceError(f"keeping {name!r} as resident {rname!r} would exceed the resident limit of "
                                              f"{self.resident_limit_bytes} bytes; drop resident tensors first",
                                              tensor=name, field="resident_limit")
                if old is None:
                    self._check_count(name)
                self._resident[rname] = (self._own(env[name]), spec)
                self._resident_bytes = new_total

    def _own(self, arr: Any) -> Any:
        return arr

    def _host_io(self, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]
                 ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        host_in: dict[str, np.ndarray] = {}
        for name, spec in plan.inputs.items():
            if name in plan.resident:
                continue
            if name not in inputs:
                raise KernelInputError(f"input {name!r} is missing", tensor=name, field="inputs")
            host_in[name] = check_host(inputs[name], spec, name, "inputs")
        host_out: dict[str, np.ndarray] = {}
        for name, spec in plan.outputs.items():
            if name not in outputs:
                raise KernelInputError(f"output view {name!r} is missing", tensor=name, field="outputs")
            host_out[name] = check_host(outputs[name], spec, name, "outputs")
        return host_in, host_out

    # -- lifecycle -----------------------------------------------------------------
    def warmup(self) -> None:
        """Run every registered op once on its small example (loads/compiles kernels)."""
        rng = np.random.default_rng(0)
        for spec in REGISTRY.values():
            if not spec.example or self.name not in spec.backends:
                continue
            ins = {p: p for p in spec.inputs}
            outs = {p: f"out_{p}" for p in spec.outputs}
            try:  # the shape rule's failure too (sys.exit() included): the start stops, naming the op
                plan = self.plan([StepSpec(spec.name, ins, outs, {})], dict(spec.example), list(outs.values()))
                host_in = {p: example_array(s, rng) for p, s in spec.example.items()}
                host_out = {n: np.empty(s.shape, storage_dtype(s.dtype)) for n, s in plan.outputs.items()}
                self.run(plan, host_in, host_out)
            except OpError as e:
                where = "" if spec.builtin else f" (module {spec.module})"
                raise type(e)(f"op {spec.name!r}{where} failed its warm-up run on its `example` inputs: {e.message}",
                              op=e.op, step=e.step, tensor=e.tensor, field=e.field) from e

    def run(self, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
            keep_as: Mapping[str, str] | None = None) -> dict[str, float]:
        raise NotImplementedError

    def bind(self, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray],
             keep_as: Mapping[str, str] | None = None) -> BoundRun:
        """``plan`` over these very views, as a callable: each call is one :meth:`run` and returns its stage seconds.

        A backend may do once here what does not change between runs over the same views (checks of the
        views, where each step writes); what can change (injected faults, resident tensors, what an op
        returns, ``closed``) is still checked per call, with the errors :meth:`run` raises. Here: a closure
        calling :meth:`run`.
        """
        def bound() -> dict[str, float]:
            return self.run(plan, inputs, outputs, keep_as)
        return bound

    def run_batch(self, plan: Plan, items: Sequence[BatchItem]) -> list[dict[str, float] | Exception]:
        """Run ``plan`` over several requests: ``items`` is one (inputs, outputs) pair of views per request.

        Returns, per item in order, its stage seconds or the exception its run raised (an
        :class:`OpError` naming op, step and tensor, as :meth:`run` would raise it). Here: one
        :meth:`run` per item; a backend may run a :func:`~shmrpc.kernels._batch.batchable` plan
        as one batch, falling back to this when the joint run fails, so one bad request fails alone.
        """
        results: list[dict[str, float] | Exception] = []
        for ins, outs in items:
            try:
                results.append(self.run(plan, ins, outs) or {})
            except Exception as e:  # noqa: BLE001 - each request's own error, returned to its caller
                results.append(e)
        return results

    def launch(self, plan: Plan, inputs: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]) -> RunLaunch | None:
        """Start :meth:`run`'s work on the device and return without waiting for it, or None: call :meth:`run`
        (as :meth:`launch_batch`, for one request). Here: None."""
        return None

    def launch_batch(self, plan: Plan, items: Sequence[BatchItem]) -> BatchLaunch | None:
        """Start :meth:`run_batch`'s work on the device and return without waiting for it, or None: run it with
        :meth:`run_batch`. The handle's ``done()`` says whether the device has finished (no wait), its
        ``finish()`` (called once, on the thread that launched) waits and returns what :meth:`run_batch` would.
        The outputs are the caller's only after ``finish()``. Here: None (nothing runs apart from its caller)."""
        return None

    def register_host(self, address: int, nbytes: int) -> None:
        """Pin host memory [address, address+nbytes) for DMA (no-op on NumPy)."""

    def unregister_host(self, address: int | None = None) -> None:
        """Undo ``register_host`` for ``address`` (None: every registered range)."""

    def memory(self) -> dict[str, int]:
        """Memory in use: ``resident_bytes`` (+ device figures on CuPy)."""
        return {"resident_bytes": self._resident_bytes}

    def close(self) -> None:
        """Drop resident tensors and release what the backend holds; idempotent."""
        with self._lock:
            self._resident.clear()
            self._resident_bytes = 0
        self.closed = True

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} resident={len(self._resident)} ({self._resident_bytes} B)>"
