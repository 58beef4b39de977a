"""Dependency direction: schema <- client, schema <- server -> kernels; kernels sees arrays only.

Every import form counts: ``import a.b``, ``from a import b`` (as ``a`` and ``a.b``), relative
imports (resolved against the file's package), imports inside functions, and
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "schema": ("shmrpc.client", "shmrpc.server", "shmrpc.kernels"),
    "client": ("shmrpc.server", "shmrpc.kernels"),
    "kernels": ("shmrpc.schema", "shmrpc.client", "shmrpc.server", "flatbuffers", "zmq"),
    "server": ("shmrpc.client",),
    "rayext": ("shmrpc.server", "shmrpc.kernels"),  # shmrpc.ray: a client side; it starts workers as processes
}
#: (file, module) pairs allowed although FORBIDDEN says otherwise, each with its reason.
EXEMPT: dict[tuple[str, str], str] = {}
_IMPORT_FUNCS = {"import_module", "__import__"}


def _package_of(rel: Path) -> str:
    """``kernels/cuda/x.py`` -> ``shmrpc.kernels.cuda`` (the package a relative import starts from)."""
    return ".".join(("shmrpc", *rel.parent.parts))


def _resolve(package: str, level: int, module: str | None) -> str:
    base = package.split(".")
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imports_of(source: str, package: str) -> set[str]:
    """Every module name ``source`` (a file of ``package``) imports, by any of the forms above."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(package, node.level, node.module) if node.level else (node.module or "")
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names if a.name != "*"}
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            arg = node.args[0]
            if name in _IMPORT_FUNCS and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if arg.value.startswith("."):
                    level = len(arg.value) - len(arg.value.lstrip("."))
                    out.add(_resolve(package, level, arg.value.lstrip(".") or None))
                else:
                    out.add(arg.value)
    return out


def _hits(mod: str, banned: tuple[str, ...]) -> bool:
    return any(mod == b or mod.startswith(b + ".") for b in banned)


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependency_direction(package: str) -> None:
    bad = []
    for f in sorted((ROOT / package).rglob("*.py")):
        rel = f.relative_to(ROOT)
        for mod in sorted(imports_of(f.read_text(), _package_of(rel))):
            if _hits(mod, FORBIDDEN[package]) and not any(
                    rel.as_posix() == ef and (mod == em or mod.startswith(em + ".")) for ef, em in EXEMPT):
                bad.append(f"{rel} imports {mod}")
    assert not bad, bad


@pytest.mark.parametrize("source", [
    "import shmrpc.server",
    "import shmrpc.server.cli as cli",
    "from shmrpc.server import cli",
    "from shmrpc import server",
    "from shmrpc import schema, server",
    "from .. import server",
    "from ..server import cli",
    "from ..server._loop import Worker",
    "def f():\n    from shmrpc import server\n",
    "class C:\n    def m(self):\n        import shmrpc.server\n",
    "import importlib\nimportlib.import_module('shmrpc.server.cli')",
    "from importlib import import_module\nimport_module('shmrpc.server')",
    "__import__('shmrpc.server')",
    "import importlib\nimportlib.import_module('..server', __package__)",
])
def test_every_import_form_is_seen(source: str) -> None:
    """Each of these, in a kernels module, is an import of shmrpc.server."""
    assert _hits_any(imports_of(source, "shmrpc.kernels"), ("shmrpc.server",)), imports_of(source, "shmrpc.kernels")


@pytest.mark.parametrize("source", [
    "from . import _dtypes",
    "from ._registry import REGISTRY",
    "import numpy as np",
    "x = 'shmrpc.server'",
    "from shmrpc import kernels",
])
def test_allowed_imports_are_not_flagged(source: str) -> None:
    assert not _hits_any(imports_of(source, "shmrpc.kernels"), ("shmrpc.server", "shmrpc.schema"))


def _hits_any(mods: set[str], banned: tuple[str, ...]) -> bool:
    return any(_hits(m, banned) for m in mods)


def test_no_top_level_client_or_server_package(tmp_path: Path) -> None:
    code = ("import importlib.util, shmrpc.client, shmrpc.server, shmrpc.schema, shmrpc.kernels\n"
            "print([n for n in ('client', 'server', 'schema', 'kernels') if importlib.util.find_spec(n)])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
