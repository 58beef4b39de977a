"""gemm_w4a16's wgmma kernels (w4a16_wg, w4a16_wgc: cuda/w4a16_wg.cu, sm_90a) on the GPU, every built variant forced:
against float64 x @ dequant(w) with the op's tolerance, both dtypes, activations with outliers (|x| up to 1e3) and
float16 subnormals, and without outliers (every row at its own scale); M from 1 to above one m-block, K splits that
leave blocks of a cluster without a chunk, groups of 64, 128 and 192 (the group index by division); the same inputs
give the same bits twice. Skipped with the reason where there is no CuPy/GPU, and where the GPU is not sm_90."""

from __future__ import annotations

import pytest
from support.w4a16 import case, check, force, run, same_bits_twice

pytestmark = pytest.mark.gpu


def _wg() -> list[str]:
    from shmrpc.kernels._w4a16_config import _WG_VARIANTS

    return [",".join(map(str, c)) for c in _WG_VARIANTS]


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


@pytest.mark.parametrize("cfg", ["4,2,4,4", "1,4,4,8", "0,4,4,8", "4,2,4,1"])
@pytest.mark.parametrize("m", [1, 16, 64])
def test_w4a16_wgmma_same_bits_twice(sm90, monkeypatch, m, cfg) -> None:
    """The cluster adds its ranks' tiles in a fixed order: the same inputs give the same bits."""
    force(monkeypatch, cfg)
    same_bits_twice(sm90, m)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize(("m", "k", "n", "want"), [(33, 1024, 8192, (4, 1, 4, 8)), (64, 2048, 14336, (4, 1, 4, 4)),
                                                   (48, 1536, 28672, (4, 1, 4, 2))])
def test_w4a16_wgmma_by_default(sm90, monkeypatch, m, k, n, want, dt) -> None:
    """The op's own table (no knob set) takes w4a16_wgc at M 33..64 where it makes two blocks per SM or more, and
    matches."""
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


def _tail_env(monkeypatch, cfg: str, tail: bool) -> None:
    from shmrpc.kernels import _w4a16_config
    from shmrpc.kernels._w4a16_config import W4A16Tuning

    monkeypatch.setattr(_w4a16_config, "_TUNING", W4A16Tuning.from_env(
        {"SHMRPC_W4A16_MMA_CFG": cfg, "SHMRPC_W4A16_TAIL": "1" if tail else "0"}))


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize(("m", "k", "n", "resident"), [(64, 2048, 1024, 6), (33, 4480, 1024, 7), (40, 1024, 2048, 9)])
def test_w4a16_wgc_tail_beside_the_first_wave(sm90, monkeypatch, m, k, n, resident, dt) -> None:
    """Where the device keeps fewer w4a16_wgc clusters resident than the launch needs (here made so: ``_resident``
    says ``resident``), the tiles past them run as a tail launch on a second stream (wg_tail_split): the first wave's
    columns are the bits of the single launch, the tail's those of the tail's configuration over all columns, and the
    whole matches float64."""
    from shmrpc.kernels import quant
    from shmrpc.kernels._w4a16_config import _WG_TAIL, wg_tail_split

    cfg = (4, 1, 4, 8)
    text, tail_text = ",".join(map(str, cfg)), ",".join(map(str, _WG_TAIL[cfg]))
    ins, want = case(m, k, n, 128, dt)
    _tail_env(monkeypatch, text, True)
    asked: list[int] = []

    def resident_of(fn, launch):
        asked.append(launch.grid[0])
        return resident

    monkeypatch.setattr(quant, "_resident", resident_of)
    n1, _ = wg_tail_split(n, cfg, resident)
    assert n1 == resident * 128
    split = run(sm90, ins, dt)
    assert set(asked) == {n // 128}  # the question was asked of the whole launch
    check(split, want, dt)
    _tail_env(monkeypatch, text, False)
    one = run(sm90, ins, dt)
    _tail_env(monkeypatch, tail_text, False)
    tail_only = run(sm90, ins, dt)
    assert split[:, :n1].tobytes() == one[:, :n1].tobytes()
    assert split[:, n1:].tobytes() == tail_only[:, n1:].tobytes()


def test_w4a16_wgc_tail_not_while_captured(sm90, cp, monkeypatch) -> None:
    """While the stream is captured into a graph the op launches w4a16_wgc once (no second stream to fork to)."""
    import numpy as np

    from shmrpc.kernels import quant
    from shmrpc.kernels._cuda import get_function, sm_count

    _tail_env(monkeypatch, "4,1,4,8", True)
    monkeypatch.setattr(quant, "_resident", lambda fn, launch: 6)
    m, k, n = 64, 1024, 1024
    launch = quant._launch_of("F16", m, k, n, 128, (4, 1, 4, 8), sm_count())
    fn = get_function(launch.file, launch.names, launch.name, launch.arch)
    arrays = (cp.zeros((m, k), cp.float16), cp.zeros((k // 2, n), cp.uint8), cp.zeros((k // 128, n), cp.float16),
              cp.zeros((k // 128, n), cp.float16), cp.full((m, n), cp.nan, cp.float16))
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            assert not quant._wg_tailed(fn, launch, "F16", m, k, n, 128, (4, 1, 4, 8), arrays, False)
        finally:
            s.end_capture()
        assert quant._wg_tailed(fn, launch, "F16", m, k, n, 128, (4, 1, 4, 8), arrays, False)
    s.synchronize()
    assert not np.isnan(cp.asnumpy(arrays[4])).any()  # both launches wrote their columns


def test_w4a16_wgc_tail_on_this_device(sm90, monkeypatch) -> None:
    """At M = 64, K = N = 8192 the table's w4a16_wgc needs 64 clusters of 8: the split follows what the driver says
    it keeps resident (on an H200, 62: a tail of two tiles), and the answer matches."""
    from shmrpc.kernels import quant
    from shmrpc.kernels._cuda import get_function, sm_count
    from shmrpc.kernels._w4a16_config import _mma_cfg, wg_tail_split

    m, k, n = 64, 8192, 8192
    _tail_env(monkeypatch, "", True)
    cfg = _mma_cfg(m, k, n, 128, wg=True)
    assert cfg == (4, 1, 4, 8)
    launch = quant._launch_of("F16", m, k, n, 128, cfg, sm_count())
    resident = quant._resident(get_function(launch.file, launch.names, launch.name, launch.arch), launch)
    assert resident is not None and resident > 0
    split = wg_tail_split(n, cfg, resident)
    assert (split is None) == (resident >= n // 128)
    ins, want = case(m, k, n, 128, "float16")
    check(run(sm90, ins, "float16"), want, "float16")
