"""Admission: how many clients the worker serves, and how large a region each one gets.

Both are decided from the handshake alone, before anything is created for the client:

- :meth:`Admission.admit` refuses a client over ``--max-clients`` (all uids) or over
  ``--max-clients-per-uid`` (its uid, which comes from the kernel, not from the HELLO) with
  :class:`~shmrpc.schema.errors.ClientLimitError`; the handshake answers it as an ERROR of
  kind ``too_many_clients``.
- :meth:`Admission.lease_for` turns the HELLO's optional ``lease`` (slots wanted per size
  class) into the lease granted: ``--lease`` when the client asks for nothing, else what it
  asks for, at most ``--lease-max`` per class. The client's private region holds exactly
  that lease, so a client that never needs a large slot never pins one.

Memory one uid can make the worker pin through handshakes is therefore at most
``max_clients_per_uid x`` the region of a ``--lease-max`` lease.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from shmrpc.schema.errors import ClientLimitError

from .config import WorkerConfig

__all__ = ["Admission"]


class Admission:
    """Client counts per uid, checked against the worker's caps."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._by_uid: Counter[int] = Counter()

    @property
    def n_clients(self) -> int:
        """Clients admitted and not yet gone."""
        return sum(self._by_uid.values())

    def admit(self, uid: int) -> None:
        """Check that one more client of ``uid`` fits the caps.

        Raises:
            ClientLimitError: naming the cap (``--max-clients`` or ``--max-clients-per-uid``; its ``field``:
                ``max_clients`` or ``max_clients_per_uid``, the refusal's reason in the worker's metrics).
        """
        cfg = self.config
        if cfg.max_clients and self.n_clients >= cfg.max_clients:
            raise ClientLimitError(f"the worker serves {self.n_clients} clients, the most it may (--max-clients "
                                   f"{cfg.max_clients}); close an idle client or raise the limit",
                                   field="max_clients")
        if cfg.max_clients_per_uid and self._by_uid[uid] >= cfg.max_clients_per_uid:
            raise ClientLimitError(f"uid {uid} has {self._by_uid[uid]} clients connected, the most one uid may "
                                   f"(--max-clients-per-uid {cfg.max_clients_per_uid}); close an idle client "
                                   "or raise the limit", field="max_clients_per_uid")

    def joined(self, uid: int) -> None:
        """A client of ``uid`` was admitted."""
        self._by_uid[uid] += 1

    def left(self, uid: int) -> None:
        """A client of ``uid`` is gone."""
        self._by_uid[uid] -= 1
        if self._by_uid[uid] <= 0:
            del self._by_uid[uid]

    def lease_for(self, asked: Any) -> tuple[int, ...]:
        """The lease granted for a HELLO's ``lease`` field (None: the default ``--lease``).

        Raises:
            ValueError: ``asked`` is not a list of counts >= 0.
        """
        cfg = self.config
        if asked is None:
            return cfg.lease
        if not isinstance(asked, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                  for n in asked):
            raise ValueError("lease must be a list of slot counts >= 0, one per size class")
        padded = (list(asked) + [0] * len(cfg.lease_max))[: len(cfg.lease_max)]
        return tuple(min(n, most) for n, most in zip(padded, cfg.lease_max))
