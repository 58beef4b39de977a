"""The worker's commands: ``serve``, ``status``, ``doctor`` (``shmrpc bench`` is dispatched by
:mod:`shmrpc.cli` to :mod:`shmrpc.bench`; the worker never imports it).

Examples::

    shmrpc serve --name demo                      # worker with the default region (~988 MiB)
    shmrpc serve --name t --slots 64K:8,1M:2 --backend numpy --metrics-port 9464
    shmrpc status --name demo                     # regions, leases, in-flight requests, counters
    shmrpc status --name demo -q && echo ready    # a health check: the exit status alone
    shmrpc doctor [--clean]                       # stale regions/sockets; serve's memory and memlock checks

Exit status (every command):

====  ==============================================================================
0     success; for ``status``: the worker answered (it is ready)
1     failure at run time: no such worker, it did not answer, a startup check failed
2     usage error: a bad argument (one line on stderr, never a traceback)
3     ``serve``: the worker stopped after an unrecoverable backend error
130   interrupted (Ctrl-C)
====  ==============================================================================

Output cut short by a closed pipe (``shmrpc status | head``) is not an error.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import signal
import sys
from typing import Any, NoReturn

from shmrpc.schema.lane import LINGER_NS
from shmrpc.schema.layout import DEFAULT_GEOMETRY, format_size_approx, parse_geometry

__all__ = ["main", "build_parser", "version", "EXIT_OK", "EXIT_FAILURE", "EXIT_USAGE", "EXIT_BACKEND",
           "EXIT_INTERRUPTED"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_BACKEND, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class UsageError(Exception):
    """A bad argument: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and the exit status 2), not usage text and a message."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def version() -> str:
    """The installed shmrpc version (``unknown`` when run from a bare source tree)."""
    try:
        from importlib.metadata import version as dist_version

        return dist_version("shmrpc")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``shmrpc`` command."""
    p = _Parser(prog="shmrpc", description="Zero-copy RPC for array compute on one host.",
                epilog="exit status: 0 ok, 1 failure, 2 usage error, 3 backend failure (serve), 130 interrupted")
    p.add_argument("--version", action="version", version=f"shmrpc {version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{serve,status,doctor,bench}")

    s = sub.add_parser("serve", help="run a worker")
    s.add_argument("--name", required=True, help="worker name; clients find the worker by it")
    s.add_argument("--slots", default=DEFAULT_GEOMETRY.spec(),
                   help="slot size classes SIZE:COUNT, smallest first (default %(default)s)")
    s.add_argument("--lease", default=None,
                   help="slots of each class leased to a client that asks for none, e.g. 4,2,0,0,0 (default)")
    s.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto",
                   help="auto: CuPy when it imports and sees a GPU, else NumPy (default %(default)s)")
    s.add_argument("--device", type=int, default=None,
                   help="bind the worker to this one GPU (CUDA_VISIBLE_DEVICES is set to it before CuPy starts)")
    s.add_argument("--devices", default=None, metavar="all|0,1,..",
                   help="run a supervisor: one worker per device, named <name>-<device>, each restarted when it "
                        "dies; clients spread calls over them with shmrpc.client.Pool(<name>)")
    s.add_argument("--no-mlock", action="store_true", help="do not mlock the region (no RLIMIT_MEMLOCK needed)")
    s.add_argument("--isolation", choices=("client", "shared"), default="client",
                   help="client: leased slots in a region per client, unlinked once mapped (default); "
                        "shared: all slots in the worker's pool region")
    s.add_argument("--client-max-slots", type=int, default=0,
                   help="most slots one client may borrow beyond its lease at once (default 0: no limit)")
    s.add_argument("--client-max-bytes", default="0",
                   help="most bytes of borrowed slots one client may hold at once (default 0: no limit)")
    s.add_argument("--no-register", action="store_true",
                   help="do not pin the region for the GPU (only to measure what pinning buys)")
    s.add_argument("--threads", type=int, default=4, help="executor threads for larger requests (default %(default)s)")
    s.add_argument("--inline-max", default="256K",
                   help="requests touching at most this many bytes (inputs, intermediates, outputs) and at most "
                        "--inline-max-flops may run on the loop thread (default %(default)s)")
    s.add_argument("--spin-us", type=int, default=0,
                   help="poll this many µs without sleeping before blocking (lower latency, a busy core; 0: off)")
    s.add_argument("--cpus", default=None, metavar="LIST",
                   help="run the worker (every thread) on these CPUs only, e.g. 2 or 2,10 or 0-3: a spinning worker "
                        "and its spinning clients on separate physical cores (docs/operations.md)")
    s.add_argument("--max-batch", type=int, default=64, metavar="N",
                   help="serve up to N requests of one batchable plan that arrive in the same turn of the loop "
                        "with one batched run (1: off) (default %(default)s)")
    s.add_argument("--batch-wait-us", type=int, default=0, metavar="US",
                   help="after a batched run of N requests, hold fewer than N parked requests up to US µs, spinning, "
                        "for the rest to arrive (soon after that run only; 0: never) (default %(default)s)")
    s.add_argument("--io-threads", type=int, default=1, metavar="N",
                   help="libzmq I/O threads moving the clients' messages; each connection is served by one "
                        "(default %(default)s)")
    s.add_argument("--lane-linger-us", type=int, default=LINGER_NS // 1000, metavar="US",
                   help="after answering a lane whose client came back soon after its last answer, read the lanes "
                        "US µs before sleeping (0: never; off on a one-CPU host) (default %(default)s)")
    s.add_argument("--no-lanes", action="store_true",
                   help="refuse lanes (a shared page and eventfds beside ZeroMQ that clients may ask for): "
                        "every doorbell then goes over ZeroMQ")
    s.add_argument("--resident-limit", default="8G", help="cap on resident tensors (default %(default)s)")
    s.add_argument("--allow-uid", type=_uid, action="append", default=[],
                   help="another uid that may connect (its clients pass worker_uid=<this worker's uid>)")
    s.add_argument("--dumpable", action="store_true",
                   help="stay dumpable (for a debugger or profiler); by default the worker makes itself "
                        "non-dumpable so other processes of its uid cannot reach the regions through /proc")
    b = s.add_argument_group("bounds", "what one client or one request may cost the worker")
    b.add_argument("--lease-max", default=None,
                   help="most slots of each class a client may ask for in its HELLO (default 4,2,1,1,0; never "
                        "below --lease)")
    b.add_argument("--max-clients", type=int, default=64, help="clients connected at once (default %(default)s; 0: no limit)")
    b.add_argument("--max-clients-per-uid", type=int, default=16,
                   help="clients of one uid connected at once (default %(default)s; 0: no limit)")
    b.add_argument("--request-memory-limit", default="2G",
                   help="bytes of intermediates and outputs one request may need (default %(default)s; "
                        "0: no limit)")
    b.add_argument("--inline-max-flops", type=int, default=8_000_000,
                   help="estimated FLOPs up to which a request may run on the loop thread (default %(default)s; "
                        "0: only requests of no arithmetic, such as echo)")
    b.add_argument("--client-max-waiters", type=int, default=4,
                   help="ACQUIREs one client may have waiting for a slot (default %(default)s; 0: none waits, a "
                        "borrow finding no free slot fails at once)")
    s.add_argument("--op-budget", type=float, default=1.0, metavar="SECONDS",
                   help="count requests whose run takes longer in shmrpc_over_budget_total{op} (0: off; "
                        "an op's own budget_s wins; nothing is stopped) (default %(default)s)")
    s.add_argument("--ops", default=None, metavar="MODULE[,MODULE]",
                   help="import these modules of users' ops at start (also: the shmrpc.ops entry points)")
    s.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="least severe log lines written (default %(default)s; failed requests log at INFO)")
    _add_observability_args(s)

    st = sub.add_parser("status", help="show a worker's regions, leases, in-flight requests and counters",
                        description="Ask a running worker for its state. Exit status 0 when it answered and "
                                    "is ready (usable as a readiness check), 1 when it is not ready (draining, "
                                    "say: the first line says why), when there is no such worker or it did not "
                                    "answer in time, 2 on a bad argument.")
    st.add_argument("--name", required=True, help="the worker's name (as given to shmrpc serve --name)")
    st.add_argument("--timeout-s", type=_timeout, default=3.0,
                    help="how long to wait for the answer, in seconds (default %(default)s)")
    st.add_argument("--devices", action="store_true",
                    help="NAME is a supervisor's (serve --devices): ask every NAME-<device> worker there is; ready "
                         "when all are (--json: an object by worker name)")
    st.add_argument("--json", action="store_true", help="print the worker's state as JSON")
    st.add_argument("--quiet", "-q", action="store_true", help="print nothing: the exit status alone tells")

    d = sub.add_parser("doctor", help="find (and with --clean remove) stale regions and sockets; check limits",
                       description="Report what crashed workers left behind and run serve's start checks "
                                   "(available memory, RLIMIT_MEMLOCK) against a geometry. Exit status 0 when "
                                   "healthy, 1 when a problem remains.")
    d.add_argument("--clean", action="store_true",
                   help="remove stale regions, lock files and sockets (never a live worker's)")
    d.add_argument("--slots", default=DEFAULT_GEOMETRY.spec(),
                   help="slot geometry to check available memory and memlock against (default %(default)s)")

    sub.add_parser("bench", help="latency/bandwidth benchmarks (shmrpc bench --help)", add_help=False)
    return p


def _add_observability_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("metrics and logs")
    g.add_argument("--metrics-port", type=_port, default=None,
                   help="serve /metrics and /healthz over HTTP on this port (0: any free one, logged at start; "
                        "default: no HTTP server)")
    g.add_argument("--metrics-addr", default="127.0.0.1",
                   help="address for --metrics-port (default %(default)s), or unix:PATH for a Unix socket of "
                        "mode 0600 (no port needed)")
    g.add_argument("--metrics-token-file", metavar="PATH",
                   help="require 'Authorization: Bearer <token>' on /metrics, the token read from PATH "
                        "(mode 0600; /healthz stays open)")
    g.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="log lines as text or as one JSON object per line (default %(default)s)")
    g.add_argument("--otel", action="store_true",
                   help="OpenTelemetry spans for requests whose client traces them (the otel extra; exporter "
                        "from OTEL_TRACES_EXPORTER, default otlp)")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {port}")
    return port


def _uid(text: str) -> int:
    try:
        uid = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a uid (a number), got {text!r}") from None
    if not 0 <= uid < (1 << 32) - 1:  # (uid_t)-1 is no uid: chown's "leave it"
        raise argparse.ArgumentTypeError(f"a uid is 0..4294967294, got {uid}")
    return uid


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    if value > _TIMEOUT_MAX_S:  # (a socket's timeout must fit the platform's time_t: 1e308 failed at run time)
        raise argparse.ArgumentTypeError(f"must be at most {_TIMEOUT_MAX_S:.0f} seconds, got {text!r}")
    return value


_TIMEOUT_MAX_S = 1e6


def _named(flag: str, parse: Any, text: str) -> Any:
    """``parse(text)``, its ValueError naming ``flag``."""
    try:
        return parse(text)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """``serve --devices``: the other arguments go to every worker unchanged (server/_supervisor.py)."""
    from ._supervisor import Supervisor, parse_devices

    if args.device is not None:
        raise UsageError("shmrpc serve: --device and --devices exclude each other (see shmrpc serve --help)")
    try:
        devices = parse_devices(args.devices)
    except ValueError as e:
        raise UsageError(f"shmrpc serve: {e}") from None
    rest, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if i == 0 and a == "serve":
            continue
        if a in ("--devices", "--name", "--metrics-port"):
            skip = True
            continue
        if a.startswith(("--devices=", "--name=", "--metrics-port=")):
            continue
        rest.append(a)
    sup = Supervisor(args.name, devices, rest, metrics_port=args.metrics_port)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # (SIGHUP as a worker takes it: no reload)
        signal.signal(sig, sup.stop)
    return sup.run()


def _serve(args: argparse.Namespace) -> int:
    from shmrpc.schema.layout import parse_size

    supervisor = os.environ.pop("SHMRPC_SUPERVISOR_PID", "")
    if supervisor:  # started by `serve --devices`: end with it (server/_supervisor.py)
        from ._attach import set_parent_death_signal

        set_parent_death_signal(signal.SIGTERM)
        if str(os.getppid()) != supervisor:  # it died before the request took
            print("shmrpc serve: the supervisor that started this worker is gone", file=sys.stderr)
            return EXIT_FAILURE

    if args.device is not None:
        if args.device < 0:
            print("shmrpc serve: --device must be >= 0", file=sys.stderr)
            return EXIT_USAGE
        # before anything imports CuPy: the worker then sees this one GPU, as its device 0
        os.environ["CUDA_VISIBLE_DEVICES"] = str(args.device)

    if args.cpus is not None:  # before the worker's threads start: they inherit the set
        from .config import parse_cpus, pin_process
        try:
            pin_process(parse_cpus(args.cpus))
        except (ValueError, OSError) as e:
            why = e if isinstance(e, ValueError) else f"--cpus {args.cpus}: not CPUs this process may use " \
                f"({sorted(os.sched_getaffinity(0))}): {e.strerror}"
            print(f"shmrpc serve: {why}", file=sys.stderr)
            return EXIT_USAGE

    from ._http import read_token
    from ._logs import setup_logging
    from ._loop import Worker
    from .checks import StartupError
    from .config import DEFAULT_LEASE, DEFAULT_LEASE_MAX, WorkerConfig, parse_lease

    try:
        token = read_token(args.metrics_token_file) if args.metrics_token_file else None
        geometry = _named("--slots", parse_geometry, args.slots)
        lease = parse_lease(args.lease) if args.lease else DEFAULT_LEASE[: len(geometry.classes)]
        lease_max = parse_lease(args.lease_max, "--lease-max") if args.lease_max else DEFAULT_LEASE_MAX
        if args.lease_max and len(lease_max) > len(geometry.classes):
            raise ValueError(f"--lease-max names {len(lease_max)} classes but --slots has {len(geometry.classes)}")
        cfg = WorkerConfig(
            name=args.name, geometry=geometry, lease=lease, backend=args.backend, metrics_port=args.metrics_port,
            mlock=not args.no_mlock, threads=args.threads, inline_max_nbytes=_named("--inline-max", parse_size, args.inline_max),
            spin_us=args.spin_us, lane_linger_us=args.lane_linger_us, lanes=not args.no_lanes, max_batch=args.max_batch,
            batch_wait_us=args.batch_wait_us, io_threads=args.io_threads,
            resident_limit_bytes=_named("--resident-limit", parse_size, args.resident_limit), allow_uids=tuple(args.allow_uid), register_host=not args.no_register,
            dumpable=args.dumpable,
            isolation=args.isolation, client_max_slots=args.client_max_slots,
            client_max_bytes=_named("--client-max-bytes", parse_size, args.client_max_bytes),
            lease_max=lease_max,
            max_clients=args.max_clients, max_clients_per_uid=args.max_clients_per_uid,
            request_memory_limit_bytes=_named("--request-memory-limit", parse_size, args.request_memory_limit),
            inline_max_flops=args.inline_max_flops, client_max_waiters=args.client_max_waiters,
            op_budget_s=args.op_budget,
            metrics_addr=args.metrics_addr, metrics_token=token, otel=args.otel,
            inject_fault=os.environ.get("SHMRPC_INJECT_FAULT") or None,  # tests only (WorkerConfig.inject_fault)
        )
    except ValueError as e:
        print(f"shmrpc serve: {e}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(args.log_level, args.log_format)
    from ._plugins import OpLoadError, load_ops, parse_ops

    try:  # before the worker exists: its dispatcher and op table see users' ops like built-ins
        load_ops(parse_ops(args.ops) if args.ops is not None else ())  # --ops "" is a usage error, as --ops " "
    except ValueError as e:
        print(f"shmrpc serve: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OpLoadError as e:
        print(f"shmrpc serve: {e}", file=sys.stderr)
        return EXIT_FAILURE
    worker = Worker(cfg)
    worker.install_signal_handlers()
    try:
        worker.start()
    except StartupError as e:
        print(f"shmrpc serve: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as e:  # backend unavailable and similar: one line, not a traceback
        print(f"shmrpc serve: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILURE
    # What the worker made to start (modules, the op table, the backend, the regions' objects) lives as long as the
    # process: out of the collector's sight, so that a full collection, which the caches' turnover under many new
    # signatures brings every few seconds, walks only what came after (the longest of these pauses of the loop 11.5
    # -> 5.5 ms on the development machine, bench/gc_pauses.py; docs/benchmarks.md). In the daemon's process only.
    gc.collect()
    gc.freeze()
    try:
        metrics = f", metrics {worker.metrics.url}/metrics" if worker.metrics.url else ""
        print(f"shmrpc worker {cfg.name} ready (pid {os.getpid()}, backend {worker.backend.name}{metrics})",
              flush=True)
        worker.serve_forever()
    finally:
        worker.close()
    if worker.dispatch.fatal:
        print(f"shmrpc serve: stopped after an unrecoverable backend error: {worker.dispatch.fatal}", file=sys.stderr)
        return EXIT_BACKEND
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from shmrpc.schema.naming import device_workers, validate_name

    try:
        validate_name(args.name)
    except ValueError as e:
        raise UsageError(f"shmrpc status: --name: {e}") from None
    quiet = args.quiet

    def fail(text: str) -> int:
        if not quiet:
            print(f"shmrpc status: {text}", file=sys.stderr)
        return EXIT_FAILURE

    names = device_workers(args.name) if args.devices else [args.name]
    if not names:
        return fail(f"no workers of the supervisor {args.name!r} (serve --devices: {args.name}-<device>)")
    states = {}
    for name in names:
        state = _ask_state(name, args.timeout_s)
        if isinstance(state, str):
            return fail(state)
        states[name] = state
    # answered, but not ready (stopping, or its backend failed): exit 1; every worker of a supervisor must be ready
    status = EXIT_OK if all(st.get("health", "ok") == "ok" for st in states.values()) else EXIT_FAILURE
    if quiet:
        return status
    if args.json:
        print(json.dumps(states if args.devices else states[args.name], indent=2))
        return status
    print("\n\n".join("\n".join(status_text(st)) for st in states.values()))
    return status


def _ask_state(name: str, timeout_s: float) -> dict[str, Any] | str:
    """Worker ``name``'s STATE as JSON, or why there is none (one line)."""
    import socket

    from shmrpc.schema import messages as m
    from shmrpc.schema.naming import attach_path

    path = attach_path(name)
    try:
        if not path.exists():
            return f"no worker named {name!r} ({path} does not exist)"
    except PermissionError:
        return (f"cannot look into {path.parent} as uid {os.getuid()}: the worker's runtime directory is not "
                "yours (STATUS is answered to the worker's uid and root only)")
    # On the attach socket, where the worker answers STATUS to its own uid (and root) only, by SO_PEERCRED.
    # A plain Unix socket: a dead worker's leftover file refuses the connection at once, nothing can hang.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(str(path))
            sock.send(m.STATUS)
            frame = sock.recv(m.ATTACH_MAX_NBYTES)
        except TimeoutError:
            return f"worker {name!r} did not answer in {timeout_s} s"
        except ConnectionRefusedError:
            return f"no worker listens on {path} (a worker that died leaves its socket: shmrpc doctor --clean)"
        except OSError as e:
            return f"cannot reach worker {name!r} at {path}: {e}"
    if frame[:1] != m.STATE:
        try:
            why = str(m.unpack_json(frame).get("message", "")) if frame[:1] == m.ERROR else ""
        except ValueError:
            why = ""
        return f"worker {name!r} refused: {why or repr(frame[1:200])}"
    state: dict[str, Any] = m.unpack_json(frame)
    return state


def status_text(state: dict[str, Any]) -> list[str]:
    """The lines ``shmrpc status`` prints for a worker's STATE (its JSON)."""
    out = []
    health = state.get("health", "ok")
    if health != "ok":
        out.append(f"NOT READY: {health}")
    out.append(f"worker {state['name']}  pid {state['pid']}  backend {state['backend']}  up {state['uptime_s']:.1f} s")
    out.append(f"socket {state['socket']}")
    for r in state["regions"]:
        out.append(f"region {r['index']}: {r['name']}  {format_size_approx(r['nbytes'])}  slots {r['slots']}  "
                   f"mlocked={r['mlocked']}")
    out.append(f"clients {len(state['clients'])}  slots leased {state['slots_leased']}  in flight "
               f"{state['in_flight']}  waiting acquires {state['pending_acquires']}")
    for c in state["clients"]:
        slots = c["slots"]  # a count instead of the list where the STATE was cut to fit its packet ("truncated")
        n_slots, in_flight = (slots, c.get("in_flight", "?")) if isinstance(slots, int) else (
            len(slots), sum(1 for s in slots if s[4]))
        out.append(f"  client {c['id']} pid {c['pid']} uid {c['uid']}: {n_slots} slots, {in_flight} in flight")
    ops = state.get("ops", {})
    users = [f"{n} ({o['code']}, {'/'.join(o['backends'])})" for n, o in ops.items() if not o["builtin"]]
    out.append(f"ops {len(ops)}: {', '.join(ops)}")  # every op, by code: the built-ins, then users' (detailed below)
    if users:
        out.append(f"users' ops: {', '.join(users)}")
    resident = state.get("resident", {})
    n = state.get("resident_count", len(resident))
    out.append(f"resident tensors {n}" + (": " if resident else "") + ", ".join(
        f"{k} ({t['dtype']} {'x'.join(map(str, t['shape'])) or 'scalar'})" for k, t in list(resident.items())[:_LISTED])
        + (f", and {n - _LISTED} more (--json lists {len(resident)})" if n > _LISTED else ""))
    counters = state["counters"]
    for key in sorted(counters):
        out.append(f"  {key} = {_counter_text(counters[key])}")
    return out


_LISTED = 20  # resident tensors named in status's text


def _counter_text(v: Any) -> str:
    """A STATE counter for people: a whole number without ``.0``, a table by op as ``op: value``, ``-`` when empty
    (``--json`` gives them as they are)."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_counter_text(x)}" for k, x in v.items()) if v else "-"
    return str(v)


def _doctor(args: argparse.Namespace) -> int:
    from .checks import WITH_FIRST_CLIENT
    from .config import DEFAULT_LEASE, WorkerConfig
    from .doctor import doctor

    try:
        geometry = parse_geometry(args.slots)
    except ValueError as e:
        raise UsageError(f"shmrpc doctor: --slots: {e}") from None
    # what serve's start checks count: the pool and one client's own region at the default --lease
    first = WorkerConfig("doctor", geometry=geometry, lease=DEFAULT_LEASE[: len(geometry.classes)]).first_client_nbytes()
    return doctor(clean=args.clean, region_nbytes=geometry.region_nbytes + first,
                  what_for=WITH_FIRST_CLIENT if first else "")


def _run(argv: list[str]) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # named by the command they were given to ("shmrpc doctor: ..."), as its own errors are
        raise UsageError(f"shmrpc {args.command}: unrecognized arguments: {' '.join(extra)} "
                         f"(see shmrpc {args.command} --help)")
    if args.command == "serve" and args.devices is not None:
        return _supervise(args, argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        return _status(args)
    if args.command == "doctor":
        return _doctor(args)
    raise UsageError("shmrpc bench is the shmrpc.bench package: run `shmrpc bench` or `python -m shmrpc.bench`")


def main(argv: list[str] | None = None) -> int:
    """Run ``serve``, ``status`` or ``doctor`` with ``argv``; returns the exit status (see the module docstring).

    Bad arguments print one line on stderr and return 2; ``--help`` and ``--version`` return 0.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(argv)
    except UsageError as e:
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - a command ends with one line, never a traceback
        logging.getLogger("shmrpc").debug("unexpected error", exc_info=True)
        print(f"shmrpc: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILURE


def _quiet_stdout() -> None:
    """After a reader closed our stdout (``| head``): point it at /dev/null so the flush at exit is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass

