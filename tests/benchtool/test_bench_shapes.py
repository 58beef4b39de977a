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


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", "bfloat16"])
def test_the_float_payload_is_small_finite_and_normal(dtype: str) -> None:
    """Bytes 0..250 viewed as floats held NaN and subnormals (float16) and values near 3.4e38 (float32, which
    ``--op scale --attr a=2`` took to inf): arithmetic of another kind than a user's."""
    import warnings

    from shmrpc.bench._transport import payload_of
    from shmrpc.kernels._dtypes import bf16_to_f32

    p = payload_of(8192, dtype)
    assert p.nbytes == 8192
    x = bf16_to_f32(np, p) if dtype == "bfloat16" else p
    tiny = np.finfo(np.float32 if dtype == "bfloat16" else dtype).tiny
    assert np.isfinite(x).all() and not ((x != 0) & (np.abs(x) < tiny)).any()
    assert np.abs(x).max() <= 0.5 and len(np.unique(x)) > 200
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isfinite(x * x.dtype.type(2)).all()


def test_the_integer_payload_keeps_its_byte_pattern() -> None:
    from shmrpc.bench._transport import payload_of

    pattern = np.resize(np.arange(251, dtype=np.uint8), 4096)
    for dtype in ("uint8", "int8", "int16", "int32", "uint64"):
        assert payload_of(4096, dtype).dtype == np.dtype(dtype)
        assert payload_of(4096, dtype).view(np.uint8).tobytes() == pattern.tobytes()
    assert set(payload_of(64, "bool").view(np.uint8).tolist()) == {0, 1}  # a bool byte is 0 or 1


@pytest.mark.timeout(60)
def test_own_scales_the_float_payload_without_overflow() -> None:
    import warnings

    from shmrpc.bench._runner import RunConfig, make_transport
    from shmrpc.bench._transport import payload_of

    for dtype in ("float16", "float32"):
        cfg = RunConfig(transports=["own"], backend="numpy", op="scale", attrs={"a": 2.0}, dtype=dtype)
        with make_transport("own", "", cfg) as t, warnings.catch_warnings():
            warnings.simplefilter("error")
            t.prepare(4096)
            out = np.frombuffer(t.reply_bytes(t.roundtrip()), dtype=dtype)
            assert np.isfinite(out).all()
            np.testing.assert_array_equal(out, 2 * payload_of(4096, dtype))


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_bfloat16_runs_on_the_loan_and_in_process_and_call_says_what_it_needs() -> None:
    # --dtype bfloat16 failed in the in-process baseline (NumPy has no such dtype: TypeError), and call() sent the
    # payload's uint16 words as uint16 (an op taking floats refused it, KernelError)
    from shmrpc.bench._runner import RunConfig, make_transport, open_servers
    from shmrpc.bench._transport import TransportUnavailable
    from shmrpc.kernels._dtypes import bf16_to_f32
    from shmrpc.schema import dtypes

    cfg = RunConfig(sizes=[64], transports=["shmrpc", "own", "shmrpc-call"], backend="numpy", dtype="bfloat16",
                    op="scale", attrs={"a": 2.0})
    with open_servers(cfg, log=print) as servers:
        for key in ("shmrpc", "own"):
            with make_transport(key, servers.addresses[key], cfg) as t:
                t.prepare(64)
                got = bf16_to_f32(np, np.frombuffer(t.reply_bytes(t.roundtrip()), np.uint16))
                np.testing.assert_array_equal(got, 2 * bf16_to_f32(np, np.frombuffer(t.payload_bytes(), np.uint16)))
                t.end_size()
        if dtypes.numpy_dtype("bfloat16") != np.uint16:
            pytest.skip("ml_dtypes is installed: call() takes its bfloat16 arrays")
        with pytest.raises(TransportUnavailable, match="ml_dtypes array or a PyTorch tensor"):
            make_transport("shmrpc-call", servers.addresses["shmrpc-call"], cfg)
