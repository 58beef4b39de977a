"""Fixtures shared by the whole suite: a private runtime directory, unique worker names, a leak check.

* The session runs with ``SHMRPC_RUNTIME_DIR`` set (in ``os.environ``, so worker and
  client subprocesses inherit it) to a fresh 0700 directory: tests never see a real
  worker's sockets or locks.
* ``worker_name`` gives every test its own name, ``t<run>-<10 hex>``, where ``<run>``
  is drawn once per test run; its regions are ``/dev/shm/shmrpc.t<run>-...``.
* After every test, regions of *this run* (``shmrpc.t<run>-*``) that appeared during
  it, and any ``*.sock`` or ``*.attach`` socket left in this run's runtime directory, fail the test (after up
  to 2 s for subprocesses to finish tearing down) and are removed so that one leak
  does not cascade. Another suite running on the same machine has another ``<run>``
  and another runtime directory, so the two never touch each other's regions.
* Randomness comes from one seed, fixed by default (``support.seeds``; ``SHMRPC_TEST_SEED``
  to try another). Hypothesis gets it as ``--hypothesis-seed`` unless one is given, the
  header of the run shows it, and every failing test's report repeats it.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import seeds

SHM_DIR = "/dev/shm"
RUN_ID = uuid.uuid4().hex[:6]
TEST_NAME_PREFIX = f"t{RUN_ID}-"
TEST_REGION_PREFIX = f"shmrpc.{TEST_NAME_PREFIX}"
LEAK_WAIT_S = 2.0


def _test_regions() -> set[str]:
    try:
        return {e for e in os.listdir(SHM_DIR) if e.startswith(TEST_REGION_PREFIX)}
    except OSError:
        return set()


def _sockets(rdir: Path) -> set[str]:
    try:
        return {p.name for p in (*rdir.glob("*.sock"), *rdir.glob("*.attach"))}
    except OSError:
        return set()


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Hypothesis draws from the suite's seed (before its plugin reads the option)."""
    if getattr(config.option, "hypothesis_seed", None) is None:
        config.option.hypothesis_seed = seeds.SEED


def pytest_report_header(config: pytest.Config) -> str:
    return f"shmrpc: seed {seeds.SEED} ({seeds.ENV}), run id {RUN_ID}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("shmrpc seed", f"{seeds.ENV}={seeds.SEED} (rerun with it to repeat this run)"))


@pytest.fixture(scope="session", autouse=True)
def shmrpc_runtime_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's private runtime directory, also exported as ``SHMRPC_RUNTIME_DIR``."""
    path = tmp_path_factory.mktemp("rt")
    path.chmod(0o700)
    old = os.environ.get("SHMRPC_RUNTIME_DIR")
    os.environ["SHMRPC_RUNTIME_DIR"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("SHMRPC_RUNTIME_DIR", None)
        else:
            os.environ["SHMRPC_RUNTIME_DIR"] = old


@pytest.fixture
def worker_name() -> str:
    """A worker name no other test (of this run or another) uses: ``t<run>-`` and 10 hex digits."""
    return TEST_NAME_PREFIX + uuid.uuid4().hex[:10]


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def _no_leaks(shmrpc_runtime_dir: Path) -> Iterator[None]:
    """Fail a test that leaves a region it created, or any socket file, behind."""
    before = _test_regions()
    yield
    # The runtime dir may have been swapped by a test (monkeypatch); check the one in force now.
    rdir = Path(os.environ.get("SHMRPC_RUNTIME_DIR", shmrpc_runtime_dir))
    deadline = time.monotonic() + LEAK_WAIT_S
    while True:
        regions = _test_regions() - before
        sockets = _sockets(rdir)
        if not (regions or sockets) or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if not (regions or sockets):
        return
    for r in regions:
        try:
            os.unlink(os.path.join(SHM_DIR, r))
        except OSError:
            pass
    for s in sockets:
        try:
            (rdir / s).unlink()
        except OSError:
            pass
    leaked = [f"{SHM_DIR}/{r}" for r in sorted(regions)] + [str(rdir / s) for s in sorted(sockets)]
    pytest.fail(f"test leaked {len(leaked)} shared-memory region(s)/socket(s) (now removed): {', '.join(leaked)}",
                pytrace=False)
