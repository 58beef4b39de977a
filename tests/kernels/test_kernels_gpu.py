"""CuPy backend paths the parity walk does not reach: split-K w4a16, the M >= 5 dequant path,
wide/odd layernorm rows, chunked streaming in place, residents, keep, fault injection.
Skipped with the reason where there is no CuPy/GPU."""

from __future__ import annotations

import numpy as np
import pytest

from shmrpc.kernels import KernelRuntimeError, StepSpec, TensorSpec, select_backend

pytestmark = pytest.mark.gpu




def _both(gpu, steps, specs, ins, outs_names):
    res = []
    for be in (gpu, select_backend("numpy")):
        plan = be.plan(steps, specs, outs_names)
        outs = {n: np.empty(s.shape, np.uint16 if s.dtype == "bfloat16" else s.dtype) for n, s in plan.outputs.items()}
        be.run(plan, ins, outs)
        res.append(outs)
    return res


def _rel(a, b):
    a, b = a.astype(np.float64), b.astype(np.float64)
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.mark.parametrize(("m", "k", "n"), [(1, 8192, 256), (3, 4096, 384), (8, 1024, 512), (64, 512, 128)])
def test_w4a16_split_k_and_dequant_paths(gpu, m, k, n) -> None:
    rng = np.random.default_rng(m)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float16)
    x = (rng.standard_normal((m, k)) / np.sqrt(k)).astype(np.float16)
    steps = [StepSpec("quantize_int4", {"w": "w"}, {"qweight": "q", "scales": "s", "zeros": "z"}),
             StepSpec("gemm_w4a16", {"x": "x", "qweight": "q", "scales": "s", "zeros": "z"}, {"out": "o"})]
    specs = {"w": TensorSpec(w.shape, "float16"), "x": TensorSpec(x.shape, "float16")}
    g, c = _both(gpu, steps, specs, {"w": w, "x": x}, ["o", "q"])
    assert (g["q"] == c["q"]).mean() > 0.999  # rounding ties may differ in a few nibbles
    assert _rel(g["o"], c["o"]) < 5e-3


@pytest.mark.parametrize(("rows", "d", "dt"), [(4, 16384, "float16"), (3, 16383, "float32"), (5, 1000, "bfloat16"), (2, 32768, "float16")])
def test_layernorm_gelu_wide_and_odd_rows(gpu, rows, d, dt) -> None:
    rng = np.random.default_rng(d)
    f = rng.standard_normal((rows, d)).astype(np.float32)
    st = (lambda a: (a.view(np.uint32) >> 16).astype(np.uint16)) if dt == "bfloat16" else (lambda a: a.astype(dt))
    ins = {"x": st(f), "g": st(rng.uniform(0.5, 1.5, d).astype(np.float32)), "b": st(rng.uniform(-0.1, 0.1, d).astype(np.float32))}
    specs = {"x": TensorSpec((rows, d), dt), "g": TensorSpec((d,), dt), "b": TensorSpec((d,), dt)}
    steps = [StepSpec("layernorm_gelu", {"x": "x", "gamma": "g", "beta": "b"}, {"out": "o"})]
    g, c = _both(gpu, steps, specs, ins, ["o"])
    if dt == "bfloat16":
        conv = lambda a: (a.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
        g["o"], c["o"] = conv(g["o"]), conv(c["o"])
    assert _rel(g["o"], c["o"]) < (2e-2 if dt == "bfloat16" else 4e-3 if dt == "float16" else 1e-5)


def test_chunked_streaming_in_place(gpu) -> None:
    n = 12 << 20  # 48 MiB per float32 tensor: over the 32 MiB chunking threshold
    x = np.arange(n, dtype=np.float32)
    y = np.full(n, 2.0, np.float32)
    spec = TensorSpec((n,), "float32")
    steps = [StepSpec("scale", {"x": "x"}, {"out": "t"}, {"a": 3.0}), StepSpec("vector_add", {"x": "t", "y": "y"}, {"out": "o"})]
    plan = gpu.plan(steps, {"x": spec, "y": spec}, ["o"])
    times = gpu.run(plan, {"x": x, "y": y}, {"o": x})  # output over input x
    assert times.get("chunks", 1) > 1
    np.testing.assert_array_equal(x[:1000], 3 * np.arange(1000, dtype=np.float32) + 2)
    assert x[-1] == np.float32(3 * np.float32(n - 1) + 2)


def test_resident_keep_and_memory(gpu) -> None:
    w = np.ones((64, 32), np.float16)
    spec = gpu.put("W", w, "float16")
    plan = gpu.plan([StepSpec("gemm", {"x": "x", "w": "w"}, {"out": "h"}), StepSpec("gelu", {"x": "h"}, {"out": "a"})],
                    {"x": TensorSpec((2, 64), "float16"), "w": spec}, ["a"], keep=["h"], resident={"w": "W"})
    a = np.empty((2, 32), np.float16)
    gpu.run(plan, {"x": np.full((2, 64), 0.5, np.float16)}, {"a": a}, keep_as={"h": "H"})
    assert set(gpu.resident()) == {"W", "H"} and gpu.memory()["resident_bytes"] == 64 * 32 * 2 + 2 * 32 * 2
    np.testing.assert_allclose(a.astype(np.float32), 32.0, rtol=1e-3)


def test_fault_injection_then_recovery(gpu) -> None:
    plan = gpu.plan([StepSpec("scale", {"x": "x"}, {"out": "o"}, {"a": 2.0})], {"x": TensorSpec((8,), "float32")}, ["o"])
    gpu.inject_fault = "cuda_error"
    with pytest.raises(KernelRuntimeError) as ei:
        gpu.run(plan, {"x": np.ones(8, np.float32)}, {"o": np.empty(8, np.float32)})
    assert (ei.value.op, ei.value.step) == ("scale", 0)
    o = np.empty(8, np.float32)
    gpu.run(plan, {"x": np.ones(8, np.float32)}, {"o": o})
    assert (o == 2).all()


def test_warmup_and_host_registration(gpu) -> None:
    gpu.warmup()
    buf = np.zeros(1 << 20, np.uint8)
    gpu.register_host(buf.ctypes.data, buf.nbytes)
    gpu.unregister_host()


@pytest.mark.parametrize(("rows", "d", "dt"), [(7, 8192, "float16"), (5, 1000, "bfloat16"), (3, 16383, "float32"),
                                               (2, 70000, "float16"), (3, 50001, "float32")])
def test_softmax_fused_rows_and_online(gpu, rows, d, dt) -> None:
    """Register-resident rows and the online (max, sum) kernel against float64, with outliers and subnormals."""
    rng = np.random.default_rng(d)
    f = rng.standard_normal((rows, d)) * 3
    f[0, :5] = [1e3, -1e3, 6e-8, -6e-8, 0.0]  # outliers and float16 subnormals
    if dt == "float16":
        f[1, 1::2] = 3e-6  # half the row subnormal in float16
    x = (f.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16) if dt == "bfloat16" else f.astype(dt)
    xf = (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64) if dt == "bfloat16" else x.astype(np.float64)
    e = np.exp(xf - xf.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    steps = [StepSpec("softmax", {"x": "x"}, {"out": "o"})]
    g, _ = _both(gpu, steps, {"x": TensorSpec((rows, d), dt)}, {"x": x}, ["o"])
    got = (g["o"].astype(np.uint32) << 16).view(np.float32) if dt == "bfloat16" else g["o"]
    from shmrpc.kernels.norm import SOFTMAX

    rtol, atol = SOFTMAX.tolerances[dt]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol)


_FORCED = ["", "1,2,4,2,0", "1,1,8,2,4", "2,2,4,2,3", "4,1,4,2,0", "4,1,2,4,4"]
# w4a16_wk (MT, NWORD, WK, BPS, S, XSM): every built variant, with and without a K split
_FORCED_WK = ["0,4,8,0,4,0", "0,4,8,1,3,1", "0,2,8,2,4,0", "0,2,8,0,4,1", "0,4,4,2,4,0", "1,4,8,0,4,0", "1,4,8,2,3,1", "1,2,8,2,4,1", "1,2,8,0,4,0", "1,1,8,2,4,1", "1,2,4,4,4,1",
              "2,2,8,1,3,1", "2,2,4,0,3,1", "4,2,4,2,2,1", "4,2,2,0,3,1", "4,1,4,4,2,1"]


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize(("m", "k", "n", "gs", "cfg"), [(1, 1024, 8192, 128, ""), (2, 2048, 384, 64, ""), (16, 4096, 512, 128, ""),
                                                         (17, 1024, 256, 64, ""), (33, 1024, 128, 128, ""), (64, 2048, 1024, 128, ""),
                                                         (1, 1024, 16384, 128, ""), (7, 4096, 640, 64, ""), (5, 1024, 320, 64, ""), (12, 2048, 192, 128, ""),
                                                         *((m, 2048, 512, 64, c) for m in (5, 40) for c in _FORCED[1:]),
                                                         *((m, 2048, 512, 64, c) for m in (1, 13, 40) for c in _FORCED_WK),
                                                         (3, 1536, 1024, 128, _FORCED_WK[0]), (5, 4480, 256, 128, _FORCED_WK[8]), (8, 4480, 256, 128, _FORCED_WK[0]),
                                                         (64, 1024, 256, 64, _FORCED_WK[-2]),
                                                         # groups of 3 chunks: the kernels' group index by division, not a shift
                                                         (1, 1536, 8192, 192, ""), (2, 1536, 512, 192, ""), (5, 1536, 512, 192, _FORCED_WK[1]),
                                                         (16, 1536, 512, 192, _FORCED_WK[6])])
def test_w4a16_tensor_core_path(gpu, monkeypatch, m, k, n, gs, cfg, dt) -> None:
    """The mma kernels against float64 x @ dequant(w), activations with outliers (|x| up to 1e3) and subnormals;
    the default table, M = 1 (where it takes tensor cores: no K split through global memory, in a cluster or
    none), and forced configurations of the three kernels (M above one m-block too; chunks
    that do not divide among the warps of a w4a16_wk block)."""
    from support.w4a16 import case, check, force, run

    from shmrpc.kernels._w4a16_config import _mma_cfg

    force(monkeypatch, cfg)
    assert _mma_cfg(m, k, n, gs) is not None
    ins, want = case(m, k, n, gs, dt)
    check(run(gpu, ins, dt), want, dt)
