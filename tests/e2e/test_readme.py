"""The README's client example runs as printed, against a real worker."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_client_example_runs(spawn_worker: Callable[..., WorkerProc], tmp_path: Path) -> None:
    text = README.read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start:text.index("```", start)]
    w = spawn_worker(slots="64K:16,1M:4,16M:2", lease="4,1,1")
    script = tmp_path / "example.py"
    script.write_text(code.replace('Client("demo"', f'Client("{w.name}"'))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "[3. 3. 3. 3.]"
    assert lines[1] == "[1.0, 2.0, 3.0, 4.0]"
    assert lines[-1] == "vector_add 0 y shape"
