"""Loading users' op modules at worker start: ``--ops MODULE[,MODULE]`` and the ``shmrpc.ops`` entry points.

A module defines its ops with :func:`shmrpc.kernels.api.register_op` when it is imported.
The worker imports every module before it creates its dispatcher and announces its op
table, so users' ops are in the WELCOME like built-ins. An entry point of the group
``shmrpc.ops`` names a module (``myops = "mypkg.ops"``) or a function of no arguments
that registers ops (``myops = "mypkg.ops:register"``).

Anything wrong stops the start with :class:`OpLoadError`, whose message is one line naming
the module and the reason: the module does not import, it raises while importing, or an op
in it has an invalid spec or clashes with another op (both named).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import sys
from collections.abc import Iterable

from shmrpc.kernels import REGISTRY
from shmrpc.kernels._errors import is_op_failure
from shmrpc.kernels.api import OpSpecError

__all__ = ["ENTRY_POINT_GROUP", "OpLoadError", "load_ops", "parse_ops"]

log = logging.getLogger("shmrpc.server")

#: The entry-point group an installed package lists its op modules in.
ENTRY_POINT_GROUP = "shmrpc.ops"


class OpLoadError(RuntimeError):
    """A users' op module could not be loaded; the worker does not start."""


def parse_ops(text: str) -> tuple[str, ...]:
    """``"a.b,c"`` -> ``("a.b", "c")``; raises ValueError for an empty or malformed module name."""
    mods = tuple(m.strip() for m in text.split(","))
    for i, m in enumerate(mods):
        if not m or not all(part.isidentifier() for part in m.split(".")):
            raise ValueError(f"--ops: {m!r} is not a module name (a.b.c); separate modules with commas")
        if m in mods[:i]:
            raise ValueError(f"--ops: module {m!r} is named twice")
    return mods


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if isinstance(e, OpSpecError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__  # sys.exit(): "SystemExit"


def _import(module: str, where: str) -> list[str]:
    before = set(REGISTRY)
    try:
        importlib.import_module(module)
    except OpSpecError as e:
        raise OpLoadError(f"{where} {module}: {_one_line(e)}") from e
    except ModuleNotFoundError as e:
        missing = f"module {e.name!r} not found" if e.name else str(e)
        raise OpLoadError(f"{where} {module}: it does not import ({missing}; is it on PYTHONPATH?)") from e
    except BaseException as e:  # noqa: BLE001 - a user's module may raise anything while importing
        if not is_op_failure(e):  # a real Ctrl-C (SIGINT has Python's default handler until the worker starts)
            raise
        raise OpLoadError(f"{where} {module}: importing it raised {_one_line(e)}") from e
    return sorted(set(REGISTRY) - before)


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def load_ops(modules: Iterable[str] = (), *, entry_points: bool = True) -> dict[str, list[str]]:
    """Import users' op modules (entry points first, then ``modules``); returns ``{source: [op names]}``.

    Raises:
        OpLoadError: one line naming the module (or entry point) and the reason.
    """
    loaded: dict[str, list[str]] = {}
    if entry_points:
        for ep in _entry_points():
            where = f"entry point {ep.name} ({ENTRY_POINT_GROUP})"
            if ep.attr:
                before = set(REGISTRY)
                _import(ep.module, where)
                try:
                    fn = getattr(sys.modules[ep.module], ep.attr)
                    fn()
                except OpSpecError as e:
                    raise OpLoadError(f"{where} {ep.value}: {_one_line(e)}") from e
                except BaseException as e:  # noqa: BLE001 - sys.exit() included: one line and exit status 1, as for a module
                    if not is_op_failure(e):
                        raise
                    raise OpLoadError(f"{where} {ep.value}: calling it raised {_one_line(e)}") from e
                loaded[ep.value] = sorted(set(REGISTRY) - before)
            else:
                loaded[ep.value] = _import(ep.module, where)
    for module in modules:
        loaded[module] = _import(module, "--ops")
        if not loaded[module]:
            log.warning("--ops %s registered no op (a module registers its ops with register_op when it is "
                        "imported; one imported before, by an entry point or another module, registers none now)",
                        module)
    return loaded
