"""The wheel as users get it: metadata, typed packages, the CUDA sources, and a build without warnings."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("schema", "client", "server", "kernels", "bench")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-v", "-w", str(out), str(ROOT)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 and "No matching distribution" in proc.stdout + proc.stderr:
        pytest.skip("setuptools for the build is not reachable")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (whl,) = out.glob("shmrpc-*.whl")
    return whl, proc.stdout + proc.stderr


@pytest.mark.timeout(300)
def test_build_has_no_warnings(wheel: tuple[Path, str]) -> None:
    _, log = wheel
    warnings = [line.strip() for line in log.splitlines()
                if re.search(r"warn|deprecat|!!", line, re.I) and "byte-compiling is disabled" not in line]
    assert not warnings, warnings


@pytest.mark.timeout(300)
def test_wheel_contents_and_metadata(wheel: tuple[Path, str]) -> None:
    whl, _ = wheel
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        entry_points = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    for pkg in PACKAGES:
        assert f"shmrpc/{pkg}/py.typed" in names, pkg
    assert {"shmrpc/kernels/cuda/common.cuh", "shmrpc/kernels/cuda/gemm_w4a16.cu"} <= names
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert "License-Expression: Apache-2.0" in meta and "Apache License" in (ROOT / "LICENSE").read_text()[:200]
    assert "Requires-Dist: prometheus-client>=0.18" in meta
    for extra, wheel_family in (("gpu", "cupy-cuda12x"), ("cuda11", "cupy-cuda11x"), ("cuda12", "cupy-cuda12x"),
                                ("cuda13", "cupy-cuda13x")):
        assert re.search(rf'Requires-Dist: {wheel_family}>=\d+; extra == "{extra}"', meta), extra
    assert "Project-URL: Source" in meta and "Classifier: Typing :: Typed" in meta
    assert "shmrpc = shmrpc.cli:main" in entry_points  # the neutral dispatcher, not the worker's module
