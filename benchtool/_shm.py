"""shmrpc under test: the worker the benchmark starts, its slot geometry, and the two client paths.

* ``shmrpc`` (zero-copy loan): the payload is written into a loaned slot once,
  outside the timed loop, as a producer writing its data in place would; the
  loop times ``req.send(op)`` (or, where one loan cannot be sent twice,
  loan + view + send, with the bytes left in the slot from the first fill).
* ``shmrpc-call`` (``Client.call``, copy in/out): the timed call copies the
  caller's array into the slot and the output out of it.

The worker is a subprocess ``python -m shmrpc.server serve ...``; the client
package never imports the server.
"""

from __future__ import annotations

import os
import resource
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from shmrpc.schema import dtypes
from shmrpc.schema.layout import DESC_NBYTES, PAGE, align_up, tensor_align
from shmrpc.schema.naming import socket_path

from ._shapes import shaped_payload
from ._transport import Transport, TransportUnavailable, payload_of

__all__ = ["SlotPlan", "plan_slots", "WorkerProcess", "ShmLoanTransport", "ShmCallTransport", "request_nbytes"]

_SMALL_CLASSES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
_LARGE_STEP = 8 << 20


def request_nbytes(nbytes: int, tensors: int = 2) -> int:
    """Slot bytes one request of ``tensors`` tensors of ``nbytes`` each (inputs and the output) needs: descriptor
    area, tensors, alignment."""
    align = tensor_align(nbytes)
    end = align_up(DESC_NBYTES, align)
    for _ in range(tensors):
        end = align_up(end, align) + nbytes
    return end


def tensors_of(op: str) -> int:
    """Tensors of ``nbytes`` a slot holds for ``op`` (2 when unknown): its inputs, and room for outputs as large as
    all of them (what ``Client.call`` reserves when it is not told ``out_nbytes``)."""
    try:
        from shmrpc.kernels import REGISTRY
    except ImportError:  # pragma: no cover - the bench tool ships with the kernels
        return 2
    spec = REGISTRY.get(op)
    return 2 * len(spec.inputs) if spec is not None and spec.inputs else 2


def _loan_nbytes(nbytes: int, tensors: int = 2) -> int:
    """What ``Client.loan`` is asked for: tensor bytes (inputs, output, alignment), the descriptor area excluded."""
    return request_nbytes(nbytes, tensors) - DESC_NBYTES


def _class_for(need: int) -> int:
    for size in _SMALL_CLASSES:
        if need <= size:
            return size
    return align_up(need, _LARGE_STEP)


@dataclass(frozen=True)
class SlotPlan:
    """The ``--slots`` and ``--lease`` a worker gets so every benchmarked size fits with a window in flight.

    Attributes:
        slots: the geometry text (``"64K:8,1M:8,520M:1"``).
        lease: per-class counts leased to each client at HELLO (``"4,4,1"``).
        per_client: slot size -> slots each client may hold at once (the usable window).
        region_nbytes: bytes of the region the worker will create.
    """

    slots: str
    lease: str
    per_client: dict[int, int]
    region_nbytes: int

    tensors: int = 2

    def window_for(self, nbytes: int) -> int:
        """Requests of ``nbytes`` one client can keep in flight."""
        return self.per_client[_class_for(request_nbytes(nbytes, self.tensors))]


def plan_slots(sizes: list[int], window: int, clients: int, class_budget_bytes: int = 512 << 20,
               clients_max_nbytes: int | None = None, tensors: int = 2) -> SlotPlan:
    """Size classes for ``sizes``: each class holds ``window`` slots per client, cut to ``class_budget_bytes``.

    A class never holds fewer than one slot per client, so the geometry stays
    usable for every size; large classes get a shorter window instead. Only the
    classes of sizes up to ``clients_max_nbytes`` (all when ``None``) are
    multiplied by ``clients``; the others serve one client at a time.

    Example:
        >>> plan_slots([64, 1 << 20], window=4, clients=1).slots
        '64K:4,4M:4'
    """
    from shmrpc.schema.layout import format_size

    classes = sorted({_class_for(request_nbytes(n, tensors)) for n in sizes})
    limit = max(sizes) if clients_max_nbytes is None else clients_max_nbytes
    shared = {_class_for(request_nbytes(n, tensors)) for n in sizes if n <= limit}
    users = {c: max(1, clients) if c in shared else 1 for c in classes}
    per_client = {c: max(1, min(window, class_budget_bytes // (c * users[c]))) for c in classes}
    slots = ",".join(f"{format_size(c)}:{per_client[c] * users[c]}" for c in classes)
    lease = ",".join(str(per_client[c]) for c in classes)
    region = PAGE + sum(c * per_client[c] * users[c] for c in classes)
    return SlotPlan(slots, lease, per_client, region, tensors)


def _memlock_bytes() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return 1 << 62 if soft == resource.RLIM_INFINITY else soft


class WorkerProcess:
    """A worker started for the benchmark: ``python -m shmrpc.server serve --name <unique> ...``.

    Its output goes to a log file whose tail is shown when it fails. ``--no-mlock``
    is added when ``RLIMIT_MEMLOCK`` is below the region size (``mlocked`` says which).

    Raises:
        TransportUnavailable: the worker exited during start.
    """

    def __init__(self, plan: SlotPlan | None, backend: str = "auto", extra_args: str = "") -> None:
        from shmrpc.schema.layout import DEFAULT_GEOMETRY

        self.name = f"bench-{os.getpid()}-{secrets.token_hex(4)}"
        self.plan = plan
        region_nbytes = DEFAULT_GEOMETRY.region_nbytes if plan is None else plan.region_nbytes
        self.mlocked = _memlock_bytes() >= region_nbytes and "--no-mlock" not in extra_args
        self.argv = [sys.executable, "-m", "shmrpc.server", "serve", "--name", self.name, "--backend", backend,
                     "--log-level", "WARNING"]
        if plan is not None:  # None: the worker's own defaults (slots, lease)
            self.argv += ["--slots", plan.slots, "--lease", plan.lease]
        if not self.mlocked and "--no-mlock" not in extra_args:
            self.argv.append("--no-mlock")
        if "--metrics-port" not in extra_args:  # scraped per point of the client sweeps (batches formed)
            self.argv += ["--metrics-port", "0"]
        self.argv += shlex.split(extra_args)
        self._log = tempfile.NamedTemporaryFile(prefix="shmrpc-bench-worker-", suffix=".log", delete=False)
        self._proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the worker's socket exists and it said it is ready (clients then finish the handshake).

        Raises:
            TransportUnavailable: the worker exited, or no socket appeared within ``timeout_s``.
        """
        path = socket_path(self.name)
        deadline = time.monotonic() + timeout_s
        # its ready line too: it names the /metrics address (printed once the worker serves)
        while not path.exists() or " ready (pid " not in self.log_tail(1 << 16):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TransportUnavailable(f"the worker made no socket at {path} within {timeout_s} s: "
                                           f"{self.log_tail()}")
            time.sleep(0.02)

    def metrics_url(self) -> str | None:
        """The worker's /metrics address, from its ready line (None when it serves none)."""
        for word in self.log_tail(1 << 16).split():
            if word.startswith("http://") and "/metrics" in word:
                return word.rstrip(")")
        return None

    def check_alive(self) -> None:
        """Raise :class:`TransportUnavailable` with the log tail when the worker has exited."""
        if self._proc.poll() is not None:
            raise TransportUnavailable(f"the worker exited with status {self._proc.returncode}: {self.log_tail()}")

    def log_tail(self, nbytes: int = 2000) -> str:
        """The last ``nbytes`` of the worker's output."""
        self._log.flush()
        with open(self._log.name, "rb") as f:
            data = f.read()
        return data[-nbytes:].decode(errors="replace").strip()

    def close(self) -> int | None:
        """SIGTERM, wait up to 10 s, then SIGKILL; returns the exit status; removes the log."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)
        return self._proc.returncode

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def worker_counts(url: str | None) -> dict[str, float]:
    """Requests answered and batches run so far, from a worker's /metrics ({} when it cannot be read):
    ``requests`` (every op and status), ``batches`` and ``batched`` (requests served in them)."""
    if not url:
        return {}
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = {"requests": 0.0, "batches": 0.0, "batched": 0.0}
    for line in text.splitlines():
        if line.startswith("shmrpc_requests_total{"):
            out["requests"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("shmrpc_batch_size_count{"):
            out["batches"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("shmrpc_batch_size_sum{"):
            out["batched"] += float(line.rsplit(" ", 1)[1])
    return out


def _client(name: str, spin_us: int = 0, lane: str | None = None) -> Any:
    try:
        from shmrpc.client import Client  # type: ignore[attr-defined]
    except ImportError as exc:
        raise TransportUnavailable(f"shmrpc.client.Client is not available: {exc}") from exc
    try:
        return Client(name, timeout_s=60.0, connect_timeout_s=20.0, spin_us=spin_us, lane=lane)
    except Exception as exc:
        raise TransportUnavailable(f"cannot connect to worker {name!r}: {type(exc).__name__}: {exc}") from exc


_BF16 = dtypes.numpy_dtype("bfloat16")  # ml_dtypes' bfloat16 where it is installed, else uint16


class _ShmBase(Transport):
    """Shared by both shmrpc paths: the client, the op, its attributes and the payload dtype."""

    op: ClassVar[str] = "echo"
    #: The client's lane (``Client(lane=...)``): None for ZeroMQ doorbells.
    lane: ClassVar[str | None] = None

    def __init__(self, address: str, op: str = "echo", attrs: dict[str, Any] | None = None,
                 dtype: str = "uint8", spin_us: int = 0, in_place: bool = False,
                 shapes: dict[str, tuple[int, ...]] | None = None) -> None:
        super().__init__(address)
        self.shapes = dict(shapes or {})
        self.in_place = in_place
        self.op_name = op
        self.attrs = dict(attrs or {})
        self.dtype = dtype
        self._client = _client(address, spin_us, self.lane)
        if self.lane is not None and self._client._t.lane is None:
            self._client.close()
            raise TransportUnavailable("the worker grants no lanes (started with --no-lanes)")
        table = getattr(self._client, "op_table", None) or {}
        if table and op not in table:
            self._client.close()
            raise TransportUnavailable(f"the worker has no op {op!r}; it has {', '.join(sorted(table))}")
        # every tensor input of the op gets the same payload (vector_add: x and y)
        entry = table.get(op)
        self.inputs: tuple[str, ...] = tuple(entry.inputs) if entry is not None and entry.inputs else ("x",)
        if self.shapes:  # --shape: those inputs, each of its shape (the worker checks the names against the op)
            self.inputs = tuple(self.shapes)

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(input name, shape) of each input of a request of ``nbytes``: the --shape ones, or 1-D of nbytes each."""
        if self.shapes:
            return list(self.shapes.items())
        return [(name, (self.nbytes // np.dtype(self.dtype).itemsize,)) for name in self.inputs]

    def inputs_now(self) -> dict[str, np.ndarray]:
        """The request's input arrays (made once per size, outside the timed loop)."""
        if self.shapes:
            return {name: shaped_payload(shape, self.dtype) for name, shape in self.shapes.items()}
        arr = payload_of(self.nbytes, self.dtype)
        return dict.fromkeys(self.inputs, arr)

    def loan_nbytes(self) -> int:
        """What ``Client.loan`` is asked for: the inputs, room for outputs as large as all of them, alignment."""
        if not self.shapes:
            return _loan_nbytes(self.nbytes, len(self.inputs) + 1)
        item = np.dtype(self.dtype).itemsize
        sizes = [int(np.prod(s)) * item for s in self.shapes.values()]
        return sum(align_up(n, tensor_align(n)) + tensor_align(n) for n in [*sizes, sum(sizes)])

    def reply_bytes(self, reply: Any) -> bytes:
        out = reply["out"] if isinstance(reply, dict) else reply
        return np.ascontiguousarray(out).view(np.uint8).tobytes()

    def payload_bytes(self) -> bytes:
        return payload_of(self.nbytes, self.dtype).tobytes()

    def close(self) -> None:
        self.end_size()
        self._client.close()


class ShmLoanTransport(_ShmBase):
    """The zero-copy path: the payload is already in a loaned slot; the loop times ``send``."""

    key = "shmrpc"
    label = "shmrpc (zero-copy loan)"
    max_window = 1  # Loan.send waits for its answer; a window of loans would need the private API

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loan: Any = None
        self._req: Any = None
        self._resend = True

    def _open_loan(self) -> Any:
        loan = self._client.loan(self.loan_nbytes())
        req = loan.__enter__()
        return loan, req

    def _fill(self, req: Any) -> None:
        for name, arr in self.inputs_now().items():
            req.array(name, arr.shape, self.dtype)[...] = arr

    def prepare(self, nbytes: int) -> None:
        self.end_size()
        self.nbytes = nbytes
        self._loan, self._req = self._open_loan()
        self._fill(self._req)
        first = self._req.send(self.op_name, in_place=self.in_place, **self.attrs)
        try:  # one loan sent twice: supported by the client, or not
            self._req.send(self.op_name, in_place=self.in_place, **self.attrs)
            self._resend = True
        except Exception:
            self._resend = False
            self._loan.__exit__(None, None, None)
            self._loan = self._req = None
        del first

    def roundtrip(self) -> Any:
        if self._resend:
            return self._req.send(self.op_name, in_place=self.in_place, **self.attrs)
        with self._client.loan(self.loan_nbytes()) as req:
            for name, shape in self.tensor_shapes():
                req.array(name, shape, self.dtype)
            return _copy_reply(req.send(self.op_name, in_place=self.in_place, **self.attrs))

    def end_size(self) -> None:
        if self._loan is not None:
            self._loan.__exit__(None, None, None)
        self._loan = self._req = None
        self.nbytes = 0

    @property
    def method(self) -> str:
        """How a round trip is timed: ``resend`` (send within one loan) or ``loan+send``."""
        return "resend" if self._resend else "loan+send"


def _copy_reply(reply: Any) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in reply.items()} if isinstance(reply, dict) else {"out": np.array(reply)}


class ShmCallTransport(_ShmBase):
    """``Client.call``: copies the caller's array into the slot and the output out; ``submit`` for a window."""

    key = "shmrpc-call"
    label = "shmrpc call() (copy in/out)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("dtype") == "bfloat16" and _BF16 == np.uint16:
            # NumPy has no bfloat16: call() reads the dtype off the array, and uint16 words travel as uint16
            raise TransportUnavailable("call() takes bfloat16 from an ml_dtypes array or a PyTorch tensor "
                                       "(docs/interop.md); ml_dtypes is not installed")
        super().__init__(*args, **kwargs)
        self._kwargs: dict[str, Any] = {}

    def prepare(self, nbytes: int) -> None:
        self.nbytes = nbytes
        ins = self.inputs_now()
        if self.dtype == "bfloat16":  # the payload's uint16 words as ml_dtypes' bfloat16, no copy
            ins = {k: v.view(_BF16) for k, v in ins.items()}
        self._kwargs = {**ins, **self.attrs}

    def roundtrip(self) -> Any:
        return self._client.call(self.op_name, **self._kwargs)

    def start(self) -> Any:
        return self._client.submit(self.op_name, **self._kwargs)

    def finish(self, handle: Any) -> Any:
        return handle.result(60.0)

    def end_size(self) -> None:
        self._kwargs = {}
        self.nbytes = 0


class ShmLaneTransport(ShmLoanTransport):
    """The zero-copy loan with ``Client(lane="block")``: doorbell and answer through the lane, sleeping in poll()."""

    key = "shmrpc-lane"
    label = "shmrpc loan, lane (blocking)"
    lane = "block"


class ShmLaneSpinTransport(ShmLoanTransport):
    """The zero-copy loan with ``Client(lane="spin")``: the caller polls the page for up to spin_us, then sleeps."""

    key = "shmrpc-lane-spin"
    label = "shmrpc loan, lane (spinning)"
    lane = "spin"


class ShmCallLaneTransport(ShmCallTransport):
    """``Client.call`` through a blocking lane."""

    key = "shmrpc-call-lane"
    label = "shmrpc call(), lane (blocking)"
    lane = "block"
