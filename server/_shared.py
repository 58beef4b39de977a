"""Owners of ``shared/`` resident tensors.

Policy: the client whose request first keeps a ``shared/<name>`` tensor owns it. Every
client of the worker may read it (name it as a resident input); only its owner may replace
it (keep an output under that name again) or drop it; another client's attempt is refused
with :class:`~shmrpc.schema.errors.InvalidRequestError` naming the tensor and the owner. When
the owner's lease ends (BYE, its process dies, heartbeats stop), its shared tensors are
dropped with its private ones, so a dead client leaves nothing counting against
``--resident-limit``. To publish tensors for longer, keep the publishing client connected.
"""

from __future__ import annotations

from collections.abc import Iterable

from shmrpc.schema.errors import InvalidRequestError

__all__ = ["SharedOwners"]

SHARED_PREFIX = "shared/"


class SharedOwners:
    """``shared/`` resident name -> the client id that owns it."""

    def __init__(self) -> None:
        self._owner: dict[str, int] = {}

    def check(self, client: int, name: str, field: str) -> None:
        """Raise InvalidRequestError when ``name`` is shared and owned by a client other than ``client``."""
        owner = self._owner.get(name)
        if owner is not None and owner != client:
            raise InvalidRequestError(
                f"shared tensor {name!r} belongs to client {owner}; only its owner may replace or drop it "
                "(it goes when its owner disconnects)", tensor=name, field=field)

    def claim(self, client: int, names: Iterable[str]) -> None:
        """Make ``client`` the owner of the shared ones among ``names`` (resident names a request keeps).

        Raises:
            InvalidRequestError: one of them is owned by another client (nothing is claimed then).
        """
        shared = [n for n in names if n.startswith(SHARED_PREFIX)]
        for n in shared:
            self.check(client, n, "keep")
        for n in shared:
            self._owner[n] = client

    def forget(self, name: str) -> None:
        """``name`` was dropped."""
        self._owner.pop(name, None)

    def release(self, client: int) -> list[str]:
        """Forget every name ``client`` owns and return them (its lease ended)."""
        mine = [n for n, o in self._owner.items() if o == client]
        for n in mine:
            del self._owner[n]
        return mine

    def owner(self, name: str) -> int | None:
        """The client owning ``name``, or None."""
        return self._owner.get(name)
