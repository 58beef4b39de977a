"""Loading users' op modules: --ops parsing, entry points, and the one-line errors."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from shmrpc.kernels import REGISTRY
from shmrpc.kernels._registry import unregister
from shmrpc.server import _plugins
from shmrpc.server._plugins import ENTRY_POINT_GROUP, OpLoadError, load_ops, parse_ops

OPS = '''
from shmrpc.kernels.api import OpSpec, register_op

def register():
    register_op(OpSpec("{name}_late", inputs=("x",), outputs=("out",), infer=lambda i, a: {{"out": i["x"]}},
                       numpy=lambda c: {{"out": c.inputs["x"]}}))

register_op(OpSpec("{name}", inputs=("x",), outputs=("out",), infer=lambda i, a: {{"out": i["x"]}},
                   numpy=lambda c: {{"out": c.inputs["x"]}}))
'''


@pytest.fixture
def pkg(tmp_path: Path, worker_name: str) -> Iterator[str]:
    """A module of ops on sys.path; its ops and the module are forgotten afterwards."""
    mod = "plug_" + worker_name.replace("-", "_")
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(OPS.format(name=mod)))
    sys.path.insert(0, str(tmp_path))
    before = set(REGISTRY)
    yield mod
    sys.path.remove(str(tmp_path))
    sys.modules.pop(mod, None)
    for n in set(REGISTRY) - before:
        unregister(n)


def test_parse_ops() -> None:
    assert parse_ops("a.b, c") == ("a.b", "c")
    for bad in ("", "a,,b", "a-b", "1a"):
        with pytest.raises(ValueError, match="is not a module name"):
            parse_ops(bad)
    with pytest.raises(ValueError, match="module 'a' is named twice"):
        parse_ops("a,b, a")


def test_a_module_that_registers_no_op_is_said(pkg: str, caplog: pytest.LogCaptureFixture) -> None:
    """A module imported before (here by the first load) registers nothing when --ops names it: the worker says so
    instead of starting without the ops the user expected."""
    assert load_ops([pkg], entry_points=False) == {pkg: [pkg]}
    assert not caplog.records
    with caplog.at_level("WARNING", logger="shmrpc.server"):
        assert load_ops([pkg], entry_points=False) == {pkg: []}
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [f"--ops {pkg} registered no op"]


def test_modules_load_and_report_their_ops(pkg: str) -> None:
    assert load_ops([pkg], entry_points=False) == {pkg: [pkg]}
    assert REGISTRY[pkg].module == pkg and not REGISTRY[pkg].builtin


def test_entry_points_of_a_module_or_a_function(pkg: str, monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [importlib.metadata.EntryPoint("mine", pkg, ENTRY_POINT_GROUP),
           importlib.metadata.EntryPoint("late", f"{pkg}:register", ENTRY_POINT_GROUP)]
    monkeypatch.setattr(_plugins, "_entry_points", lambda: eps)
    assert load_ops() == {pkg: [pkg], f"{pkg}:register": [f"{pkg}_late"]}


def test_an_entry_point_that_fails_is_named(pkg: str, monkeypatch: pytest.MonkeyPatch) -> None:
    eps = [importlib.metadata.EntryPoint("broken", f"{pkg}:nothing_here", ENTRY_POINT_GROUP)]
    monkeypatch.setattr(_plugins, "_entry_points", lambda: eps)
    with pytest.raises(OpLoadError, match=rf"^entry point broken \(shmrpc.ops\) {pkg}:nothing_here: calling it raised "
                                          "AttributeError"):
        load_ops()


def test_a_module_registering_a_taken_name_names_both(pkg: str) -> None:
    load_ops([pkg], entry_points=False)
    sys.modules.pop(pkg)  # imported again, its op is registered twice
    with pytest.raises(OpLoadError, match=rf"--ops {pkg}: op '{pkg}' .* share a name") as e:
        load_ops([pkg], entry_points=False)
    assert "\n" not in str(e.value)


class _LibraryStop(BaseException):
    """A library's own BaseException."""


@pytest.mark.parametrize(("exc", "says"), [(SystemExit(), "SystemExit"), (SystemExit(3), "SystemExit: 3"),
                                           (GeneratorExit("done"), "GeneratorExit: done"),
                                           (_LibraryStop("stop"), "_LibraryStop: stop")],
                         ids=["exit", "exit-3", "generator-exit", "custom"])
def test_an_entry_point_function_that_exits_is_named(pkg: str, monkeypatch: pytest.MonkeyPatch, exc: BaseException,
                                                       says: str) -> None:
    """An entry-point function that calls sys.exit() (or raises another BaseException) stops the start with the
    one line naming it, as a module raising it while it is imported does; before, serve exited with its status."""
    def leave() -> None:
        raise exc

    eps = [importlib.metadata.EntryPoint("leaving", f"{pkg}:leave", ENTRY_POINT_GROUP)]
    monkeypatch.setattr(_plugins, "_entry_points", lambda: eps)
    load_ops([pkg], entry_points=False)
    monkeypatch.setattr(sys.modules[pkg], "leave", leave, raising=False)
    with pytest.raises(OpLoadError) as e:
        load_ops()
    assert str(e.value) == f"entry point leaving (shmrpc.ops) {pkg}:leave: calling it raised {says}"
