"""Every code block in README.md and docs/*.md is checked: Python blocks run (against a real worker
where they name one), shell blocks' ``shmrpc``/``python -m`` commands parse with the real parsers and
their values validate, ``make`` targets, extras and repository paths they name exist. Blocks of
output, diagrams and schematics are tagged ``text`` and are the only ones not checked."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from shmrpc.bench._cli import build_parser as bench_parser
from shmrpc.bench._cli import config_from_args
from shmrpc.schema.layout import parse_geometry
from shmrpc.server.cli import build_parser as server_parser
from shmrpc.server.config import parse_lease

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
LANGS = {"python", "sh", "text"}


def code_blocks(path: Path) -> list[tuple[str, str, int]]:
    """(language, code, first line number) of each fenced block in ``path``."""
    out, lang, start, buf = [], None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, buf = line[3:].strip(), n, []
            else:
                out.append((lang, "\n".join(buf) + "\n", start))
                lang = None
        elif lang is not None:
            buf.append(line)
    assert lang is None, f"{path}: a code block opened at line {start} is not closed"
    return out


BLOCKS = [(p, *b) for p in DOCS for b in code_blocks(p)]


def _ids(kind: str) -> list[str]:
    return [f"{p.relative_to(ROOT)}:{n}" for p, lang, _, n in BLOCKS if lang == kind]


def test_every_block_names_its_language() -> None:
    bad = [f"{p.relative_to(ROOT)}:{n} ({lang or 'none'})" for p, lang, _, n in BLOCKS if lang not in LANGS]
    assert not bad, f"tag each block python, sh or text: {bad}"


@pytest.mark.parametrize("code", [c for _, lang, c, _ in BLOCKS if lang == "python"], ids=_ids("python"))
def test_python_block_runs(code: str, spawn_worker: Callable[..., WorkerProc], tmp_path: Path) -> None:
    if "import ray" in code:
        pytest.importorskip("ray", reason="Ray is not installed (pip install 'shmrpc[ray]' to run this block)")
    if 'Client("demo"' in code:
        w = spawn_worker(slots="64K:16,1M:4,16M:2", lease="4,1,1")
        code = code.replace('Client("demo"', f'Client("{w.name}"')
    supervisor = None
    if 'Pool("demo"' in code:  # a supervisor of two NumPy workers, <name>-0 and <name>-1
        prefix = f"d{tmp_path.name[-8:]}".replace("_", "")
        supervisor = subprocess.Popen([sys.executable, "-m", "shmrpc.server", "serve", "--name", prefix, "--devices",
                                       "0,1", "--slots", "64K:16,1M:4", "--backend", "numpy", "--no-mlock"],
                                      stdout=subprocess.PIPE, text=True)
        assert supervisor.stdout is not None
        for line in supervisor.stdout:
            if line.startswith("shmrpc supervisor"):
                break
        code = code.replace('Pool("demo"', f'Pool("{prefix}"').replace('"demo-1"', f'"{prefix}-1"')
    script = tmp_path / "block.py"
    script.write_text(code)
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=50, cwd=tmp_path)
    finally:
        if supervisor is not None:
            supervisor.terminate()
            supervisor.communicate(timeout=30)
    assert out.returncode == 0, out.stderr
    if "with c.loan(1 << 20) as req:" in code:  # the README's client screenful prints these
        lines = out.stdout.splitlines()
        assert lines[0] == "[3. 3. 3. 3.]"
        assert lines[1] == "[1.0, 2.0, 3.0, 4.0]"
        assert lines[-1] == "vector_add 0 y shape"


# ------------------------------------------------------------------ shell blocks

_PLACEHOLDERS = {"NAME": "demo", "N": "2", "UID": "1000", "PORT": "9464", "STAGE": "gpu"}


def _commands(code: str) -> list[str]:
    """Logical command lines: comments dropped, ``\\`` continuations and indented synopsis lines joined."""
    out: list[str] = []
    joining = False
    for raw in code.splitlines():
        line = re.sub(r"\s+#.*$", "", raw).rstrip()
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if (joining or raw[:1].isspace()) and out:
            out[-1] += " " + line.strip()
        else:
            out.append(line.strip())
        joining = out[-1].endswith("\\")
        if joining:
            out[-1] = out[-1][:-1].rstrip()
    return out


def _synopsis_to_argv(cmd: str) -> list[str]:
    """A synopsis as a real command line: the first of each ``a | b`` and ``a|b``, optional parts kept."""
    cmd = re.sub(r"\[([^\[\]]*?)\s\|\s[^\[\]]*\]", r"\1", cmd)
    cmd = cmd.replace("[", " ").replace("]", " ").replace("...", " ")
    argv = []
    for tok in shlex.split(cmd):
        if "|" in tok and not tok.startswith("-"):
            tok = tok.split("|")[0]
        argv.append(_PLACEHOLDERS.get(tok, tok))
    return argv


def _check_shmrpc(argv: list[str]) -> None:
    if argv[:1] == ["bench"]:
        config_from_args(bench_parser().parse_args(argv[1:]))
        return
    if argv in (["--version"], ["--help"]):
        return
    args = server_parser().parse_args(argv)
    if args.command in ("serve", "doctor"):
        geometry = parse_geometry(args.slots)
        if args.command == "serve" and args.lease:
            assert len(parse_lease(args.lease)) <= len(geometry.classes)


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", section, re.M))


def _check_command(cmd: str) -> None:
    for part in re.split(r"\s*(?:&&|\|\||\|)\s*", cmd):
        argv = _synopsis_to_argv(part)
        while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # VAR=value prefixes
            argv = argv[1:]
        if argv[:1] == ["sudo"]:
            argv = argv[1:]
        if not argv:
            continue
        prog = argv[0]
        if prog == "shmrpc":
            _check_shmrpc(argv[1:])
        elif prog.endswith("python") or prog.endswith("python3"):
            if argv[1:2] == ["-m"]:
                module = argv[2]
                assert importlib.util.find_spec(module) is not None, module
                if len(argv) == 3:  # `python -m MODULE ...`: the module alone
                    continue
                if module in ("shmrpc.server", "shmrpc.cli"):
                    _check_shmrpc(argv[3:])
                elif module == "shmrpc.bench":
                    _check_shmrpc(["bench", *argv[3:]])
            else:
                assert (ROOT / argv[1]).is_file(), argv[1]
        elif prog == "make":
            targets = set(re.findall(r"^([a-z-]+):", (ROOT / "Makefile").read_text(), re.M))
            assert set(argv[1:]) <= targets, argv
        elif prog == "pip" or argv[:3] == ["python", "-m", "pip"]:
            for tok in argv:
                m = re.fullmatch(r"shmrpc\[([a-z0-9_,-]+)\]", tok)
                if m:
                    assert set(m.group(1).split(",")) <= _extras(), tok
        else:  # docker, systemctl, install, curl, echo: not run here; the repository files they name exist
            for tok in argv:
                if re.match(r"(deploy|bench|docs|tests)/", tok):
                    assert (ROOT / tok).exists(), tok


@pytest.mark.parametrize("code", [c for _, lang, c, _ in BLOCKS if lang == "sh"], ids=_ids("sh"))
def test_shell_block_commands_parse(code: str) -> None:
    commands = _commands(code)
    assert commands
    for cmd in commands:
        try:
            _check_command(cmd)
        except SystemExit as e:  # argparse rejected it
            pytest.fail(f"{cmd!r} does not parse (exit {e.code})")
        except Exception as e:
            pytest.fail(f"{cmd!r}: {type(e).__name__}: {e}")


def test_synopsis_reader() -> None:
    assert _synopsis_to_argv("shmrpc bench lat [--sizes 1,2 | --min-size 64] [--iters N] ...") == [
        "shmrpc", "bench", "lat", "--sizes", "1,2", "--iters", "2"]
    assert _synopsis_to_argv("shmrpc serve --name NAME [--backend auto|numpy|cupy]")[-1] == "auto"
    assert _commands("a \\\n  b  # note\nc\n   [--x]\n") == ["a b", "c [--x]"]
