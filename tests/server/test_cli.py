"""The ``shmrpc`` command without a worker: every bad argument is one line on stderr and exit status 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shmrpc.cli import main
from shmrpc.server.cli import EXIT_FAILURE, EXIT_USAGE, build_parser, version

BAD = [
    (["frob"], "invalid choice"),
    ([], "required"),
    (["serve"], "--name"),
    (["serve", "--name", "bad/name"], "invalid worker name"),
    (["serve", "--name", "x", "--slots", "zz"], "SIZE:COUNT"),
    (["serve", "--name", "x", "--slots", "64K:0"], ""),
    (["serve", "--name", "x", "--lease", "a,b"], "--lease"),
    (["serve", "--name", "x", "--lease", "1,1,1,1,1,1,1"], "--lease"),
    (["serve", "--name", "x", "--backend", "tpu"], "invalid choice"),
    (["serve", "--name", "x", "--threads", "0"], "--threads"),
    (["serve", "--name", "x", "--threads", "many"], "--threads"),
    (["serve", "--name", "x", "--inline-max", "lots"], ""),
    (["serve", "--name", "x", "--resident-limit", "-1"], ""),
    (["serve", "--name", "x", "--client-max-bytes", "?"], ""),
    (["serve", "--name", "x", "--spin-us", "-5"], "--spin-us"),
    (["serve", "--name", "x", "--lane-linger-us", "-1"], "--lane-linger-us"),
    (["serve", "--name", "x", "--cpus", "two"], "--cpus"),
    (["serve", "--name", "x", "--cpus", "3-1"], "--cpus"),
    (["serve", "--name", "x", "--cpus", "0-99999999999"], "--cpus"),
    (["serve", "--name", "x", "--cpus", "60000"], "--cpus 60000: not CPUs this process may use"),
    (["serve", "--name", "x", "--client-max-slots", "-1"], "--client-max-slots"),
    (["serve", "--name", "x", "--client-max-bytes", "-1"], ""),
    (["serve", "--name", "x", "--metrics-port", "70000"], "0..65535"),
    (["serve", "--name", "x", "--metrics-port", "http"], "port"),
    (["serve", "--name", "x", "--metrics-addr", "unix:relative.sock"], "absolute"),
    (["serve", "--name", "x", "--metrics-addr", ""], "--metrics-addr"),
    (["serve", "--name", "x", "--metrics-token-file", "/nonexistent/token"], "--metrics-token-file"),
    (["serve", "--name", "x", "--log-format", "xml"], "invalid choice"),
    (["serve", "--name", "x", "--log-level", "LOUD"], "invalid choice"),
    (["serve", "--name", "x", "--isolation", "none"], "invalid choice"),
    (["status"], "--name"),
    (["status", "--name", "bad/name"], "invalid worker name"),
    (["status", "--name", "x", "--timeout-s", "0"], "positive"),
    (["status", "--name", "x", "--timeout-s", "nan"], "positive"),
    (["status", "--name", "x", "--timeout-s", "soon"], "seconds"),
    (["status", "--name", "x", "--timeout-s", "1e308"], "--timeout-s: must be at most"),  # (failed at run time)
    (["serve", "--name", "x", "--lease-max", "a"], "--lease-max must be"),  # (named --lease)
    (["serve", "--name", "x", "--slots", "64K:2", "--lease-max", "1,1"], "--lease-max names 2 classes"),  # (cut)
    (["serve", "--name", "x", "--slots", "q"], "--slots: slot class 'q'"),  # sizes named by their option
    (["serve", "--name", "x", "--inline-max", "lots"], "--inline-max: not a size"),
    (["serve", "--name", "x", "--resident-limit", "-1"], "--resident-limit: not a size"),
    (["serve", "--name", "x", "--client-max-bytes", "?"], "--client-max-bytes: not a size"),
    (["serve", "--name", "x", "--request-memory-limit", "5X"], "--request-memory-limit: not a size"),
    (["serve", "--name", "x", "--metrics-addr", "0.0.0.0"], "needs --metrics-port"),  # (no server, silently)
    (["doctor", "--slots", "q"], "SIZE:COUNT"),
    (["doctor", "--bogus"], "shmrpc doctor: unrecognized arguments: --bogus"),
    (["serve", "--name", "a", "b"], "shmrpc serve: unrecognized arguments: b"),
    (["serve", "--name", "x", "--allow-uid", "-7"], "a uid is 0..4294967294, got -7"),
    (["serve", "--name", "x", "--allow-uid", "4294967295"], "a uid is"),
    (["serve", "--name", "x", "--allow-uid", "alice"], "expected a uid"),
    (["bench", "lat", "--iters", "0"], "--iters"),
    (["bench", "lat", "--sizes", "huge"], ""),
    (["bench", "warp"], "invalid choice"),
]


@pytest.mark.parametrize(("argv", "needle"), BAD, ids=[" ".join(a) or "(none)" for a, _ in BAD])
def test_bad_argument_is_one_line_and_status_2(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == EXIT_USAGE, (out, err)
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("shmrpc"), err
    assert needle in lines[0], err


@pytest.mark.parametrize(("mode", "says"), [
    (0o644, "chmod 600"),
    (0o600, "--metrics-token-file needs --metrics-port"),  # (no metrics server: it was ignored)
])
def test_a_token_file_is_refused_when_others_can_read_it_or_nothing_serves_metrics(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: int, says: str) -> None:
    token = tmp_path / "token"
    token.write_text("x" * 32)
    token.chmod(mode)
    assert main(["serve", "--name", "x", "--metrics-token-file", str(token)]) == EXIT_USAGE
    assert says in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"shmrpc {version()}"
    assert version() != "unknown"  # the test environment installs the package


def test_help_texts_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    for cmd in ("serve", "status", "doctor"):
        assert main([cmd, "--help"]) == 0
        text = capsys.readouterr().out
        sub = build_parser()._subparsers._group_actions[0].choices[cmd]  # type: ignore[union-attr]
        for action in sub._actions:
            assert action.help, f"{cmd} {action.option_strings} has no help text"
        if cmd == "serve":
            for default in ("(default 4)", "(default 256K)", "(default 8G)"):
                assert default in " ".join(text.split()), default


def test_status_without_a_worker_is_status_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--name", "nobody-" + os.urandom(4).hex()]) == EXIT_FAILURE
    assert "no worker named" in capsys.readouterr().err
    assert main(["status", "--name", "nobody-" + os.urandom(4).hex(), "-q"]) == EXIT_FAILURE
    assert capsys.readouterr().err == ""


def test_status_prints_counters_for_people() -> None:
    from shmrpc.server.cli import _counter_text

    assert _counter_text(3.0) == "3" and _counter_text(0.25) == "0.25" and _counter_text({}) == "-"
    assert _counter_text({"vector_add": {"ok": 1.0, "KernelError": 2.0}}) == "vector_add: ok: 1, KernelError: 2"
