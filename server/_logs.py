"""The worker's logging: text or JSON lines, and a rate limit for lines a client can cause.

``--log-format json`` writes one JSON object per line (``ts``, ``level``, ``logger``, ``msg``,
plus the structured fields of the event, e.g. ``client_pid``, ``op``, ``error``, ``field`` for a
failed request), for log shippers that parse fields rather than text.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

__all__ = ["JsonFormatter", "RateLimited", "setup_logging", "LOG_FORMATS"]

LOG_FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_STD_ATTRS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; extra fields passed with ``extra={...}`` become keys."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once for the ``shmrpc serve`` process (stderr)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)


class RateLimited:
    """A token bucket in front of the failed-request log lines, so a hostile client cannot flood the log.

    Up to ``burst`` lines at once, then ``rate_per_s`` per second; the lines held back are counted
    and reported in the next line that gets through (``suppressed``).

    Besides the failed-request lines (:meth:`failed`), :meth:`log` writes any line a peer can cause again and again
    (a refused HELLO, a refused metrics connection) under its own bucket.

    Args:
        logger: where the lines go (at ``level``).
        rate_per_s: sustained lines per second.
        burst: lines allowed at once.
        level: the lines' level (INFO by default).
    """

    def __init__(self, logger: logging.Logger, rate_per_s: float = 5.0, burst: int = 20,
                 level: int = logging.INFO) -> None:
        self.logger = logger
        self.level = level
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        self.suppressed = 0
        self._lock = threading.Lock()

    def allow(self) -> bool:
        """Take a token if one is left (counting the refusal otherwise)."""
        if not self.logger.isEnabledFor(self.level):
            return False
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate_per_s)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            self.suppressed += 1
            return False

    def emit(self, client_pid: int, op: str, error: str, field: str, message: str) -> None:
        """Write the line for one failed request (call after :meth:`allow` said yes)."""
        with self._lock:
            suppressed, self.suppressed = self.suppressed, 0
        extra = {"event": "request_failed", "client_pid": client_pid, "op": op, "error": error,
                 "field": field, "suppressed": suppressed}
        more = f" ({suppressed} similar lines suppressed)" if suppressed else ""
        # pid 0: a doorbell of no session (a client of an earlier worker of this name, which ZeroMQ reconnected here)
        who = f"client pid {client_pid}" if client_pid > 0 else "no session (a client of an earlier worker?)"
        self.logger.info("request failed: %s op %s error %s field %s: %.200r%s",
                         who, op, error, field or "-", message, more, extra=extra)

    def failed(self, client_pid: int, op: str, error: str, field: str, message: str) -> None:
        """:meth:`allow` then :meth:`emit`."""
        if self.allow():
            self.emit(client_pid, op, error, field, message)

    def log(self, msg: str, *args: Any, extra: dict[str, Any] | None = None) -> bool:
        """Write one line (``msg % args``, at the limiter's level) if a token is left; the lines held back before it
        are counted in it (`` (N similar lines suppressed)``, field ``suppressed``). Whether it was written."""
        if not self.allow():
            return False
        with self._lock:
            suppressed, self.suppressed = self.suppressed, 0
        more = f" ({suppressed} similar lines suppressed)" if suppressed else ""
        self.logger.log(self.level, msg + "%s", *args, more, extra={**(extra or {}), "suppressed": suppressed})
        return True
