"""The ``shmrpc`` command: ``serve``, ``status``, ``doctor``, ``bench``.

Examples::

    shmrpc serve --name demo                      # worker with the default region (~988 MiB)
    shmrpc serve --name t --slots 64K:8,1M:2 --backend numpy --metrics-port 9464
    shmrpc status --name demo                     # regions, leases, in-flight requests, counters
    shmrpc doctor [--clean]                       # stale regions/sockets, /dev/shm and memlock checks
    shmrpc bench lat --peers                      # latency next to pyzmq, pipes, gRPC
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from shmrpc.schema.layout import DEFAULT_GEOMETRY, parse_geometry

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``shmrpc`` command."""
    p = argparse.ArgumentParser(prog="shmrpc", description="Zero-copy RPC for array compute on one host.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run a worker")
    s.add_argument("--name", required=True, help="worker name; clients find the worker by it")
    s.add_argument("--slots", default=DEFAULT_GEOMETRY.spec(),
                   help="slot size classes SIZE:COUNT, smallest first (default %(default)s)")
    s.add_argument("--lease", default=None,
                   help="slots of each class leased to a client that asks for none, e.g. 4,2,0,0,0 (default)")
    s.add_argument("--backend", choices=("auto", "numpy", "cupy"), default="auto")
    s.add_argument("--metrics-port", type=int, default=None, help="Prometheus HTTP port on 127.0.0.1 (0: any)")
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
    s.add_argument("--threads", type=int, default=4, help="executor threads for larger requests")
    s.add_argument("--inline-max", default="256K",
                   help="requests touching at most this many bytes (inputs, intermediates, outputs) and at most "
                        "--inline-max-flops may run on the loop thread (default %(default)s)")
    s.add_argument("--spin-us", type=int, default=0,
                   help="poll this many µs without sleeping before blocking (lower latency, a busy core; 0: off)")
    s.add_argument("--resident-limit", default="8G", help="cap on resident tensors")
    s.add_argument("--allow-uid", type=int, action="append", default=[],
                   help="another uid that may connect (its clients pass worker_uid=<this worker's uid>)")
    s.add_argument("--dumpable", action="store_true",
                   help="stay dumpable (for a debugger or profiler); by default the worker makes itself "
                        "non-dumpable so other processes of its uid cannot reach the regions through /proc")
    b = s.add_argument_group("bounds", "what one client or one request may cost the worker (0: no limit)")
    b.add_argument("--lease-max", default=None,
                   help="most slots of each class a client may ask for in its HELLO (default 4,2,1,1,0)")
    b.add_argument("--max-clients", type=int, default=64, help="clients connected at once (default %(default)s)")
    b.add_argument("--max-clients-per-uid", type=int, default=16,
                   help="clients of one uid connected at once (default %(default)s)")
    b.add_argument("--request-memory-limit", default="2G",
                   help="bytes of intermediates and outputs one request may need (default %(default)s)")
    b.add_argument("--inline-max-flops", type=int, default=8_000_000,
                   help="estimated FLOPs up to which a request may run on the loop thread (default %(default)s)")
    b.add_argument("--client-max-waiters", type=int, default=4,
                   help="ACQUIREs one client may have waiting for a slot (default %(default)s)")
    s.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))

    st = sub.add_parser("status", help="show a worker's regions, leases, in-flight requests and counters")
    st.add_argument("--name", required=True)
    st.add_argument("--timeout-s", type=float, default=3.0)
    st.add_argument("--json", action="store_true", help="print the raw JSON")

    d = sub.add_parser("doctor", help="find (and with --clean remove) stale regions and sockets; check limits")
    d.add_argument("--clean", action="store_true")
    d.add_argument("--slots", default=DEFAULT_GEOMETRY.spec(), help="geometry to check /dev/shm and memlock against")

    sub.add_parser("bench", help="latency/bandwidth benchmarks (shmrpc bench --help)", add_help=False)
    return p


def _serve(args: argparse.Namespace) -> int:
    from shmrpc.schema.layout import parse_size

    from ._loop import Worker
    from .checks import StartupError
    from .config import DEFAULT_LEASE, DEFAULT_LEASE_MAX, WorkerConfig, parse_lease

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        geometry = parse_geometry(args.slots)
        lease = parse_lease(args.lease) if args.lease else DEFAULT_LEASE[: len(geometry.classes)]
        cfg = WorkerConfig(
            name=args.name, geometry=geometry, lease=lease, backend=args.backend, metrics_port=args.metrics_port,
            mlock=not args.no_mlock, threads=args.threads, inline_max_nbytes=parse_size(args.inline_max),
            spin_us=args.spin_us,
            resident_limit_bytes=parse_size(args.resident_limit), allow_uids=tuple(args.allow_uid), register_host=not args.no_register,
            dumpable=args.dumpable,
            isolation=args.isolation, client_max_slots=args.client_max_slots,
            client_max_bytes=parse_size(args.client_max_bytes),
            lease_max=parse_lease(args.lease_max) if args.lease_max else DEFAULT_LEASE_MAX,
            max_clients=args.max_clients, max_clients_per_uid=args.max_clients_per_uid,
            request_memory_limit_bytes=parse_size(args.request_memory_limit),
            inline_max_flops=args.inline_max_flops, client_max_waiters=args.client_max_waiters,
        )
    except ValueError as e:
        print(f"shmrpc serve: {e}", file=sys.stderr)
        return 2
    worker = Worker(cfg)
    worker.install_signal_handlers()
    try:
        worker.start()
    except StartupError as e:
        print(f"shmrpc serve: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # backend unavailable and similar: one line, not a traceback
        print(f"shmrpc serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        print(f"shmrpc worker {cfg.name} ready (pid {__import__('os').getpid()}, backend {worker.backend.name})",
              flush=True)
        worker.serve_forever()
    finally:
        worker.close()
    if worker.dispatch.fatal:
        print(f"shmrpc serve: stopped after an unrecoverable backend error: {worker.dispatch.fatal}", file=sys.stderr)
        return 3
    return 0


def _status(args: argparse.Namespace) -> int:
    import socket

    from shmrpc.schema import messages as m
    from shmrpc.schema.naming import attach_path

    path = attach_path(args.name)
    if not path.exists():
        print(f"shmrpc status: no worker named {args.name!r} ({path} does not exist)", file=sys.stderr)
        return 1
    # On the attach socket, where the worker answers STATUS to its own uid (and root) only, by SO_PEERCRED.
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(args.timeout_s)
        try:
            sock.connect(str(path))
            sock.send(m.STATUS)
            frame = sock.recv(m.ATTACH_MAX_NBYTES)
        except TimeoutError:
            print(f"shmrpc status: worker {args.name!r} did not answer in {args.timeout_s} s", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"shmrpc status: cannot reach worker {args.name!r} at {path}: {e}", file=sys.stderr)
            return 1
    if frame[:1] != m.STATE:
        print(f"shmrpc status: worker {args.name!r} refused: {frame[1:200]!r}", file=sys.stderr)
        return 1
    state = m.unpack_json(frame)
    if args.json:
        print(json.dumps(state, indent=2))
        return 0
    print(f"worker {state['name']}  pid {state['pid']}  backend {state['backend']}  up {state['uptime_s']:.1f} s")
    print(f"socket {state['socket']}")
    for r in state["regions"]:
        print(f"region {r['index']}: {r['name']}  {r['nbytes'] >> 20} MiB  slots {r['slots']}  mlocked={r['mlocked']}")
    print(f"clients {len(state['clients'])}  slots leased {state['slots_leased']}  in flight {state['in_flight']}"
          f"  waiting acquires {state['pending_acquires']}")
    for c in state["clients"]:
        print(f"  client {c['id']} pid {c['pid']} uid {c['uid']}: {len(c['slots'])} slots, "
              f"{sum(1 for s in c['slots'] if s[4])} in flight")
    counters = state["counters"]
    for key in sorted(counters):
        print(f"  {key} = {counters[key]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shmrpc`` command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from shmrpc.client.bench import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        return _status(args)
    if args.command == "doctor":
        from .doctor import doctor

        return doctor(clean=args.clean, region_nbytes=parse_geometry(args.slots).region_nbytes)
    return 2
