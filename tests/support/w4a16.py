"""gemm_w4a16 test cases shared by the GPU tests: inputs with outliers and subnormals and their float64
reference, one run through a backend, the tolerance check, a forced tensor-core configuration."""

from __future__ import annotations

from typing import Any

import numpy as np

from shmrpc.kernels import StepSpec, TensorSpec

__all__ = ["SUB_SCALES", "case", "reference", "run", "force", "check", "forced_check", "same_bits_twice", "wsub_by_scale",
           "wsub_one_large_column", "wsub_scale_not_finite"]


def case(m: int, k: int, n: int, gs: int, dt: str, outliers: bool = True,
         scales: tuple[float, float] = (0.005, 0.02)) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Inputs and float64 reference; ``outliers``: |x| up to 1e3 in row 0 and float16 subnormals in the last row. With
    them max|out| is set by row 0, so an error in the other rows can hide under the tolerance (relative to max|out|):
    ``outliers=False`` checks every row at its own scale. The quant scales are uniform in ``scales``."""
    rng = np.random.default_rng(m * 7 + k + n)
    q = rng.integers(0, 256, (k // 2, n), dtype=np.uint8)
    s = rng.uniform(*scales, (k // gs, n)).astype(np.float16)
    z = rng.integers(0, 16, (k // gs, n)).astype(np.float16)
    f = rng.standard_normal((m, k)) / np.sqrt(k)
    if outliers:
        f[0, :3] = [1e3, -1e3, 5e2]
        f[-1, 3:40] = 3e-6  # float16 subnormals
    x = (f.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16) if dt == "bfloat16" else f.astype(np.float16)
    ins = {"x": x, "q": q, "s": s, "z": z}
    return ins, reference(ins, dt)


def reference(ins: dict[str, np.ndarray], dt: str) -> np.ndarray:
    """float64 x @ dequant(w) of ``case``'s inputs (x's 16-bit words for bfloat16)."""
    from shmrpc.kernels.quant import dequantize_int4

    x = ins["x"]
    xf = (x.astype(np.uint32) << 16).view(np.float32).astype(np.float64) if dt == "bfloat16" else x.astype(np.float64)
    return xf @ dequantize_int4(np, ins["q"], ins["s"], ins["z"]).astype(np.float64)


def run(gpu: Any, ins: dict[str, np.ndarray], dt: str) -> np.ndarray:
    m, k = ins["x"].shape
    steps = [StepSpec("gemm_w4a16", {"x": "x", "qweight": "q", "scales": "s", "zeros": "z"}, {"out": "o"})]
    specs = {"x": TensorSpec((m, k), dt), "q": TensorSpec(ins["q"].shape, "uint8"),
             "s": TensorSpec(ins["s"].shape, "float16"), "z": TensorSpec(ins["z"].shape, "float16")}
    plan = gpu.plan(steps, specs, ["o"])
    out = np.full(plan.outputs["o"].shape, 0x7FC0 if dt == "bfloat16" else 0x7E00, np.uint16)  # NaN: all must be written
    if dt == "float16":
        out = out.view(np.float16)
    gpu.run(plan, ins, {"o": out})
    return (out.astype(np.uint32) << 16).view(np.float32) if dt == "bfloat16" else out


def force(monkeypatch: Any, cfg: str) -> None:
    from shmrpc.kernels import _w4a16_config
    from shmrpc.kernels._w4a16_config import W4A16Tuning

    # the knobs are read once at import: set them as SHMRPC_W4A16_MMA_M1=1 SHMRPC_W4A16_MMA_CFG=cfg would
    monkeypatch.setattr(_w4a16_config, "_TUNING", W4A16Tuning.from_env({"SHMRPC_W4A16_MMA_M1": "1", "SHMRPC_W4A16_MMA_CFG": cfg}))


def forced_check(gpu: Any, monkeypatch: Any, cfg: str, m: int, k: int, n: int, gs: int, dt: str,
                 outliers: tuple[bool, ...] = (True,)) -> None:
    """Force ``cfg``, check that the op takes it for this shape, and check its result against float64, with and/or
    without activation outliers (``outliers``)."""
    from shmrpc.kernels._w4a16_config import _mma_cfg

    force(monkeypatch, cfg)
    assert _mma_cfg(m, k, n, gs) == tuple(int(v) for v in cfg.split(","))
    for with_outliers in outliers:
        ins, want = case(m, k, n, gs, dt, outliers=with_outliers)
        check(run(gpu, ins, dt), want, dt)


def check(got: np.ndarray, want: np.ndarray, dt: str) -> None:
    from shmrpc.kernels.quant import GEMM_W4A16

    rtol, atol = GEMM_W4A16.tolerances[dt]
    scale = np.abs(want).max()
    np.testing.assert_allclose(got.astype(np.float64) / scale, want / scale, rtol=rtol, atol=atol)


def same_bits_twice(gpu: Any, m: int) -> None:
    """The op run twice on the same M x 4096 x 4096 float16 inputs gives the same bits, and matches."""
    ins, want = case(m, 4096, 4096, 128, "float16")
    a = run(gpu, ins, "float16")
    b = run(gpu, ins, "float16")
    assert a.tobytes() == b.tobytes()
    check(a, want, "float16")


# float16 weights through subnormals (dq_wsub: the wgmma kernels' W4_WGSUB, w4a16_wk's W4_WKSUB at MT >= 1), which
# take scales under 0.5; columns of a larger scale, or one not finite, are computed again where they are stored.
# SUB_SCALES: the tests' own, down to 1e-4 (products under float16's normal range), up to float16's last one under 0.5
# (s * 2^17 = 65504), from 0.5, either side of 0.5 (columns of both kinds in one launch), and up to 30
SUB_SCALES = [(0.005, 0.02), (1e-4, 5e-4), (0.49, 0.4997), (0.5, 1.0), (0.3, 0.7), (8.0, 30.0)]


def _force_taken(monkeypatch: Any, cfg: str, m: int) -> None:
    """Force ``cfg`` and check that the op takes it for the M x 2048 x 512 shapes below on an sm_90a device (the one these
    tests run on; elsewhere they skip), so that the kernel under test is the one run."""
    from shmrpc.kernels._w4a16_config import _mma_cfg

    force(monkeypatch, cfg)
    assert _mma_cfg(m, 2048, 512, 128, wg=True) == tuple(int(v) for v in cfg.split(","))


def wsub_by_scale(gpu: Any, monkeypatch: Any, cfg: str, scales: tuple[float, float], m: int = 40) -> None:
    """``cfg`` forced, float16, quant scales uniform in ``scales``, no activation outliers: within the op's tolerance
    against float64, every row at its own scale."""
    _force_taken(monkeypatch, cfg, m)
    ins, want = case(m, 2048, 512, 128, "float16", outliers=False, scales=scales)
    check(run(gpu, ins, "float16"), want, "float16")


def wsub_one_large_column(gpu: Any, monkeypatch: Any, cfg: str, m: int = 24, col: int = 77) -> None:
    """One column (``col``; a scale word holds two columns) with a scale of 3 in one quant group, the others under 0.5:
    that column and the others each match float64 at their own scale."""
    _force_taken(monkeypatch, cfg, m)
    ins, _ = case(m, 2048, 512, 128, "float16", outliers=False)
    ins["s"][5, col] = 3.0
    want, got = reference(ins, "float16"), run(gpu, ins, "float16")
    check(got, want, "float16")
    check(got[:, col:col + 1], want[:, col:col + 1], "float16")
    rest = np.r_[0:col, col + 1:512]
    check(got[:, rest], want[:, rest], "float16")


def wsub_scale_not_finite(gpu: Any, monkeypatch: Any, cfg: str, m: int = 24) -> None:
    """A scale of inf in one column and one of NaN in another: those columns' outputs are not finite, as the reference's,
    and the other columns match float64."""
    _force_taken(monkeypatch, cfg, m)
    ins, _ = case(m, 2048, 512, 128, "float16", outliers=False)
    ins["s"][3, 40] = np.inf
    ins["s"][9, 100] = np.nan
    with np.errstate(invalid="ignore", over="ignore"):  # the reference's 0 * inf and NaN
        want = reference(ins, "float16")
    got = run(gpu, ins, "float16")
    assert not np.isfinite(got[:, 40]).any() and not np.isfinite(got[:, 100]).any()
    rest = np.r_[0:40, 41:100, 101:512]
    check(got[:, rest], want[:, rest], "float16")
