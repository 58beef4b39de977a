"""Dependency direction: schema <- client, schema <- server -> kernels; kernels sees arrays only."""

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
}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependency_direction(package: str) -> None:
    bad = []
    for f in (ROOT / package).rglob("*.py"):
        for mod in _imports(f):
            if any(mod == b or mod.startswith(b + ".") for b in FORBIDDEN[package]):
                bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_no_top_level_client_or_server_package(tmp_path: Path) -> None:
    code = ("import importlib.util, shmrpc.client, shmrpc.server, shmrpc.schema, shmrpc.kernels\n"
            "print([n for n in ('client', 'server', 'schema', 'kernels') if importlib.util.find_spec(n)])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
