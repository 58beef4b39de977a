"""gemm_w4a16's w4a16_wkc kernels (the K split done by a cluster of blocks) and the one-barrier epilogue of
w4a16_wk on the GPU: against float64 x @ dequant(w) with the op's tolerance, both dtypes, activations with
outliers (|x| up to 1e3) and float16 subnormals; K splits that leave a block or warps without a chunk, M
above one m-block; the same inputs give the same bits twice. Skipped with the reason where there is no
CuPy/GPU."""

from __future__ import annotations

import pytest
from support.w4a16 import (
    SUB_SCALES,
    case,
    check,
    force,
    forced_check,
    run,
    same_bits_twice,
    wsub_by_scale,
    wsub_one_large_column,
    wsub_scale_not_finite,
)

pytestmark = pytest.mark.gpu

# every built w4a16_wkc variant, as the 7-number configuration that forces it
_WKC = [f"{mt},{nw},{wk},0,{st},{xsm},{cl}" for mt, nw, wk, st, xsm, cl in
        ((0, 4, 8, 3, 1, 2), (0, 2, 8, 4, 0, 2), (1, 4, 8, 3, 1, 2), (1, 2, 8, 4, 1, 2), (2, 2, 8, 3, 1, 2),
         (4, 2, 4, 2, 1, 2), (4, 2, 8, 2, 1, 2), (2, 4, 8, 2, 1, 2),
         (2, 4, 8, 3, 1, 2), (-2, 4, 8, 3, 1, 2),
         (0, 4, 12, 3, 1, 2))]

# the swapped operands with NB B operands of 8 rows (MT = -NB), without a K split, split by BPS and by the cluster
_TR_TILES = ["-2,4,8,0,3,1", "-2,4,8,2,3,1", "-2,4,8,0,3,1,2"]


# w4a16_wk variants added with the one-barrier epilogue (the earlier ones are forced in test_kernels_gpu.py), with
# and without a K split
_WK_NEW = ["1,2,8,2,3,0", "1,2,8,0,3,0", "1,2,4,3,3,1", "1,2,4,0,3,1", "4,2,8,1,2,1", "4,2,8,0,2,1", "2,4,8,1,2,1",
           "2,4,8,0,2,1", "2,4,8,0,3,1", "2,4,8,2,3,1"]


# every built w4a16_wkm variant (activations multicast to a cluster of CN column slabs), as the 8-number configuration
_WKM = [f"{mt},{nw},{wk},0,{st},1,1,{cn}" for mt, nw, wk, st, cn in
        ((4, 2, 8, 2, 2), (4, 2, 8, 2, 1), (4, 2, 8, 2, 4), (4, 2, 6, 3, 2))]


# every built w4a16_wk (with a K split), w4a16_wkc and w4a16_wkm variant, forced
def _every_built() -> list[str]:
    from shmrpc.kernels._w4a16_config import _WK_VARIANTS, _WKC_VARIANTS, _WKM_VARIANTS

    return ([f"{mt},{nw},{wk},1,{st},{xsm}" for mt, nw, wk, st, xsm in _WK_VARIANTS]
            + [f"{mt},{nw},{wk},0,{st},{xsm},{cl}" for mt, nw, wk, st, xsm, cl in _WKC_VARIANTS]
            + [f"{mt},{nw},{wk},0,{st},1,1,{cn}" for mt, nw, wk, st, cn in _WKM_VARIANTS])


def test_the_list_is_every_built_variant() -> None:
    from shmrpc.kernels._w4a16_config import _WKC_VARIANTS, _WKM_VARIANTS

    assert sorted(_WKC) == sorted(f"{mt},{nw},{wk},0,{st},{xsm},{cl}" for mt, nw, wk, st, xsm, cl in _WKC_VARIANTS)
    assert sorted(_WKM) == sorted(f"{mt},{nw},{wk},0,{st},1,1,{cn}" for mt, nw, wk, st, cn in _WKM_VARIANTS)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", _WKM)
@pytest.mark.parametrize(("m", "k", "n", "gs"), [(1, 2048, 512, 64), (13, 2048, 512, 64), (40, 2048, 512, 64),
                                                  (64, 4096, 1024, 128), (8, 4480, 256, 128), (5, 64, 512, 64),
                                                  (33, 1536, 2048, 128)])
def test_w4a16_activation_multicast(gpu, monkeypatch, m, k, n, gs, cfg, dt) -> None:
    """w4a16_wkm forced (x packed by chunk, bulk copies multicast to the cluster): M = 1 and 13 (zero rows packed),
    K = 4480 (warps with one chunk fewer), K = 64 (one chunk: warps without any)."""
    forced_check(gpu, monkeypatch, cfg, m, k, n, gs, dt)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", _WKC)
@pytest.mark.parametrize(("m", "k", "n", "gs"), [(1, 2048, 512, 64), (13, 2048, 512, 64), (40, 2048, 512, 64),
                                                  (8, 4480, 256, 128), (5, 64, 512, 64), (3, 1536, 1024, 128)])
def test_w4a16_cluster_split(gpu, monkeypatch, m, k, n, gs, cfg, dt) -> None:
    """w4a16_wkc forced: K = 4480 leaves warps without a chunk, K = 64 (one chunk) the second block of the cluster
    and most warps, M = 40 runs several m-blocks."""
    forced_check(gpu, monkeypatch, cfg, m, k, n, gs, dt)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", _WK_NEW)
@pytest.mark.parametrize(("m", "k", "n", "gs"), [(1, 2048, 512, 64), (13, 2048, 512, 64), (40, 2048, 512, 64),
                                                  (8, 4480, 256, 128), (64, 1024, 512, 128)])
def test_w4a16_new_wk_variants(gpu, monkeypatch, m, k, n, gs, cfg, dt) -> None:
    forced_check(gpu, monkeypatch, cfg, m, k, n, gs, dt)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", _TR_TILES)
@pytest.mark.parametrize(("m", "k", "n", "gs"), [(1, 2048, 512, 64), (9, 2048, 512, 64), (16, 2048, 512, 64),
                                                  (17, 1024, 512, 128), (25, 2048, 256, 64), (40, 2048, 512, 64),
                                                  (12, 4480, 256, 128), (5, 64, 512, 64)])
def test_w4a16_swapped_operands_with_several_b_tiles(gpu, monkeypatch, m, k, n, gs, cfg, dt) -> None:
    """MT = -NB: each dequantized weight tile multiplies NB tiles of 8 activation rows. A second tile with one row
    (M = 9) or none (M = 1, 5), M above one m-block (17, 25, 40), warps or a cluster block without a chunk (K = 4480, 64)."""
    forced_check(gpu, monkeypatch, cfg, m, k, n, gs, dt, outliers=(True, False))


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", _every_built())
@pytest.mark.parametrize(("m", "k", "n", "gs"), [(13, 2048, 512, 64), (40, 1024, 512, 128)])
def test_w4a16_every_variant_without_outliers(gpu, monkeypatch, m, k, n, gs, cfg, dt) -> None:
    """Every row at its own scale: no activation outlier sets max|out| (with one, a wrong activation piece in the other
    rows stays under the tolerance; the probe, whose x has none, caught such a fault where these tests did not)."""
    forced_check(gpu, monkeypatch, cfg, m, k, n, gs, dt, outliers=(False,))


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("cfg", ["0,4,8,1,3,1", "0,4,8,2,3,1", "0,4,8,0,3,1,2", "-2,4,8,1,3,1", "-2,4,8,0,3,1,2"])
@pytest.mark.parametrize(("m", "k", "gs"), [(1, 1152, 128), (3, 1152, 64), (16, 1152, 128), (2, 2048, 256),
                                             (9, 4480, 128), (1, 192, 64)])
def test_w4a16_swapped_operands_across_quant_groups(gpu, monkeypatch, m, k, gs, cfg, dt) -> None:
    """The swapped-operand kernels (MT <= 0) correct each chunk's sums by its quant group's zero and scale: 18 chunks
    leave some warps one chunk more than others; a cluster or K split that starts a block at an odd chunk (9 of 18, 35
    of 70) starts it inside a group of two chunks (group size 128); group size 64 is one chunk per group, 256 four;
    3 chunks leave warps without any. (Written for the runs of two chunks that 88708f8 tried: it passed on the GPU with
    them, 1357 GPU tests at d9eda08, and after the revert, 605 of this file at 6cb74a9.)"""
    forced_check(gpu, monkeypatch, cfg, m, k, 512, gs, dt)


@pytest.mark.parametrize("cfg", ["", "1,4,8,1,3,1", "0,4,8,1,3,1", "1,4,8,0,3,1,2", "0,4,8,0,3,1,2", "4,2,4,1,2,1",
                                 "4,2,8,0,2,1,1,2", "4,2,8,0,2,1,1,1", "-2,4,8,0,3,1,2", "-2,4,8,2,3,1"])
@pytest.mark.parametrize("m", [1, 2, 16, 40])
def test_w4a16_same_bits_twice(gpu, monkeypatch, m, cfg) -> None:
    """The epilogue adds warps, blocks and cluster ranks in a fixed order: the same inputs give the same bits."""
    if cfg:
        force(monkeypatch, cfg)
    same_bits_twice(gpu, m)


def _same_bits_as_build(gpu, cp, monkeypatch, cfg: str, m: int, k: int, dt: str, defs: tuple[str, ...],
                        gs: int = 64) -> None:
    """The op forced to ``cfg`` (N = 512, group size ``gs``) matches float64 within its tolerance and gives the bits of
    the same kernel built with ``defs``."""
    n = 512
    force(monkeypatch, cfg)
    ins, want = case(m, k, n, gs, dt)
    got = run(gpu, ins, dt)
    check(got, want, dt)
    c = tuple(int(v) for v in cfg.split(","))
    assert _bits(got, dt) == _built_run(cp, ins, m, k, n, gs, c, dt, defs)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize(("cfg", "m", "k"), [("0,4,8,0,3,1,2", 1, 2048), ("0,4,8,0,3,1,2", 6, 4480),
                                             ("0,4,8,0,3,1,2", 3, 64), ("-2,4,8,0,3,1,2", 16, 2048),
                                             ("1,4,8,0,3,1,2", 9, 1024)])
def test_w4a16_cluster_push_gives_the_bits_of_two_barriers(gpu, cp, monkeypatch, cfg, m, k, dt) -> None:
    """w4a16_wkc with clusters of 2 and one m-block: rank 1 stores its block sum into rank 0's tile (st.async on an
    mbarrier) and rank 0 writes every output. The same kernel built with -DW4_PUSH=0 (both ranks read both tiles between
    two cluster barriers, as before) gives the same bits: rank 0's sum plus rank 1's, in that order, either way."""
    _same_bits_as_build(gpu, cp, monkeypatch, cfg, m, k, dt, ("-DW4_PUSH=0",))


def _bits(got, dt: str) -> bytes:
    """The op's output as the 16-bit words a kernel writes."""
    import numpy as np

    return (got.view(np.uint16) if dt == "float16" else (got.view(np.uint32) >> 16).astype(np.uint16)).tobytes()


def _built_run(cp, ins, m: int, k: int, n: int, gs: int, c: tuple[int, ...], dt: str, options: tuple[str, ...]) -> bytes:
    """The output words of configuration ``c`` (w4a16_wk / w4a16_wkc, or four numbers: w4a16_wg / w4a16_wgc, three:
    w4a16_wgm, for sm_90a) built from today's source with the extra compile ``options`` (a probe build), launched on ``ins`` as the op
    launches it."""
    import numpy as np

    from shmrpc.kernels._cuda import _ArchModule, sm_count, source
    from shmrpc.kernels._w4a16_config import _wg_name, _wg_warps, _wk_name, w4a16_wg_launch, w4a16_wk_launch
    from shmrpc.kernels.quant import wk_launch

    kt = "F16" if dt == "float16" else "BF16"
    out = cp.zeros((m, n), dtype=cp.uint16)
    arrays = (cp.asarray(ins["x"]).view(cp.uint16), cp.asarray(ins["q"]), cp.asarray(ins["s"]), cp.asarray(ins["z"]))
    if len(c) in (3, 4):
        name = _wg_name(kt, c)
        fn = _ArchModule(source("w4a16_mma.cu+w4a16_wg.cu"), (name,), "sm_90a", options).get_function(name)
        grid, cpb, smem = w4a16_wg_launch(m, k, n, c)
        wk_launch(fn, grid, _wg_warps(c), smem, (*arrays, out, *(np.int32(v) for v in (m, k, n, gs // 2, cpb))))
        return out.get().tobytes()
    mod = cp.RawModule(code=source("w4a16_mma.cu"), options=("-std=c++17", *options), name_expressions=[_wk_name(kt, c)])
    fn = mod.get_function(_wk_name(kt, c))
    (tiles, ksplit), cpb, smem = w4a16_wk_launch(m, k, n, sm_count(), c)
    partial = cp.empty((max(1, ksplit * m * n) if len(c) == 6 else 1,), dtype=cp.float32)
    args = (*arrays, partial, cp.zeros(1024, dtype=cp.uint32), out, *(np.int32(v) for v in (m, k, n, gs // 2, cpb)))
    wk_launch(fn, (tiles, ksplit), c[2], smem, args)
    return out.get().tobytes()


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize(("cfg", "m", "k", "gs"), [("4,1,4,7", 64, 1024, 64), ("4,1,4,7", 40, 4480, 128),
                                                   ("4,1,4,4", 33, 1536, 192), ("4,1,4,8", 64, 128, 64),
                                                   ("4,2,4,4", 64, 1024, 128), ("4,2,4,1", 40, 1024, 64),
                                                   ("4,4,2", 64, 1024, 64), ("4,4,1", 40, 4480, 128)])
def test_w4a16_wgc_switches_give_the_bits_of_before(gpu, cp, monkeypatch, cfg, m, k, gs, dt) -> None:
    """w4a16_wgc's second cluster barrier arrives without release (W4_WGEPI), its copies are addressed by 32-bit offsets
    (W4_WGOFF) and issued in one run, predicated, the scales' group by a multiply-high (W4_WGCP), the k16 steps'
    descriptors are the chunk's plus an offset (W4_WGDS), and its NWORD 1 kernels are held to their blocks per SM
    (W4_WGLB): the same kernel built with all five off gives the same bits (the same products, the ranks' tiles added
    in the same order; K = 128: most ranks without a chunk; M = 33 and 40: rows of the m-block not copied; group sizes
    of 1, 2 and 3 chunks; (4, 2, 4, 1): no cluster; three numbers: w4a16_wgm, four warpgroups per block)."""
    from shmrpc.kernels.quant import _sm90a

    if not _sm90a():
        pytest.skip("wgmma needs an sm_90 GPU (compute capability 9.0)")
    _same_bits_as_build(gpu, cp, monkeypatch, cfg, m, k, dt,
                        ("-DW4_WGEPI=0", "-DW4_WGLB=0", "-DW4_WGOFF=0", "-DW4_WGCP=0", "-DW4_WGDS=0"), gs)


@pytest.mark.parametrize(("cfg", "m", "k", "gs"), [("2,4,8,0,3,1,2", 32, 2048, 128), ("2,2,8,1,3,1", 20, 1024, 64),
                                                   ("1,4,8,1,3,1", 9, 4480, 128), ("4,2,8,1,2,1", 40, 1024, 64),
                                                   ("4,1,4,7", 64, 1024, 64), ("4,4,2", 64, 4480, 128),
                                                   ("4,4,1", 33, 1024, 64)])
def test_w4a16_bfloat16_scales_converted_two_at_once_give_the_bits_of_before(gpu, cp, monkeypatch, cfg, m, k, gs) -> None:
    """bfloat16 at MT >= 1 and in the wgmma kernels converts a chunk's float16 scales to bfloat16, and makes -(128 + z),
    two columns per hardware conversion (W4_BFSZ): the same values as one software rounding per value, so the same
    bits as the build with -DW4_BFSZ=0, and float64 within the op's tolerance."""
    if len(cfg.split(",")) in (3, 4):
        from shmrpc.kernels.quant import _sm90a

        if not _sm90a():
            pytest.skip("wgmma needs an sm_90 GPU (compute capability 9.0)")
    _same_bits_as_build(gpu, cp, monkeypatch, cfg, m, k, "bfloat16", ("-DW4_BFSZ=0",), gs)


@pytest.mark.parametrize("cfg", ["2,4,8,1,3,1", "4,2,8,1,2,1", "4,4,1"])
def test_w4a16_bfloat16_scales_over_float16s_range_give_the_bits_of_before(gpu, cp, monkeypatch, cfg) -> None:
    """W4_BFSZ's conversion against f2b's for every kind of float16 scale: subnormal, normal from 6e-5 to 65504 (where
    rounding to bfloat16's 8 bits carries into the exponent too), inf and NaN (whose column's outputs are then not
    finite either way, and stored as f2b stores a NaN)."""
    import numpy as np

    if len(cfg.split(",")) in (3, 4):
        from shmrpc.kernels.quant import _sm90a

        if not _sm90a():
            pytest.skip("wgmma needs an sm_90 GPU (compute capability 9.0)")
    m, k, n, gs = 40, 1024, 512, 64
    force(monkeypatch, cfg)
    ins, _ = case(m, k, n, gs, "bfloat16", outliers=False)
    rng = np.random.default_rng(5)
    s = np.exp2(rng.uniform(-24, 15.99, ins["s"].shape)).astype(np.float16)
    s[0, 3], s[1, 7], s[2, 9], s[0, 11] = np.inf, np.nan, -np.inf, np.float16(65504)
    s[3, :8] = np.float16(np.float16(1) + np.float16(2 ** -10) * np.arange(8))  # the ties and neighbours of 1 + 2^-8
    ins["s"] = s
    got = run(gpu, ins, "bfloat16")
    assert not np.isfinite(got[:, [3, 7, 9]]).any()
    assert np.isfinite(got[:, 1]).all()
    c = tuple(int(v) for v in cfg.split(","))
    assert _bits(got, "bfloat16") == _built_run(cp, ins, m, k, n, gs, c, "bfloat16", ("-DW4_BFSZ=0",))


# float16 weights through subnormals in w4a16_wk at MT >= 1 (W4_WKSUB), in each of its epilogues: clusters of 2 with
# the push (M <= 16 * MT) and without it (two m-blocks at M = 40), a global K split (the last block adds the partials),
# no split
_WKSUB_CFGS = ["2,4,8,0,3,1,2", "2,4,8,1,3,1", "2,4,8,0,3,1", "1,4,8,0,3,1,2", "4,2,8,1,2,1", "2,2,8,0,3,1,2"]


@pytest.mark.parametrize("cfg", _WKSUB_CFGS)
@pytest.mark.parametrize("scales", SUB_SCALES)
@pytest.mark.parametrize("m", [24, 40])
def test_w4a16_wk_float16_weights_through_subnormals_by_scale(gpu, monkeypatch, cfg, scales, m) -> None:
    """float16 at MT >= 1 (W4_WKSUB): the weights as subnormals times {s * 2^17, s * 2^16}, one PRMT and one HFMA2 per
    pair; a block whose chunks have a scale of 0.5 or more (or one not finite) computes its sums again before they are
    stored or added (w4_fix4_call). The wgmma tests' scale ranges, each within the op's tolerance against float64,
    every row at its own scale."""
    wsub_by_scale(gpu, monkeypatch, cfg, scales, m)


@pytest.mark.parametrize("cfg", _WKSUB_CFGS)
@pytest.mark.parametrize(("m", "col"), [(24, 77), (40, 77), (24, 76)])
def test_w4a16_wk_float16_one_column_of_large_scale(gpu, monkeypatch, cfg, m, col) -> None:
    """One column with a scale of 3 in one quant group (the first or the second of its scale word): its block's sums are
    computed again, and match."""
    wsub_one_large_column(gpu, monkeypatch, cfg, m, col)


@pytest.mark.parametrize("cfg", _WKSUB_CFGS)
def test_w4a16_wk_float16_a_scale_not_finite(gpu, monkeypatch, cfg) -> None:
    """A scale of inf and one of NaN: those columns are not finite, the other columns of their blocks match."""
    wsub_scale_not_finite(gpu, monkeypatch, cfg)


# the switches of the chunk loop and the epilogue that leave the arithmetic as it was (docs/kernels.md, "One row's
# correction ..."), each set to its earlier behaviour
_BEFORE = ("-DW4_HALF=0", "-DW4_M1=0", "-DW4_ZLATE=0", "-DW4_EDEAD=0", "-DW4_SZV=0")


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize(("cfg", "m", "k"), [("0,4,8,1,3,1", 1, 2048), ("0,4,8,0,3,1,2", 1, 4480),
                                             ("0,4,8,0,3,1", 1, 1024), ("0,4,8,1,3,1", 5, 1024),
                                             ("0,4,8,0,3,1", 12, 1024), ("-2,4,8,0,3,1", 20, 1024),
                                             ("-2,4,8,1,3,1", 16, 2048), ("0,4,12,0,3,1,2", 3, 2048),
                                             ("2,4,8,1,3,1", 32, 2048), ("2,4,8,0,3,1,2", 24, 1024),
                                             ("4,2,8,1,2,1", 40, 1024), ("1,4,8,0,3,1,2", 9, 4480)])
def test_w4a16_loop_and_epilogue_switches_give_the_bits_of_before(gpu, cp, monkeypatch, cfg, m, k, dt) -> None:
    """The product build copies a chunk in two groups at MT > 0 (W4_HALF), corrects only batch row 2t of the swapped
    operands at M = 1 (W4_M1), zeroes the staged rows >= M after an m-block's first copies are issued (W4_ZLATE),
    and at MT = 0 stores and adds only the epilogue slots of rows < M without a cluster (W4_EDEAD) and reads the
    correction's scales and zeros as 16-byte words (W4_SZV): the same arithmetic in the same order, so the same bits as the kernel built
    with all five off (as before), and the op's tolerance against float64. With one m-block and several (M = 12 at
    MT 0, 20 at MT -2: a last m-block of fewer rows), a global K split (BPS 1 on 4 tiles), none, and clusters."""
    _same_bits_as_build(gpu, cp, monkeypatch, cfg, m, k, dt, _BEFORE)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize(("m", "k", "n", "env"), [(1, 8192, 256, {"SHMRPC_W4A16_MMA_M1": "0"}), (1, 4096, 8192 + 64, {}),
                                                  (3, 1024, 1024, {"SHMRPC_W4A16_MMA": "0"})])
def test_w4a16_cuda_core_kernel_stays_tested(gpu, monkeypatch, m, k, n, env, dt) -> None:
    """M = 1 goes to tensor cores by default now; the float32 CUDA-core kernel (SHMRPC_W4A16_MMA_M1=0, N % 128 != 0
    at M = 1, or the tensor-core path off) with its K split still matches."""
    from shmrpc.kernels import _w4a16_config
    from shmrpc.kernels._w4a16_config import W4A16Tuning, _mma_cfg

    monkeypatch.setattr(_w4a16_config, "_TUNING", W4A16Tuning.from_env(env))
    assert _mma_cfg(m, k, n, 128) is None
    ins, want = case(m, k, n, 128, dt)
    check(run(gpu, ins, dt), want, dt)
