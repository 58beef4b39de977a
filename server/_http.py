"""The worker's small HTTP endpoint: ``/metrics`` (Prometheus text) and ``/healthz`` (readiness).

Where it listens (``--metrics-addr``):

* a host address, ``127.0.0.1`` by default, with ``--metrics-port`` (0 picks a free port);
* ``unix:PATH``: a Unix socket created with mode ``0600`` (only the worker's uid can connect),
  removed on shutdown if it is still this worker's. Scrape it with
  ``curl --unix-socket PATH http://localhost/metrics``. Only a stale socket at PATH (one nobody listens on:
  left by a worker that died) is replaced; a live one (another worker's) or anything else there (a file)
  refuses the start.

With a token (``--metrics-token-file``), ``/metrics`` answers 401 unless the request carries
``Authorization: Bearer <token>``. ``/healthz`` is always open: it says only ``ok`` or why not,
no counts, so an orchestrator can probe it without the token.

The endpoint is reachable by every local user on 127.0.0.1, and each open connection holds one of the worker's
file descriptors: at most :data:`MAX_CONNECTIONS` are served at once, each is closed
:data:`CONNECTION_TIMEOUT_S` after it was accepted, and a connection that would leave the worker fewer than
:data:`FD_RESERVE` descriptors is closed at once (libzmq aborts the worker when its accept finds none left).
Refused connections are closed without an answer and logged at WARNING, rate-limited.
"""

from __future__ import annotations

import errno
import hmac
import http.server
import logging
import os
import socket
import socketserver
import stat
import threading
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from ._logs import RateLimited
from .procs import fds_open_and_limit

__all__ = ["MetricsServer", "parse_addr", "read_token", "clear_stale_socket", "MAX_CONNECTIONS",
           "CONNECTION_TIMEOUT_S", "FD_RESERVE"]

log = logging.getLogger("shmrpc.server")

#: Connections served at once; one more is closed at once (a scrape and a health probe need one each).
MAX_CONNECTIONS = 16
#: A connection is closed this long after it was accepted, whatever it is doing (an idle one, or one dribbling bytes).
CONNECTION_TIMEOUT_S = 10.0
#: A connection that would leave the process fewer file descriptors than this under its RLIMIT_NOFILE is closed at
#: once: they are the worker's (``_sessions.FD_HEADROOM``, 64, is what a HELLO leaves free; this is half of it).
FD_RESERVE = 32
#: After an accept failed for want of fds or memory, the server waits this long before it accepts again.
_ACCEPT_BACKOFF_S = 0.2
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

#: ``() -> (ready, reason)`` for ``/healthz``.
HealthFn = Callable[[], "tuple[bool, str]"]


def parse_addr(text: str) -> tuple[str, str]:
    """``"127.0.0.1"`` -> ``("tcp", "127.0.0.1")``; ``"unix:/run/x.sock"`` -> ``("unix", "/run/x.sock")``.

    Raises:
        ValueError: an empty host or a relative Unix socket path.
    """
    if text.startswith("unix:"):
        path = text[5:]
        if not path.startswith("/"):
            raise ValueError(f"--metrics-addr unix:PATH needs an absolute path, got {text!r}")
        return "unix", path
    if not text or any(c.isspace() for c in text) or "/" in text:
        raise ValueError(f"--metrics-addr must be a host address or unix:PATH, got {text!r}")
    return "tcp", text


def read_token(path: str) -> str:
    """The bearer token in ``path`` (first line, stripped).

    Raises:
        ValueError: the file cannot be read, is empty, or other users may read it.
    """
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except OSError as e:
        raise ValueError(f"--metrics-token-file {path}: {e.strerror or e}") from None
    if st.st_mode & 0o077:
        raise ValueError(f"--metrics-token-file {path} is readable by others (mode {st.st_mode & 0o777:o}): "
                         f"chmod 600 {path}")
    if len(token) < 16:
        raise ValueError(f"--metrics-token-file {path} holds no token of at least 16 characters")
    return token


def clear_stale_socket(path: str) -> None:
    """Make room for a Unix socket at ``path``: remove a stale socket there (nobody listens on it: a worker that
    died left it), nothing else.

    Raises:
        OSError: ``path`` is not a socket (a file, a directory ...), a process listens on it, or it cannot be
            examined; its ``strerror`` names the path and says why.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket: remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except ConnectionRefusedError:
        pass  # nobody listens: stale
    except FileNotFoundError:
        return
    except OSError as e:  # a full backlog, no permission: a live socket or one not ours to replace
        raise OSError(e.errno or errno.EADDRINUSE, f"{path} is a socket that cannot be checked ({e.strerror or e}): "
                      "choose another path") from None
    else:
        raise OSError(errno.EADDRINUSE, f"{path} is in use: a process listens on it (another worker's "
                      "--metrics-addr?); choose another path")
    finally:
        probe.close()
    os.unlink(path)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Any
    protocol_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.conn_timeout_s)  # each read and write (the server ends it at its deadline too)

    def do_GET(self) -> None:  # noqa: N802 - the http.server hook's name
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            ready, reason = self.server.health()
            self._reply(200 if ready else 503, (b"ok\n" if ready else reason.encode() + b"\n"), "text/plain")
        elif path in ("/metrics", "/"):
            token = self.server.token
            if token is not None:
                got = self.headers.get("Authorization", "")
                if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                    self._reply(401, b"a bearer token is required\n", "text/plain",
                                {"WWW-Authenticate": 'Bearer realm="shmrpc"'})
                    return
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._reply(200, encoder(self.server.registry), content_type)
        else:
            self._reply(404, b"not found: try /metrics or /healthz\n", "text/plain")

    def _reply(self, code: int, body: bytes, content_type: str, extra: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: scrapes are not events
        pass


class _Bounded(socketserver.ThreadingMixIn):
    """A threading server whose connections are bounded in number, in time and by the process's fds (see the module's
    text). ``max_connections``, ``conn_timeout_s`` and ``fd_reserve`` may be set per server (tests)."""

    daemon_threads = True
    request_queue_size = 64  # connections the kernel queues before the accept (they hold none of the worker's fds)
    max_connections = MAX_CONNECTIONS
    conn_timeout_s = CONNECTION_TIMEOUT_S
    fd_reserve = FD_RESERVE

    def __init__(self, *args: Any, **kw: Any) -> None:
        self._open: dict[Any, float] = {}  # connection -> deadline (inf once it was shut)
        self._open_lock = threading.Lock()
        self.refused = 0  # connections closed at once
        self._refusals = RateLimited(log, rate_per_s=0.1, burst=1, level=logging.WARNING)
        super().__init__(*args, **kw)

    def get_request(self) -> Any:
        try:
            return super().get_request()  # type: ignore[misc]
        except OSError as e:
            if e.errno in _OUT_OF:  # the connection stays queued and the socket readable: not again at once
                self._refusals.log("metrics endpoint: accept failed: %s; accepting again in %.1f s", e,
                                   _ACCEPT_BACKOFF_S, extra={"event": "metrics_connection_refused"})
                time.sleep(_ACCEPT_BACKOFF_S)
            raise

    def verify_request(self, request: Any, client_address: Any) -> bool:
        with self._open_lock:
            n = len(self._open)
        why = ""
        if n >= self.max_connections:
            why = f"{n} connections open, at most {self.max_connections}"
        else:
            fds, limit = fds_open_and_limit()
            if limit is not None and fds + self.fd_reserve > limit:
                why = (f"the worker has {fds} file descriptors open of its limit of {limit} (RLIMIT_NOFILE) and "
                       f"keeps {self.fd_reserve} from this endpoint")
        if not why:
            return True
        self.refused += 1
        self._refusals.log("metrics endpoint: closed a connection at once: %s", why,
                           extra={"event": "metrics_connection_refused"})
        return False  # the caller closes it

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open[request] = time.monotonic() + self.conn_timeout_s
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:  # (forgotten before it is closed: service_actions never shuts a number reused since)
            self._open.pop(request, None)
        super().shutdown_request(request)  # type: ignore[misc]

    def service_actions(self) -> None:
        """End the connections past their deadline (serve_forever calls it at least every 0.5 s): their handler's
        read or write returns, and its thread closes the connection."""
        now = time.monotonic()
        with self._open_lock:
            for conn, deadline in self._open.items():
                if deadline <= now:
                    self._open[conn] = float("inf")
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def shut_all(self) -> None:
        """End every open connection (the server is closing)."""
        with self._open_lock:
            for conn in self._open:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @property
    def n_open(self) -> int:
        with self._open_lock:
            return len(self._open)


class _TCPServer(_Bounded, http.server.HTTPServer):
    allow_reuse_address = True


class _UnixServer(_Bounded, socketserver.UnixStreamServer):
    def server_bind(self) -> None:
        old = os.umask(0o177)  # the socket is created 0600
        try:
            super().server_bind()
        finally:
            os.umask(old)


class MetricsServer:
    """``/metrics`` and ``/healthz`` served from a daemon thread.

    Args:
        registry: what ``/metrics`` exposes.
        health: ``() -> (ready, reason)`` for ``/healthz``.
        addr: a host address or ``unix:PATH`` (see the module docstring).
        port: TCP port (ignored for ``unix:``); 0 picks a free one.
        token: when set, ``/metrics`` requires ``Authorization: Bearer <token>``.

    Raises:
        OSError: the port is taken, the address is not local, or the socket path cannot be bound.
    """

    def __init__(self, registry: CollectorRegistry, health: HealthFn, addr: str = "127.0.0.1", port: int = 0,
                 token: str | None = None) -> None:
        kind, where = parse_addr(addr)
        self.unix_path: str | None = None
        server: Any
        self._unix_id: tuple[int, int] | None = None
        if kind == "unix":
            # the worker lock is per worker name, not per path: another worker may serve its metrics here
            clear_stale_socket(where)
            server = _UnixServer(where, _Handler)
            st = os.stat(where)
            self.unix_path, self._unix_id = where, (st.st_dev, st.st_ino)
            self.url = f"unix:{where}"
        else:
            server = _TCPServer((where, port), _Handler)
            host = f"[{where}]" if ":" in where else where
            self.url = f"http://{host}:{server.server_address[1]}"
        server.registry, server.health, server.token = registry, health, token
        self.port: int | None = None if kind == "unix" else int(server.server_address[1])
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="shmrpc-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving, free the port or remove the socket file (only while it is still this server's: the same
        file it bound, not one another process put there since)."""
        self._server.shutdown()
        self._server.shut_all()
        self._server.server_close()
        self._thread.join(timeout=5)
        if self.unix_path is not None:
            try:
                st = os.lstat(self.unix_path)
                if (st.st_dev, st.st_ino) == self._unix_id:
                    os.unlink(self.unix_path)
            except FileNotFoundError:
                pass
