"""Host-side choices of the tensor-core gemm_w4a16 path (no GPU needed): which configuration a shape
gets, and that the launch geometry covers every column and every 64-k chunk exactly once."""

from __future__ import annotations

import pytest

from shmrpc.kernels._w4a16_config import (
    _ASYNC_VARIANTS,
    _MMA_TABLE,
    _MMA_VARIANTS,
    _WG_PER_SM,
    _WG_VARIANTS,
    _WGM_VARIANTS,
    _WK_SMEM_MAX,
    _WK_VARIANTS,
    _WKC_VARIANTS,
    _WKM_VARIANTS,
    W4A16Tuning,
    _global_split,
    _is_wg,
    _mma_cfg,
    _mma_names,
    _mma_row,
    _takes,
    _wg_name,
    _wg_names,
    _wg_smem,
    _wg_warps,
    _wk_name,
    _wk_rows,
    _wk_smem,
    use_tuning,
    w4a16_mma_launch,
    w4a16_wg_launch,
    w4a16_wk_launch,
)


@pytest.mark.parametrize("wg", [False, True])
@pytest.mark.parametrize("m", [1, 2, 8, 9, 16, 17, 32, 33, 64, 65])
@pytest.mark.parametrize("n", [4096, 8192, 14336])
def test_table_by_m(m, n, wg) -> None:
    """Every M up to 64 takes the first entry of its row that takes N: a cluster split where its CL is the split
    the column tiles ask for (2: 8192 at M <= 32, 64-column tiles of 4096 at M > 16), else the kernel with its
    global split (or none: 14336); M = 1 a global split only where the launches are dependent (sm_90: wg; else 4096
    takes the CUDA-core kernel). On an sm_90 device (wg) M 33..64 take w4a16_wgm (four warpgroups per block) where
    its blocks fill one wave of one per SM (8192: clusters of 2, 14336: none), else w4a16_wgc (MT 4, NWORD 1) with
    the largest cluster whose blocks fit in one wave of four per SM."""
    with use_tuning(**vars(W4A16Tuning())):  # the defaults, whatever this process's environment says
        cfg = _mma_cfg(m, 4096, n, 128, wg=wg)
    if m > 64 or (m == 1 and n == 4096 and not wg):
        assert cfg is None
        return
    row, base = _mma_row(m, n, 132), next(c for mmax, c in _MMA_TABLE if m <= mmax)
    wgs = tuple(c for c in base if _is_wg(c))  # the table's row, its wgmma entries first, then perhaps
    assert set(row) == set(base) and row[:len(wgs)] == wgs  # _MANY_TILES_FIRST's entry (also in the row) moved up
    assert cfg is not None and cfg in row
    assert m <= _wk_rows(cfg[0])  # one m-block: the weights are read once
    assert cfg == next(c for c in row if (wg or not _is_wg(c)) and _takes(c, n, 132)
                       and (m > 1 or wg or not _global_split(c, 4096, n, 132)))
    if 32 < m <= 64 and wg and n > 4096:  # N = 4096: 32 tiles, 64 blocks in clusters of 2: under 0.6 of the SMs
        assert cfg == (4, 4, 1 if n == 14336 else 2)  # 112 tiles x 1 and 64 x 2 blocks: one wave, over 0.6 of it
        return
    if 32 < m <= 64 and wg:  # 32 tiles x 8 = 256 blocks, fewer than two per SM: no wgmma entry takes it
        assert not _is_wg(cfg)
    tiles = n // (32 * cfg[1])
    if len(cfg) == 7:
        assert tiles * cfg[6] <= 132 and round(132 / tiles) == cfg[6]
    if n == 14336:
        assert len(cfg) < 7  # 112 column tiles of 128: no split to make (BPS = 1 picks 1)
    if 16 < m <= 32 and n in (8192, 14336):
        assert cfg[:3] == (2, 4, 8)  # the wide slab: each A fragment over 16 n-tiles, half the activation traffic


def test_wk_smem_activation_rows_padded_unless_too_big() -> None:
    """Staged activation rows are 144 bytes (padded) unless that passes 227 KiB at MT > 0: then 128 (swizzled);
    the kernel (w4a16_mma.cu, wk_body) makes the same choice."""
    assert _wk_smem((1, 4, 8, 0, 3, 1)) == 8 * 3 * (36 * 128 + 16 * 144) + 16 * 132 * 4
    assert _wk_smem((1, 4, 8, 0, 4, 1)) == 8 * 4 * (36 * 128 + 16 * 144) + 16 * 132 * 4  # 224.25 KiB: fits padded
    assert _wk_smem((2, 4, 8, 0, 3, 1)) == 8 * 3 * (36 * 128 + 32 * 128) + 32 * 132 * 4  # padded: 232.5 KiB
    assert _wk_smem((0, 4, 8, 0, 3, 1)) == 8 * 3 * (36 * 128 + 8 * 144) + 8 * 132 * 4  # MT = 0: always padded
    assert _wk_smem((1, 4, 8, 0, 4, 0)) == 8 * 4 * 36 * 128 + 16 * 132 * 4  # no activations staged
    assert _wk_smem((0, 4, 8, 0, 3, 1, 2)) == _wk_smem((0, 4, 8, 0, 3, 1)) + 16  # w4a16_wkc: its mbarrier after the tile
    assert _wk_smem((2, 4, 8, 0, 3, 1, 2)) == _wk_smem((2, 4, 8, 0, 3, 1)) + 16 <= _WK_SMEM_MAX


def test_m1_falls_back_to_the_cuda_core_kernel() -> None:
    with use_tuning(**vars(W4A16Tuning())):
        assert _mma_cfg(1, 4096, 4096 + 64, 128) is None  # N % 128 != 0: no M = 1 entry takes it
        assert _mma_cfg(1, 4096, 4096, 128) is None  # (0, 4, 8, 1, 3, 1) would split K 4 ways in global memory
        # ... which it does on sm_90, where the launch is a dependent one; with PDL off it does not
        assert _mma_cfg(1, 4096, 4096, 128, wg=True) == (0, 4, 8, 1, 3, 1)
        with use_tuning(pdl=False):
            assert _mma_cfg(1, 4096, 4096, 128, wg=True) is None
        assert _mma_cfg(2, 4096, 4096, 128) == (0, 4, 8, 1, 3, 1)  # from M = 2 it may
        assert _mma_cfg(1, 4096, 14336, 128) == (0, 4, 8, 1, 3, 1)  # 112 column tiles: no split
        assert _mma_cfg(1, 8192, 8192, 128) == (0, 4, 8, 0, 3, 1, 2)  # the cluster split (8 warps)
        assert _mma_cfg(2, 4096, 4096 + 64, 128) == _MMA_TABLE[1][1][-1]  # M = 2: the kernel after them
        with use_tuning(mma_m1=False):
            assert _mma_cfg(1, 4096, 4096, 128) is None
    assert W4A16Tuning.from_env({"SHMRPC_W4A16_MMA_M1": "0"}).mma_m1 is False


def test_shapes_it_does_not_take_fall_back() -> None:
    with use_tuning(**vars(W4A16Tuning())):
        assert _mma_cfg(16, 4096 + 32, 1024, 32) is None  # K % 64, group 32
        assert _mma_cfg(16, 4096, 1024 + 32, 128) is None  # N % 64: no configuration takes it
        assert _mma_cfg(16, 4096, 1024 + 64, 128) == _MMA_TABLE[2][1][-1]  # N % 128 != 0: the last one
        assert _mma_cfg(16, 4096, 1024, 128) is not None
        with use_tuning(mma=False):
            assert _mma_cfg(16, 4096, 1024, 128) is None


def test_opt_ins() -> None:
    with use_tuning(**vars(W4A16Tuning(mma_m1=True))):
        assert _mma_cfg(1, 8192, 8192, 128) is not None
        with use_tuning(h2=True):
            assert _mma_cfg(3, 1024, 1024, 128) is None  # the float16x2 kernel was asked for
        with use_tuning(mma_cfg=(9, 9, 9, 9, 9)):
            assert _mma_cfg(8, 1024, 1024, 128) is None  # unknown variant: never a kernel that was not compiled


def test_tuning_is_read_from_the_environment_once() -> None:
    env = {"SHMRPC_W4A16_MMA": "0", "SHMRPC_W4A16_MMA_CFG": "1,2,4,2,0", "SHMRPC_W4A16_H2": "1",
           "SHMRPC_W4A16_BLOCKS_PER_SM": "3", "SHMRPC_W4A16_DEQUANT_MIN_M": "9", "SHMRPC_W4A16_MMA_M1": "0"}
    assert W4A16Tuning.from_env(env) == W4A16Tuning(blocks_per_sm=3, dequant_min_m=9, h2=True, mma=False, mma_m1=False,
                                                    mma_cfg=(1, 2, 4, 2, 0))
    assert W4A16Tuning.from_env({}) == W4A16Tuning()


@pytest.mark.parametrize("cfg", [(*v, bps, 0) for v in _MMA_VARIANTS for bps in (1, 2, 4)]
                         + [(*v[:3], bps, v[3]) for v in _ASYNC_VARIANTS for bps in (1, 2, 8)])
def test_launch_covers_shapes(cfg) -> None:
    for k in range(1024, 28673, 3968):
        for n in (1024, 4096, 14336, 28672):
            k64 = k // 64 * 64
            (tiles, ksplit), cpb = w4a16_mma_launch(16, k64, n, 132, cfg)
            assert tiles * cfg[2] * 32 * cfg[1] >= n > (tiles - 1) * cfg[2] * 32 * cfg[1]
            chunks = k64 // 64
            assert ksplit * cpb >= chunks > (ksplit - 1) * cpb  # every chunk once, no empty block
            assert ksplit <= 65535


@pytest.mark.parametrize("cfg", [(mt, nw, wk, bps, st, xsm) for mt, nw, wk, st, xsm in _WK_VARIANTS for bps in (0, 1, 2, 4)])
def test_wk_launch_covers_shapes(cfg) -> None:
    """w4a16_wk: one block per 32*NWORD columns (N divides), every 64-k chunk in exactly one block, shared memory
    within what a block may opt in to."""
    assert _wk_smem(cfg) <= _WK_SMEM_MAX
    for k in range(1024, 28673, 3968):
        for n in (1024, 4096, 14336, 28672):
            k64 = k // 64 * 64
            (tiles, ksplit), cpb, smem = w4a16_wk_launch(16, k64, n, 132, cfg)
            assert tiles * 32 * cfg[1] == n and smem == _wk_smem(cfg)
            chunks = k64 // 64
            assert ksplit * cpb >= chunks > (ksplit - 1) * cpb
            assert ksplit <= 65535 and (cfg[3] > 0 or ksplit == 1)


def test_wk_configurations_by_name() -> None:
    env = {"SHMRPC_W4A16_MMA_CFG": "1,2,8,2,4,1"}
    assert W4A16Tuning.from_env(env).mma_cfg == (1, 2, 8, 2, 4, 1)
    with use_tuning(**vars(W4A16Tuning(mma_m1=True, mma_cfg=(1, 2, 8, 2, 4, 1)))):
        assert _mma_cfg(16, 4096, 1024, 128) == (1, 2, 8, 2, 4, 1)
        assert _mma_cfg(16, 4096, 1024 + 32, 128) is None  # N % 64
    with use_tuning(**vars(W4A16Tuning(mma_m1=True, mma_cfg=(1, 2, 8, 2, 5, 1)))):
        assert _mma_cfg(16, 4096, 1024, 128) is None  # not built


def test_devices_with_less_shared_memory_take_the_next_configuration() -> None:
    with use_tuning(**vars(W4A16Tuning())):
        big = _mma_cfg(8, 4096, 1024, 128)
        assert big is not None and len(big) == 6 and _wk_smem(big) > 99 * 1024
        assert _mma_cfg(8, 4096, 1024, 128, smem_max=99 * 1024) == _MMA_TABLE[1][1][-1]  # e.g. sm_89: 99 KiB


@pytest.mark.parametrize("cfg", [(mt, nw, wk, 0, st, xsm, cl) for mt, nw, wk, st, xsm, cl in _WKC_VARIANTS])
def test_wkc_launch_covers_shapes(cfg) -> None:
    """w4a16_wkc: grid (N / (32*NWORD), CL), the CL blocks of a column tile split the chunks, every chunk in exactly
    one block; the block's sum tile is in the shared memory the host asks for."""
    assert _wk_smem(cfg) <= _WK_SMEM_MAX
    for k in (64, 128, *range(1024, 28673, 3968)):
        for n in (1024, 4096, 14336, 28672):
            k64 = k // 64 * 64
            (tiles, ksplit), cpb, smem = w4a16_wk_launch(16, k64, n, 132, cfg)
            assert tiles * 32 * cfg[1] == n and ksplit == cfg[6] and smem == _wk_smem(cfg)
            assert ksplit * cpb >= k64 // 64 > (ksplit - 1) * cpb or (k64 // 64 < ksplit and cpb == 1)


def test_wkc_configurations_by_name_and_one_wave() -> None:
    env = {"SHMRPC_W4A16_MMA_CFG": "1,4,8,0,3,1,2"}
    cfg = W4A16Tuning.from_env(env).mma_cfg
    assert cfg == (1, 4, 8, 0, 3, 1, 2)
    assert _wk_name("F16", cfg) == "w4a16_wkc<F16,1,4,8,3,1,2>" and _wk_name("F16", cfg) in _mma_names("F16")
    with use_tuning(**vars(W4A16Tuning(mma_m1=True, mma_cfg=cfg))):
        assert _mma_cfg(16, 4096, 8192, 128) == cfg  # 64 column tiles x 2 blocks: one wave on 132 SMs
        assert _mma_cfg(16, 4096, 14336, 128) is None  # 112 x 2 would need two waves
        assert _mma_cfg(16, 4096, 14336, 128, n_sm=264) == cfg
        assert _mma_cfg(16, 4096, 1024, 128) == cfg  # forced: wherever one wave holds it
        assert _mma_cfg(16, 4096, 1024 + 64, 128) is None  # N % 128
    assert not _takes(cfg, 1024, 132) and _takes(cfg, 1024, 132, forced=True)  # a table entry: only as the split of BPS 1
    for bad in ((1, 4, 8, 1, 3, 1, 2), (1, 4, 8, 0, 3, 1, 3)):  # BPS must be 0; CL 3 not built
        with use_tuning(**vars(W4A16Tuning(mma_m1=True, mma_cfg=bad))):
            assert _mma_cfg(16, 4096, 8192, 128) is None


@pytest.mark.parametrize("cfg", [(mt, nw, wk, 0, st, 1, 1, cn) for mt, nw, wk, st, cn in _WKM_VARIANTS])
def test_wkm_launch_names_and_clusters(cfg) -> None:
    """w4a16_wkm: grid (N / (32*NWORD), 1), every chunk in every block, padded 144-byte activation rows (as packed)
    plus two mbarriers per warp and stage within what a block may opt in to; taken where the column tiles divide into
    clusters of CN (a table entry: in one wave); its packing kernel is built too."""
    mt, nw, wk, _, st, _, _, cn = cfg
    bc, mr = 32 * nw, 16 * mt
    assert _wk_smem(cfg) == wk * st * (36 * bc + mr * 144) + mr * (bc + 4) * 4 + 16 * wk * st <= _WK_SMEM_MAX
    assert f"w4_xpack<{mr}>" in _mma_names("BF16")
    for k in (64, 4480, 8192):
        for n in (1024, 4096, 14336):
            (tiles, ksplit), cpb, smem = w4a16_wk_launch(64, k, n, 132, cfg)
            assert tiles * bc == n and ksplit == 1 and cpb == k // 64 and smem == _wk_smem(cfg)
    assert _wk_name("F16", cfg) == f"w4a16_wkm<F16,{mt},{nw},{wk},{st},{cn}>" and _wk_name("F16", cfg) in _mma_names("F16")
    assert W4A16Tuning.from_env({"SHMRPC_W4A16_MMA_CFG": ",".join(map(str, cfg))}).mma_cfg == cfg
    assert _takes(cfg, 8192, 132) and (cn == 1 or not _takes(cfg, bc * (2 * cn + 1), 132))  # tiles % CN
    assert not _takes(cfg, 14336, 132) and _takes(cfg, 14336, 132, forced=True)  # 224 tiles: two waves
    assert not _takes(cfg, 4096, 132) and _takes(cfg, 4096, 132, forced=True)  # 64 tiles: BPS 1 would split K 2 ways
    assert not _global_split(cfg, 8192, 8192, 132)
    with use_tuning(**vars(W4A16Tuning(mma_m1=True, mma_cfg=cfg))):
        assert _mma_cfg(64, 4096, 8192, 128) == cfg
        assert _mma_cfg(64, 4096, 8192, 128, smem_max=_wk_smem(cfg) - 1) is None  # a device with less shared memory
    for bad in ((*cfg[:3], 1, *cfg[4:]), (*cfg[:5], 0, *cfg[6:]), (*cfg[:6], 2, cn), (*cfg[:7], 3), (*cfg[:7], 8)):
        with use_tuning(**vars(W4A16Tuning(mma_m1=True, mma_cfg=bad))):  # BPS 0, XSM 1, CL 1; CN 3 not built
            assert _mma_cfg(64, 4096, 8192, 128) is None


@pytest.mark.parametrize(("m", "n", "want"), [(33, 14336, (4, 2, 4, 1, 2, 1)), (48, 14336, (4, 2, 4, 1, 2, 1)),
                                              (49, 14336, (4, 2, 8, 1, 2, 1)), (64, 14336, (4, 2, 8, 1, 2, 1)),
                                              (40, 8192, (4, 2, 8, 1, 2, 1)), (40, 8448, (4, 2, 8, 1, 2, 1)),
                                              (40, 8448 + 64, (4, 2, 4, 1, 2, 1)), (40, 4096, (4, 2, 8, 0, 2, 1, 2))])
def test_m33_48_four_warps_where_tiles_outnumber_the_sms(m, n, want) -> None:
    """M 33..48: (4, 2, 4, 1, 2, 1) (two blocks per SM) first where N / 64 column tiles are more than the SMs (the 8-warp
    blocks would need a second wave); not at M > 48, not where one wave holds the tiles (8192 + 256 = 132 tiles)."""
    with use_tuning(**vars(W4A16Tuning())):
        assert _mma_cfg(m, 4096, n, 128) == want
        if want == (4, 2, 4, 1, 2, 1):
            assert _mma_cfg(m, 4096, n, 128, n_sm=264) == (4, 2, 8, 1, 2, 1)  # a device with the SMs for one wave


@pytest.mark.parametrize("cfg", _WG_VARIANTS)
def test_wg_launch_names_and_shared_memory(cfg) -> None:
    """w4a16_wg / w4a16_wgc: grid (N / (128*NWORD), CL), every 64-k chunk in exactly one block of the cluster, the
    stages (1024-byte multiples) or the float32 tile, plus 1024 bytes of alignment, within what a block may opt in to;
    taken only on an sm_90 device (``wg``), forced wherever 128*NWORD divides N, from the table only in one wave."""
    mt, nw, st, cl = cfg
    nb, bc = (16 * mt if mt else 8), 32 * nw
    stage = -(-(nb * 128 + 144 * bc) // 1024) * 1024
    assert _wg_smem(cfg) == max(st * stage, nb * (4 * bc + 4) * 4) + 1024 <= _WK_SMEM_MAX
    for k in (64, 128, 4480, 8192, 28672):
        for n in (1024, 4096, 14336, 28672):
            if n % (4 * bc):
                continue
            (tiles, ksplit), cpb, smem = w4a16_wg_launch(64, k, n, cfg)
            assert tiles * 4 * bc == n and ksplit == cl and smem == _wg_smem(cfg)
            assert (cl - 1) * cpb < k // 64 <= cl * cpb or (k // 64 < cl and cpb == 1)
    name = _wg_name("F16", cfg)
    assert name == (f"w4a16_wg<F16,{mt},{nw},{st}>" if cl == 1 else f"w4a16_wgc<F16,{mt},{nw},{st},{cl}>")
    assert name in _wg_names("F16") and _wg_name("BF16", cfg) in _wg_names("BF16")
    assert W4A16Tuning.from_env({"SHMRPC_W4A16_MMA_CFG": ",".join(map(str, cfg))}).mma_cfg == cfg
    assert not _global_split(cfg, 8192, 8192, 132)
    per_sm = _WG_PER_SM.get(cfg[:2], 1)  # a table entry: two blocks per SM or more, at most one wave
    n_max, n_min = 128 * nw * (per_sm * 132 // cl), 128 * nw * -(-264 // cl)
    if cl == 7:  # clusters of 7: only where more clusters of 8 are launched than the 62 resident
        n_min = max(n_min, 128 * nw * 63)
    if cl == 6:  # clusters of 6: only where more clusters of 7 are launched than the 69 resident
        n_min = max(n_min, 128 * nw * 70)
    if n_min <= n_max:
        assert _takes(cfg, n_max, 132) and not _takes(cfg, n_max + 128 * nw, 132) and _takes(cfg, n_min, 132)
        assert not _takes(cfg, n_min - 128 * nw, 132) or n_min == 128 * nw
    else:  # one block per SM: no N gives two per SM in one wave
        assert not _takes(cfg, n_min, 132) and not _takes(cfg, n_max, 132)
    assert _takes(cfg, n_max + 128 * nw, 132, forced=True) and not _takes(cfg, 128 * nw + 64, 132, forced=True)
    with use_tuning(**vars(W4A16Tuning(mma_m1=True, mma_cfg=cfg))):
        assert _mma_cfg(16, 4096, 1024 if nw < 4 else 2048, 128, wg=True) == cfg
        assert _mma_cfg(16, 4096, 1024 if nw < 4 else 2048, 128) is None  # not an sm_90 device
        assert _mma_cfg(16, 4096, 2048, 128, smem_max=_wg_smem(cfg) - 1, wg=True) is None
    for bad in ((mt, nw, st, 3), (mt, 3, st, cl), (5, nw, st, cl)):  # not built
        with use_tuning(**vars(W4A16Tuning(mma_m1=True, mma_cfg=bad))):
            assert _mma_cfg(16, 4096, 2048, 128, wg=True) is None


@pytest.mark.parametrize("cfg", _WGM_VARIANTS)
def test_wgm_launch_names_and_shared_memory(cfg) -> None:
    """w4a16_wgm (MT, S, CL): 16 warps, grid (N / 128, CL), every 64-k chunk in exactly one of the cluster's 4*CL
    warpgroups, four times w4a16_wg's stages (NWORD 1) plus 1024 bytes, within what a block may opt in to; taken
    only on an sm_90 device, forced wherever 128 divides N, from the table where its blocks fill 0.6 to 1 of a wave
    of one per SM."""
    mt, st, cl = cfg
    one = _wg_smem((mt, 1, st, cl))
    assert _wg_smem(cfg) == 4 * (one - 1024) + 1024 <= _WK_SMEM_MAX and _wg_warps(cfg) == 16
    for k in (64, 128, 4480, 8192, 28672):
        for n in (1024, 4096, 14336):
            (tiles, ksplit), cpb, smem = w4a16_wg_launch(64, k, n, cfg)
            assert tiles * 128 == n and ksplit == cl and smem == _wg_smem(cfg)
            assert (4 * cl - 1) * cpb < k // 64 <= 4 * cl * cpb or (k // 64 < 4 * cl and cpb == 1)
    name = _wg_name("F16", cfg)
    assert name == f"w4a16_wgm<F16,{mt},{st},{cl}>"
    assert name in _wg_names("F16") and _wg_name("BF16", cfg) in _wg_names("BF16")
    assert W4A16Tuning.from_env({"SHMRPC_W4A16_MMA_CFG": ",".join(map(str, cfg))}).mma_cfg == cfg
    assert not _global_split(cfg, 8192, 8192, 132)
    low, high = -(-80 // cl), 132 // cl  # tiles: 0.6 of 132 SMs (79.2 blocks, so 80) to one wave
    assert _takes(cfg, 128 * low, 132) and not _takes(cfg, 128 * (low - 1), 132)
    assert _takes(cfg, 128 * high, 132) and not _takes(cfg, 128 * (high + 1), 132)
    assert _takes(cfg, 128 * (high + 1), 132, forced=True) and not _takes(cfg, 128 * 8 + 64, 132, forced=True)
    with use_tuning(**vars(W4A16Tuning(mma_m1=True, mma_cfg=cfg))):
        assert _mma_cfg(64, 4096, 1024, 128, wg=True) == cfg
        assert _mma_cfg(64, 4096, 1024, 128) is None  # not an sm_90 device
        assert _mma_cfg(64, 4096, 1024, 128, smem_max=_wg_smem(cfg) - 1, wg=True) is None
    for bad in ((mt, st, 3), (mt, 5, cl), (2, st, cl)):  # not built
        with use_tuning(**vars(W4A16Tuning(mma_m1=True, mma_cfg=bad))):
            assert _mma_cfg(64, 4096, 1024, 128, wg=True) is None


def test_wg_table_entries_fill_the_sms_once() -> None:
    """The wgmma entries of M 33..64 are taken where their blocks make two per SM or more (of 132) and at most one
    wave of four per SM (w4a16_wgc), or 0.6 to 1 wave of one per SM (w4a16_wgm): N = 1024 to 4096 (64 to 256 blocks
    of wgc, 16 to 64 of wgm) go to the kernels after them."""
    with use_tuning(**vars(W4A16Tuning())):
        for n in (1024, 2048, 4096):
            assert _mma_cfg(64, 4096, n, 128, wg=True) == _mma_cfg(64, 4096, n, 128)
        assert _mma_cfg(64, 4096, 4096 + 128, 128, wg=True) == (4, 1, 4, 8)  # 33 x 8 = 264 blocks
        assert _mma_cfg(64, 4096, 28672, 128, wg=True) == (4, 1, 4, 2)  # 224 tiles x 2 = 448
        assert _mma_cfg(40, 4096, 14336, 128, wg=True) == (4, 4, 1)  # before the many-tiles entry


def test_wg_clusters_of_7_only_where_those_of_8_make_a_second_wave() -> None:
    """w4a16_wgc takes clusters of 7 where N's column tiles (128 columns) need more clusters of 8 than the H200 holds
    at once (62 of 66: _WG_RESIDENT), clusters of 6 where they need more of 7 than it holds (69 of 75:
    _WG_RESIDENT), clusters of 8 where they all fit, and clusters of 4 or 2 where 6 would not fit one wave; a
    device with more SMs keeps clusters of 8 at N = 8192. In the table of M 33..64 w4a16_wgm stands before them, so
    they are its choice from 67 tiles (w4a16_wgm's clusters of 2 no longer fit one wave, and 67 to 79 blocks without
    a cluster fill under 0.6 of the SMs)."""
    for n_sm, tiles in ((132, 62), (144, 64)):  # all clusters of 8 resident
        assert _takes((4, 1, 4, 8), 128 * tiles, n_sm) and not _takes((4, 1, 4, 7), 128 * tiles, n_sm)
    for tiles in (63, 64, 75):
        assert _takes((4, 1, 4, 7), 128 * tiles, 132)  # (and clusters of 8 after them in the row)
    assert not _takes((4, 1, 4, 7), 128 * 76, 132) and _takes((4, 1, 4, 4), 128 * 76, 132)  # 76 x 7 > 4 x 132 blocks
    assert not _takes((4, 1, 4, 6), 128 * 69, 132) and _takes((4, 1, 4, 6), 128 * 70, 132)  # 70 clusters of 7 > 69
    assert _takes((4, 1, 4, 6), 128 * 88, 132) and not _takes((4, 1, 4, 6), 128 * 89, 132)  # 89 x 6 > 4 x 132
    with use_tuning(**vars(W4A16Tuning())):
        for m in (33, 48, 64):
            for tiles in (62, 64, 66):
                assert _mma_cfg(m, 8192, 128 * tiles, 128, wg=True) == (4, 4, 2)
            for tiles in (67, 69):
                assert _mma_cfg(m, 8192, 128 * tiles, 128, wg=True) == (4, 1, 4, 7)
            for tiles in (70, 75, 79):
                assert _mma_cfg(m, 8192, 128 * tiles, 128, wg=True) == (4, 1, 4, 6)
            assert _mma_cfg(m, 8192, 128 * 80, 128, wg=True) == (4, 4, 1)  # 80 blocks: 0.6 of 132 SMs
        assert _takes((4, 1, 4, 7), 128 * 40, 132, forced=True) and not _takes((4, 1, 4, 7), 128 * 40, 132)


def test_wg_only_where_its_32_bit_offsets_reach(monkeypatch) -> None:
    """The wgmma kernels address their copies by 32-bit offsets: a layer whose qweight has 2**32 bytes or more (K/2 * N)
    takes another tensor-core kernel from the table, and a forced wg configuration is refused (the op falls back)."""
    from support.w4a16 import force

    with use_tuning(**vars(W4A16Tuning())):
        assert _mma_cfg(64, 2**19, 8192, 128, wg=True) == (4, 4, 2)  # 2**31 bytes: still wgmma
        big = _mma_cfg(64, 2**20, 8192, 128, wg=True)  # 2**32 bytes
        assert big is not None and not _is_wg(big)
        assert _mma_cfg(64, 2**20, 8192, 128, wg=False) == big
    force(monkeypatch, "4,1,4,7")
    assert _mma_cfg(64, 2**19, 8192, 128, wg=True) == (4, 1, 4, 7)
    assert _mma_cfg(64, 2**20, 8192, 128, wg=True) is None


def test_device_facts_read_once_per_device(monkeypatch) -> None:
    """quant._device_facts (no GPU: a stand-in for cupy): the opt-in shared memory and sm_90a, per device, read once."""
    import sys
    from types import SimpleNamespace

    from shmrpc.kernels import quant

    props = {0: {"major": 9, "minor": 0, "sharedMemPerBlockOptin": 232448}, 1: {"major": 8, "minor": 9}}
    calls, current = [], [0]
    runtime = SimpleNamespace(getDevice=lambda: current[0],
                              getDeviceProperties=lambda d: calls.append(d) or props[d])
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(quant, "_DEVICE", {})
    assert quant._device_facts() == (232448, True) and quant._sm90a()
    current[0] = 1
    assert quant._device_facts() == (48 * 1024, False) and not quant._sm90a()
    assert calls == [0, 1]


def test_choice_is_kept_per_shape_device_and_knobs(monkeypatch) -> None:
    """quant.w4a16_choice (no GPU: a stand-in for cupy) answers as _mma_cfg does for the device, from a kept answer
    after the first call, and follows a change of the knobs (use_tuning) and of the device."""
    import sys
    from types import SimpleNamespace

    from shmrpc.kernels import _cuda, quant

    props = {0: {"major": 9, "minor": 0, "sharedMemPerBlockOptin": 232448, "multiProcessorCount": 132},
             1: {"major": 8, "minor": 9, "sharedMemPerBlockOptin": 101376, "multiProcessorCount": 84}}
    current = [0]
    runtime = SimpleNamespace(getDevice=lambda: current[0], getDeviceProperties=lambda d: props[d])
    monkeypatch.setitem(sys.modules, "cupy", SimpleNamespace(cuda=SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(quant, "_DEVICE", {})
    monkeypatch.setattr(quant, "_CHOICES", {})
    monkeypatch.setattr(_cuda, "_sm", {})
    walks = []
    real = quant._mma_cfg
    monkeypatch.setattr(quant, "_mma_cfg", lambda *a: walks.append(a) or real(*a))
    with use_tuning(**vars(W4A16Tuning())):
        first = quant.w4a16_choice(64, 8192, 8192, 128)
        assert first == _mma_cfg(64, 8192, 8192, 128, 232448, 132, True) == (4, 4, 2)
        assert quant.w4a16_choice(64, 8192, 8192, 128) == first and len(walks) == 1  # kept
        with use_tuning(mma=False):
            assert quant.w4a16_choice(64, 8192, 8192, 128) is None  # other knobs: asked again
        current[0] = 1
        assert quant.w4a16_choice(64, 8192, 8192, 128) == _mma_cfg(64, 8192, 8192, 128, 101376, 84, False)
        assert len(walks) == 3


def test_name_lists_are_built_once() -> None:
    """The module name lists asked for on every launch are the same object each time (built once)."""
    from shmrpc.kernels._w4a16_config import _w4a16_names
    from shmrpc.kernels.norm import _ln_names, _sm_names

    for names, args in ((_mma_names, ("F16",)), (_wg_names, ("BF16",)), (_w4a16_names, ("F16",)),
                        (_ln_names, ("F16", 8, 256)), (_sm_names, ("F16", 8))):
        assert names(*args) is names(*args) and len(names(*args)) > 0


@pytest.mark.parametrize("cfg", [(0, 4, 12, 0, 3, 1, 2), (0, 4, 8, 1, 3, 1), (4, 2, 8, 0, 2, 1, 1, 2), (4, 1, 4, 8),
                                 (1, 2, 4, 2, 3), (4, 4, 2)])
def test_launch_of_a_shape_is_its_geometry_kept(cfg) -> None:
    """quant._launch_of: the module, kernel name, grid, warps, shared memory, int32 tail and buffer sizes of the geometry
    functions, built once per (dtype, shape, configuration, SMs)."""
    from shmrpc.kernels import quant

    m, k, n, gs = 16, 4096, 8192, 128
    launch = quant._launch_of("BF16", m, k, n, gs, cfg, 132)
    assert quant._launch_of("BF16", m, k, n, gs, cfg, 132) is launch
    assert launch.tail == (m, k, n, gs // 2, launch.tail[4]) and all(type(v).__name__ == "int32" for v in launch.tail)
    if _is_wg(cfg):
        grid, cpb, smem = w4a16_wg_launch(m, k, n, cfg)
        assert (launch.name, launch.arch, launch.grid, launch.warps, launch.smem, launch.partials) == (
            _wg_name("BF16", cfg), "sm_90a", grid, 4 if len(cfg) == 4 else 16, smem, 0)
        assert launch.names == _wg_names("BF16")
    elif len(cfg) >= 6:
        (tiles, ksplit), cpb, smem = w4a16_wk_launch(m, k, n, 132, cfg)
        assert (launch.name, launch.arch, launch.grid, launch.warps, launch.smem, launch.tiles) == (
            _wk_name("BF16", cfg), None, (tiles, ksplit), cfg[2], smem, tiles)
        assert launch.partials == (ksplit * m * n if ksplit > 1 and len(cfg) == 6 else 1)
    else:
        (tiles, ksplit), cpb = w4a16_mma_launch(m, k, n, 132, cfg)
        assert launch.grid == (tiles, ksplit) and launch.smem == 0 and launch.partials == (ksplit * m * n if ksplit > 1 else 1)
    assert launch.tail[4] == cpb and launch.names is _mma_names("BF16") or _is_wg(cfg)
