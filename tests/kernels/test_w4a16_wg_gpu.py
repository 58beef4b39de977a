"""gemm_w4a16's wgmma kernels (w4a16_wg, w4a16_wgc, w4a16_wgm: cuda/w4a16_wg.cu, sm_90a) on the GPU, every built variant forced:
against float64 x @ dequant(w) with the op's tolerance, both dtypes, activations with outliers (|x| up to 1e3) and
float16 subnormals, and without outliers (every row at its own scale); M from 1 to above one m-block, K splits that
leave blocks of a cluster without a chunk, groups of 64, 128 and 192 (the group index by division); the same inputs
give the same bits twice. Skipped with the reason where there is no CuPy/GPU, and where the GPU is not sm_90."""

from __future__ import annotations

import pytest
from support.w4a16 import (
    SUB_SCALES,
    case,
    check,
    force,
    run,
    same_bits_twice,
    wsub_by_scale,
    wsub_one_large_column,
    wsub_scale_not_finite,
)

pytestmark = pytest.mark.gpu


def _wg() -> list[str]:
    from shmrpc.kernels._w4a16_config import _WG_VARIANTS, _WGM_VARIANTS

    return [",".join(map(str, c)) for c in (*_WG_VARIANTS, *_WGM_VARIANTS)]


@pytest.fixture
def sm90(gpu):
    from shmrpc.kernels.quant import _sm90a

    if not _sm90a():
        pytest.skip("wgmma needs an sm_90 GPU (compute capability 9.0)")
    return gpu


def _forced(monkeypatch, cfg: str, m: int, k: int, n: int, gs: int) -> None:
    from shmrpc.kernels._w4a16_config import _mma_cfg

    force(monkeypatch, cfg)
    assert _mma_cfg(m, k, n, gs, wg=True) == tuple(int(v) for v in cfg.split(","))
    assert _mma_cfg(m, k, n, gs, wg=False) is None  # never on a device without wgmma


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", _wg())
@pytest.mark.parametrize(("m", "k", "n", "gs"), [(1, 2048, 1024, 64), (13, 2048, 512, 128), (40, 4480, 1024, 128),
                                                  (64, 1024, 512, 64), (33, 1024, 512, 128), (5, 128, 512, 64),
                                                  (16, 1536, 1024, 192)])
def test_w4a16_wgmma(sm90, monkeypatch, m, k, n, gs, cfg, dt) -> None:
    """K = 4480 (70 chunks: the cluster's blocks get 9 or fewer), K = 128 (two chunks: most blocks of a cluster get
    none), M above 8, 16 or 32 rows: several m-blocks."""
    _forced(monkeypatch, cfg, m, k, n, gs)
    ins, want = case(m, k, n, gs, dt)
    check(run(sm90, ins, dt), want, dt)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", _wg())
@pytest.mark.parametrize(("m", "k", "n", "gs"), [(13, 2048, 1024, 64), (40, 1024, 512, 128)])
def test_w4a16_wgmma_without_outliers(sm90, monkeypatch, m, k, n, gs, cfg, dt) -> None:
    """Every row at its own scale: a wrong activation row or column shows (an outlier would set max|out| and hide it)."""
    _forced(monkeypatch, cfg, m, k, n, gs)
    ins, want = case(m, k, n, gs, dt, outliers=False)
    check(run(sm90, ins, dt), want, dt)


@pytest.mark.parametrize("cfg", ["4,2,4,4", "1,4,4,8", "0,4,4,8", "4,2,4,1", "4,1,4,7", "4,4,2", "4,4,1"])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_w4a16_wgmma_same_bits_twice(sm90, monkeypatch, m, cfg) -> None:
    """The cluster adds its ranks' tiles (w4a16_wgm: first its warpgroups') in a fixed order: the same inputs give the
    same bits."""
    force(monkeypatch, cfg)
    same_bits_twice(sm90, m)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize(("m", "k", "n", "want"), [(33, 1024, 8192, (4, 4, 2)), (40, 1024, 7936, (4, 4, 2)),
                                                   (64, 2048, 14336, (4, 4, 1)), (33, 1024, 8832, (4, 1, 4, 7)),
                                                   (40, 1024, 8960, (4, 1, 4, 6)),
                                                   (48, 1536, 28672, (4, 1, 4, 2))])
def test_w4a16_wgmma_by_default(sm90, monkeypatch, m, k, n, want, dt) -> None:
    """The op's own table (no knob set) takes w4a16_wgm at M 33..64 where its blocks fill 0.6 to 1 wave of one per SM,
    else w4a16_wgc where it makes two blocks per SM or more, and matches."""
    from shmrpc.kernels import _w4a16_config
    from shmrpc.kernels._w4a16_config import W4A16Tuning
    from shmrpc.kernels.quant import w4a16_choice

    monkeypatch.setattr(_w4a16_config, "_TUNING", W4A16Tuning.from_env({}))
    if w4a16_choice(m, k, n, 128) != want:  # the table assumes 132 SMs
        pytest.skip(f"this GPU's SMs give {w4a16_choice(m, k, n, 128)}")
    ins, want_out = case(m, k, n, 128, dt)
    check(run(sm90, ins, dt), want_out, dt)


def test_w4a16_wgmma_module_from_the_disk_cache(sm90, monkeypatch, tmp_path) -> None:
    """The sm_90a module's cubin is written to CUPY_CACHE_DIR and read back by the next build (compiling is made to
    fail then): the op still matches."""
    from cupy.cuda import compiler

    from shmrpc.kernels import _cuda

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_cuda, "_modules", {})
    force(monkeypatch, "4,1,4,8")
    ins, want = case(40, 2048, 1024, 128, "float16")
    check(run(sm90, ins, "float16"), want, "float16")
    assert len(list(tmp_path.glob("shmrpc-sm_90a-*.cubin"))) == 1

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled although the cache holds the cubin")

    monkeypatch.setattr(_cuda, "_modules", {})
    monkeypatch.setattr(compiler, "_NVRTCProgram", no_compile)
    check(run(sm90, ins, "float16"), want, "float16")


# float16 weights through subnormals (W4_WGSUB), in configurations of each wgmma kernel
_SUB_CFGS = ["4,4,2", "4,4,1", "4,1,4,7", "4,2,4,1"]


@pytest.mark.parametrize("cfg", _SUB_CFGS)
@pytest.mark.parametrize("scales", SUB_SCALES)
def test_w4a16_wgmma_float16_weights_through_subnormals_by_scale(sm90, monkeypatch, cfg, scales) -> None:
    """float16 (W4_WGSUB): the weights enter as subnormals times {s * 2^17, s * 2^16} (one PRMT and one HFMA2 per
    register), which float16 holds while |s| < 0.5; columns with a scale from 0.5 are computed again where their
    outputs are stored (w4_fix4). Each range of SUB_SCALES within the op's tolerance against float64, every row at its
    own scale."""
    wsub_by_scale(sm90, monkeypatch, cfg, scales)


@pytest.mark.parametrize("cfg", _SUB_CFGS)
def test_w4a16_wgmma_float16_one_column_of_large_scale(sm90, monkeypatch, cfg) -> None:
    """One column with a scale of 3 in one quant group: its warp's columns are computed again (w4_fix4)."""
    wsub_one_large_column(sm90, monkeypatch, cfg)


@pytest.mark.parametrize("cfg", _SUB_CFGS)
def test_w4a16_wgmma_float16_a_scale_not_finite(sm90, monkeypatch, cfg) -> None:
    """A scale of inf and one of NaN: those columns are not finite, the other columns of their warps (computed again by
    w4_fix4) match."""
    wsub_scale_not_finite(sm90, monkeypatch, cfg)
