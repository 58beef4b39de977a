"""``shmrpc bench --shape NAME=DIMxDIM``: parsing, refusals that name the input, a real run with shaped tensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from shmrpc.bench import RunConfig, main
from shmrpc.bench._cli import build_parser, config_from_args
from shmrpc.bench._runner import make_transport, open_servers
from shmrpc.bench._shapes import shaped_payload, shapes_nbytes


def _cfg(*argv: str) -> RunConfig:
    return config_from_args(build_parser().parse_args(["lat", *argv]))


def test_shapes_parse_into_the_config_and_set_the_size() -> None:
    cfg = _cfg("--op", "gemm", "--shape", "x=16x256", "--shape", "w=256X256", "--dtype", "float16")
    assert cfg.shapes == {"x": (16, 256), "w": (256, 256)}
    assert cfg.sizes == [(16 * 256 + 256 * 256) * 2] == [shapes_nbytes(cfg.shapes, "float16")]
    assert _cfg("--op", "vector_add", "--shape", "x=64", "--shape", "y=64", "--dtype", "float32").sizes == [512]
    assert _cfg("--sizes", "64").shapes == {}


@pytest.mark.parametrize("text", ["x=16xa", "x=", "=16", "x=0x4", "16x256", "x=16x-2", "x y=4"])
def test_a_bad_shape_is_a_usage_error(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lat", "--op", "echo", "--shape", text, "--no-json"]) == 2
    err = capsys.readouterr().err
    assert "--shape takes NAME=DIMxDIM" in err and repr(text) in err


@pytest.mark.parametrize(("argv", "words"), [
    (["--op", "gemm", "--shape", "x=16x256"], "no shape for w"),
    (["--op", "gemm", "--shape", "x=2x3", "--shape", "w=3x4", "--shape", "z=4"], "has no input z"),
    (["--op", "gemm", "--shape", "x=2x3", "--shape", "w=5x4"], "op 'gemm' refuses x=2x3, w=5x4"),
    (["--op", "echo", "--shape", "x=4", "--sizes", "64"], "exclude each other"),
    (["--op", "echo", "--shape", "x=4", "--shape", "x=8"], "names an input twice"),
])
def test_shapes_an_op_cannot_take_are_refused_before_anything_starts(
        argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["lat", "--dtype", "float32", *argv, "--no-json"]) == 2
    assert words in capsys.readouterr().err


def test_shaped_payloads_are_finite_and_deterministic() -> None:
    a = shaped_payload((16, 256), "float16")
    assert a.shape == (16, 256) and a.dtype == np.float16 and np.isfinite(a).all()
    np.testing.assert_array_equal(a, shaped_payload((16, 256), "float16"))
    assert shaped_payload((3, 4), "uint8").shape == (3, 4)


def _bench_regions() -> set[str]:
    return {e for e in os.listdir("/dev/shm") if e.startswith(f"shmrpc.bench-{os.getpid()}-")}


@pytest.mark.e2e
@pytest.mark.timeout(90)
def test_every_path_sends_the_shapes_and_gets_the_ops_answer() -> None:
    before = _bench_regions()
    shapes = {"x": (4, 8), "w": (8, 3)}
    cfg = RunConfig(op="gemm", dtype="float32", shapes=shapes, sizes=[shapes_nbytes(shapes, "float32")],
                    transports=["shmrpc", "shmrpc-call", "shmrpc-lane", "own"], backend="numpy")
    want = shaped_payload(shapes["x"], "float32") @ shaped_payload(shapes["w"], "float32")
    with open_servers(cfg, log=print) as servers:
        assert servers.skipped == {}, servers.skipped
        for key in cfg.transports:
            with make_transport(key, servers.addresses[key], cfg) as t:
                t.prepare(cfg.sizes[0])
                for _ in range(2):
                    reply = t.roundtrip()
                    out = reply["out"] if isinstance(reply, dict) else reply
                    np.testing.assert_allclose(out, want, rtol=1e-5, err_msg=key)
                t.end_size()
    assert servers.worker["exit_status"] == 0
    assert _bench_regions() - before == set()


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_tiny_shaped_sweep_writes_what_was_sent(tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    rc = main(["lat", "--op", "gemm", "--shape", "x=2x8", "--shape", "w=8x4", "--dtype", "float32", "--backend",
               "numpy", "--transports", "shmrpc,shmrpc-call,zmq,own", "--iters", "5", "--warmup", "1",
               "--clients", "1,2", "--out", str(out), "-q"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["shapes"] == {"x": [2, 8], "w": [8, 4]} and doc["config"]["dtype"] == "float32"
    assert doc["config"]["sizes"] == [(16 + 32) * 4]
    assert {r["nbytes"] for r in doc["results"]} == {192} and not any("error" in r for r in doc["results"])
    got = sorted((p["transport"], p["clients"]) for p in doc["scaling"])
    assert got == sorted((k, n) for k in ("shmrpc", "shmrpc-call", "zmq", "own") for n in (1, 2))
    assert all(p["calls_per_s"] > 0 and "error" not in p for p in doc["scaling"])
