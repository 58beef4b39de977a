"""``shmrpc bench lat|bw``: argument parsing and the run's output (table, verdicts, JSON, plots)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from shmrpc.schema.layout import parse_size
from shmrpc.server.config import parse_cpus, pin_process

from ._runner import SHM_KEYS, TRANSPORT_CLASSES, RunConfig
from ._shapes import check_shapes, shapes_nbytes
from ._stats import parse_sizes, size_sweep

__all__ = ["build_parser", "config_from_args", "main"]

_ALL_PEERS = "zmq,pipe,grpc,iox2,iox2-spin,ucx"
_EPILOG = """\
examples:
  shmrpc bench lat --peers                         # 64 B .. 256 MiB, shmrpc next to every peer installed
  shmrpc bench lat --sizes 64,4K,1M,64M --iters 2000 --plots bench/out
  shmrpc bench bw --window 8 --max-size 64M --peers zmq
  shmrpc bench lat --clients 1,2,4,8 --sizes 64,4K  # N client processes against one worker
  shmrpc bench lat --op scale --attr a=2 --dtype float32 --name my-worker
  shmrpc bench lat --op gemm --shape x=16x256 --shape w=256x256 --dtype float16 --clients 1,2,4,8,16
  shmrpc bench async --sizes 64 --in-flight 1000    # AsyncClient next to zmq.asyncio, with the loop's lag
  shmrpc bench threads --threads 1,2,4 --sizes 64   # threads sharing one Client vs a Client each
"""


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _sizes(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated counts, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError("counts must be >= 1")
    return values


def _cpus(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted(parse_cpus(text, "CPUs")))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _attr(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--attr takes KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``NAME=16x256`` -> ``("NAME", (16, 256))``; every dimension a whole number >= 1."""
    name, sep, dims = text.partition("=")
    name = name.strip()
    try:
        shape = tuple(int(d) for d in dims.lower().split("x")) if dims.strip() else ()
    except ValueError:
        shape = ()
    if not sep or not name.isidentifier() or not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--shape takes NAME=DIMxDIM..., e.g. x=16x256 (an input name, then "
                                         f"dimensions >= 1 joined by 'x'), got {text!r}")
    return name, shape


class UsageError(Exception):
    """A bad argument: ``main`` prints it as one line and returns 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """``--worker-args VALUE`` takes the next word whatever it is: argparse refused one that starts with ``-``
        (``--worker-args '--no-lanes'``: "expected one argument")."""
        words, joined = list(sys.argv[1:] if args is None else args), []
        while words:
            word = words.pop(0)
            joined.append(f"{word}={words.pop(0)}" if word == "--worker-args" and words else word)
        return super().parse_known_args(joined, namespace)


def build_parser(prog: str = "shmrpc bench") -> argparse.ArgumentParser:
    """The parser of ``shmrpc bench``."""
    p = _Parser(prog=prog, description="Round-trip latency and bandwidth of shmrpc, side by side with pyzmq, "
                                "multiprocessing pipes, gRPC, iceoryx2 and UCX.", epilog=_EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("lat", "bw", "async", "threads"),
                   help="lat: round-trip latency percentiles; bw: throughput with --window requests in flight; "
                   "async: AsyncClient vs zmq.asyncio; threads: one shared Client vs a Client per thread")
    g = p.add_argument_group("sizes and counts")
    g.add_argument("--sizes", type=_sizes, help="comma-separated sizes, e.g. 64,4K,1M,64M (overrides the sweep)")
    g.add_argument("--min-size", type=_size, default=64, help="power-of-two sweep from (default 64)")
    g.add_argument("--max-size", type=_size, default=256 << 20, help="power-of-two sweep to (default 256M)")
    g.add_argument("--iters", type=int, default=1000, help="timed round trips per size (default %(default)s)")
    g.add_argument("--connect-iters", type=int, default=0,
                   help="also time this many Client(name) connects, HELLO to ready (default 0: none)")
    g.add_argument("--warmup", type=int, default=50,
                   help="untimed round trips first (default %(default)s; at most half the size's round trips)")
    g.add_argument("--bytes-budget", type=_size, default=2 << 30,
                   help="cut --iters so one size moves at most this much one way (default 2G; never < 5 iters; "
                   "the 64 MiB goal needs 100 round trips there: 7G)")
    g.add_argument("--window", type=int, default=4, help="bw: requests kept in flight (default %(default)s)")
    g.add_argument("--clients", type=_ints, default=[],
                   help="also run N client processes at once, e.g. 1,2,4,8 (aggregate calls/s, per-client p99)")
    g.add_argument("--clients-max-size", type=_size, default=1 << 20,
                   help="the client sweep runs the sizes up to this (default 1M)")
    a = p.add_argument_group("async and threads")
    a.add_argument("--in-flight", type=int, default=1000, help="async: requests in flight at once (default %(default)s)")
    a.add_argument("--total", type=int, default=20000, help="async: requests in the loaded phase (default %(default)s)")
    a.add_argument("--threads", type=_ints, default=[1, 2, 4],
                   help="threads: thread counts (default 1,2,4); this mode has no peers and no --clients")
    a.add_argument("--duration-s", type=float, default=2.0, help="threads: seconds per point (default %(default)s)")
    w = p.add_argument_group("the worker and the op")
    w.add_argument("--op", default="echo", help="the op (default echo); each of its inputs gets the payload")
    w.add_argument("--in-place", action="store_true",
                   help="the loan asks for the output over its first input (ops declared in place, e.g. vector_add)")
    w.add_argument("--shape", type=_shape, action="append", default=[], metavar="NAME=DIMxDIM",
                   help="send input NAME of --op with this shape (repeat for every input, e.g. --op gemm "
                   "--shape x=16x256 --shape w=256x256 --dtype float16); replaces --sizes: the size is then the "
                   "request's bytes, which the peers move too")
    w.add_argument("--attr", type=_attr, action="append", default=[], help="op attribute KEY=VALUE (JSON value)")
    w.add_argument("--dtype", default="uint8", help="dtype of x (default uint8)")
    w.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto", help="for the worker it starts")
    w.add_argument("--name", help="use the running worker NAME instead of starting one")
    w.add_argument("--worker-args", default="", metavar="'ARGS'",
                   help="more arguments for the worker it starts, e.g. '--threads 8' or '--no-lanes' (the next word, "
                   "even one starting with -)")
    w.add_argument("--spin-us", type=int, default=0,
                   help="the worker it starts and the shmrpc clients poll this many µs before sleeping (0: off)")
    w.add_argument("--server-cpus", type=_cpus, default=(), metavar="LIST",
                   help="run every server on these CPUs (the worker through serve --cpus, each peer's server), e.g. 2")
    w.add_argument("--client-cpus", type=_cpus, default=(), metavar="LIST",
                   help="run this process and the client processes it starts on these CPUs, e.g. 10")
    t = p.add_argument_group("transports")
    t.add_argument("--peers", nargs="?", const=_ALL_PEERS, default="",
                   help=f"also measure peers (default all: {_ALL_PEERS}); missing packages are skipped")
    t.add_argument("--no-call", action="store_true", help="skip the shmrpc call() (copy in/out) line")
    t.add_argument("--lanes", action="store_true",
                   help="also the lanes: loan blocking and spinning, call() blocking (Client(lane=...)); async: call() and "
                        "AsyncClient through a blocking lane")
    t.add_argument("--transports", help=f"exact list, any of {','.join(TRANSPORT_CLASSES)} (overrides the above)")
    o = p.add_argument_group("output")
    o.add_argument("--out", help="JSON file (default bench/out/<mode>-<timestamp>.json)")
    o.add_argument("--no-json", action="store_true", help="write no JSON file")
    o.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")
    o.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no notes")
    return p


def _check_op_and_dtype(args: argparse.Namespace, keys: list[str]) -> None:
    """An op this process does not know, or a dtype no tensor has, is a usage error before anything starts: unless
    the run's worker may know more (``--name``, or ``--ops`` in ``--worker-args``)."""
    from shmrpc.kernels import REGISTRY
    from shmrpc.kernels._dtypes import DTYPE_NAMES

    if args.dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype {args.dtype}: not a tensor dtype; choose from {', '.join(DTYPE_NAMES)}")
    if (any(k in SHM_KEYS or k == "own" for k in keys) and args.op not in REGISTRY and not args.name
            and "--ops" not in (args.worker_args or "")):
        raise ValueError(f"--op {args.op}: no such op (built-in: {', '.join(sorted(REGISTRY))}; a users' op needs "
                         f"--worker-args '--ops MODULE' or --name of a worker that has it)")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The :class:`RunConfig` a parsed command line asks for.

    Raises:
        ValueError: an argument is out of range or names an unknown transport.
    """
    shapes = dict(args.shape)
    if len(shapes) != len(args.shape):
        raise ValueError("--shape names an input twice")
    if shapes:
        if args.sizes:
            raise ValueError("--shape and --sizes exclude each other: with shapes the size is the request's bytes")
        check_shapes(args.op, shapes, args.dtype, dict(args.attr))
        sizes = [shapes_nbytes(shapes, args.dtype)]
    else:
        sizes = args.sizes or size_sweep(args.min_size, args.max_size)
    if args.transports is not None:
        keys = [k.strip() for k in args.transports.split(",") if k.strip()]
        if not keys:  # an empty list once meant the default set
            raise ValueError(f"--transports {args.transports!r}: no transport named; choose from "
                             f"{', '.join(TRANSPORT_CLASSES)}")
    else:
        keys = ["shmrpc"] + ([] if args.no_call else ["shmrpc-call"])
        if args.lanes:
            keys += ["shmrpc-lane", "shmrpc-lane-spin"] + ([] if args.no_call else ["shmrpc-call-lane"])
        keys += [k.strip() for k in args.peers.split(",") if k.strip()]
    unknown = [k for k in keys if k not in TRANSPORT_CLASSES]
    if unknown:
        raise ValueError(f"unknown transport(s) {', '.join(unknown)}; choose from {', '.join(TRANSPORT_CLASSES)}")
    if not 0 <= args.spin_us <= 1_000_000:
        raise ValueError("--spin-us must be 0..1000000")
    if args.iters < 1 or args.warmup < 0 or args.window < 1:
        raise ValueError("--iters and --window must be >= 1 and --warmup >= 0")
    for flag, value, least in (("--connect-iters", args.connect_iters, 0), ("--bytes-budget", args.bytes_budget, 1),
                               ("--in-flight", args.in_flight, 1), ("--total", args.total, 1)):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if not args.duration_s > 0:  # NaN too
        raise ValueError(f"--duration-s must be > 0, got {args.duration_s}")
    if args.op != "echo":
        keys = [k for k in keys if k in SHM_KEYS] + [k for k in keys if k not in SHM_KEYS]
    _check_op_and_dtype(args, keys)
    return RunConfig(mode=args.mode, sizes=sizes, iters=args.iters, warmup=args.warmup, op=args.op,
                     attrs=dict(args.attr), dtype=args.dtype, backend=args.backend, window=args.window,
                     clients=args.clients, clients_max_nbytes=args.clients_max_size, transports=list(dict.fromkeys(keys)),
                     name=args.name, worker_args=args.worker_args, spin_us=args.spin_us,
                     bytes_budget=args.bytes_budget, in_place=args.in_place,
                     connect_iters=args.connect_iters, shapes=shapes, server_cpus=args.server_cpus,
                     client_cpus=args.client_cpus)


def main(argv: list[str] | None = None, prog: str = "shmrpc bench") -> int:
    """Run ``shmrpc bench`` with ``argv`` (without the ``bench`` word); returns the exit status.

    0 when at least one transport was measured, 1 when none could be, 2 on a usage error.
    """
    from ._plots import write_plots
    from ._report import (
        bandwidth_table,
        default_out_path,
        finish_document,
        latency_table,
        machine_facts,
        scaling_table,
        verdict_lines,
        write_json,
    )
    from ._session import run_benchmark

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
        cfg = config_from_args(args)
    except (UsageError, ValueError) as e:
        text = str(e)
        print(text if text.startswith(prog) else f"{prog}: {text}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0

    def note(text: str) -> None:
        if not args.quiet:
            print(text, file=sys.stderr, flush=True)

    usable = sorted(os.sched_getaffinity(0))
    off = [c for c in args.server_cpus or () if c not in usable]
    if off:
        print(f"{prog}: --server-cpus {','.join(map(str, off))}: not CPUs this process may use ({usable})",
              file=sys.stderr)
        return 2
    if args.client_cpus:
        try:
            pin_process(args.client_cpus)
        except OSError as e:
            print(f"{prog}: --client-cpus {','.join(map(str, args.client_cpus))}: not CPUs this process may use "
                  f"({sorted(os.sched_getaffinity(0))}): {e.strerror}", file=sys.stderr)
            return 2

    stopped_by: list[str] = []
    with _sigterm_as_ctrl_c(stopped_by):
        if args.mode in ("async", "threads"):
            try:
                return _concurrency(args, prog, argv)
            except KeyboardInterrupt:  # its worker is stopped by the `with` that started it
                print(f"{prog}: interrupted ({stopped_by[0] if stopped_by else 'Ctrl-C'}); nothing written",
                      file=sys.stderr)
                return 143 if stopped_by else 130
        machine = machine_facts()  # at the start: the load average is then the other work's, not this run's
        doc = run_benchmark(cfg, quiet=args.quiet, log=note)
    finish_document(doc, [*prog.split(), *argv], machine)
    print(latency_table(doc) if cfg.mode == "lat" else bandwidth_table(doc))
    if doc["scaling"]:
        print()
        print(scaling_table(doc))
    conn = doc.get("connect")
    if conn:
        print()
        print(f"connect: Client(name) to ready: error {conn['error']}" if "error" in conn else
              f"connect: Client(name) to ready, {conn['iterations']} times: p50 {conn['p50_us'] / 1000:.2f} ms, "
              f"p90 {conn['p90_us'] / 1000:.2f} ms, max {conn['max_us'] / 1000:.2f} ms")
    for key, info in doc["transports"].items():
        if info["status"] != "ok":
            print(f"skipped {key}: {info.get('reason', '')}")
    if doc["verdicts"]:
        print()
        print(verdict_lines(doc))
    if not args.no_json:
        path = write_json(doc, args.out or default_out_path(cfg.mode))
        print(f"\nJSON: {path}")
    if args.plots:
        try:
            for path in write_plots(doc, args.plots):
                print(f"plot: {path}")
        except ImportError as e:
            print(f"no plots: matplotlib is not installed (pip install 'shmrpc[bench]'): {e}")
    if doc.get("interrupted"):
        print(f"{prog}: interrupted ({stopped_by[0] if stopped_by else 'Ctrl-C'}); the figures above are those "
              f"measured before it", file=sys.stderr)
        return 143 if stopped_by else 130
    # a run in which nothing was measured (every point an error: an unknown dtype, say) failed
    measured = any("error" not in r for r in doc["results"]) or any("error" not in p for p in doc["scaling"])
    ok = any(v["status"] == "ok" for v in doc["transports"].values()) and measured
    return 0 if ok else 1


@contextmanager
def _sigterm_as_ctrl_c(stopped_by: list[str]) -> Iterator[None]:
    """SIGTERM (``timeout``, ``kill``, a CI job's limit) takes the Ctrl-C path: the servers are stopped and their
    sockets, temporary directories and the worker's log removed, which its default action left behind."""
    def stop(signum: int, frame: object) -> None:
        stopped_by.append("SIGTERM")
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _concurrency(args: argparse.Namespace, prog: str, argv: list[str]) -> int:
    """``async`` and ``threads`` modes (:mod:`._concurrency`)."""
    from ._concurrency import async_table, run_async, run_threads, threads_table
    from ._report import default_out_path, machine_facts, now_iso, write_json

    sizes = args.sizes or [64]
    backend = "numpy" if args.backend == "auto" else args.backend
    started, machine = now_iso(), machine_facts()  # the load of the other work on the host, before this run's
    if args.mode == "async":
        peers = args.transports is None or "zmq" in args.transports
        doc = run_async(sizes, args.iters, args.in_flight, args.total, args.name, backend, peers, args.lanes)
        print(async_table(doc))
    else:
        doc = run_threads(args.threads, sizes[0], args.duration_s, args.name, backend)
        print(threads_table(doc))
    doc.update(date=started, command=shlex.join([*prog.split(), *argv]), machine=machine,
               load_average=machine["loadavg"])
    if not args.no_json:
        print(f"\nJSON: {write_json(doc, args.out or default_out_path(args.mode))}")
    return 0
