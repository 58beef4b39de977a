"""Which gemm_w4a16 kernel and which launch for a shape: the tuning knobs, the measured table, the geometry.

Pure Python (no CuPy): :mod:`.quant` launches what this module chooses, and the configuration
tests and tuning tools read it without a GPU. The knobs are read once from the environment
at import (:class:`W4A16Tuning`); :func:`use_tuning` changes them for a block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["W4A16Tuning", "tuning", "use_tuning", "w4a16_launch_config", "w4a16_mma_launch", "w4a16_wg_launch",
           "w4a16_wk_launch"]

@dataclasses.dataclass(frozen=True)
class W4A16Tuning:
    """Tuning knobs of the CuPy gemm_w4a16 paths, read once from the environment at import (docs/kernels.md).

    Attributes:
        blocks_per_sm: ``SHMRPC_W4A16_BLOCKS_PER_SM`` (2): K-split so that about this many blocks run per SM.
        dequant_min_m: ``SHMRPC_W4A16_DEQUANT_MIN_M`` (5): float16 batches from this M go dequantize + cuBLAS.
        h2: ``SHMRPC_W4A16_H2=1``: the float16x2 kernel for float16 M <= 4 (opt-in).
        prefetch: ``SHMRPC_W4A16_PF=1``: prefetch the next run in the M = 1 kernel (measured slower).
        mma: ``SHMRPC_W4A16_MMA`` (on; ``0`` turns the tensor-core path off).
        mma_m1: ``SHMRPC_W4A16_MMA_M1`` (on; ``0`` keeps M = 1 on the float32 CUDA-core kernel).
        pdl: ``SHMRPC_W4A16_PDL`` (on; ``0`` turns it off): launch the tensor-core kernels (w4a16_wk, wkc, wkm, wg,
            wgc) as programmatic dependent launches on sm_90, so that a call overlaps the end of the kernel before it
            in the stream (docs/kernels.md, "Programmatic dependent launch").
        mma_cfg: ``SHMRPC_W4A16_MMA_CFG="MT,NWORD,WARPS,BPS,S"`` (w4a16_mma / w4a16_mma_async),
            ``"MT,NWORD,WK,BPS,S,XSM"`` (w4a16_wk), ``"MT,NWORD,WK,0,S,XSM,CL"`` (w4a16_wkc, clusters of CL
            blocks), ``"MT,NWORD,WK,0,S,1,1,CN"`` (w4a16_wkm, activations multicast to clusters of CN blocks) or
            ``"MT,NWORD,S,CL"`` (w4a16_wg / w4a16_wgc: wgmma, sm_90a) or ``"MT,S,CL"`` (w4a16_wgm: four warpgroups
            per block, NWORD 1): one forced configuration (tuning only).
    """

    blocks_per_sm: int = 2
    dequant_min_m: int = 5
    h2: bool = False
    prefetch: bool = False
    mma: bool = True
    mma_m1: bool = True
    pdl: bool = True
    mma_cfg: tuple[int, ...] | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> W4A16Tuning:
        """The knobs ``env`` sets (defaults for the rest)."""
        forced = env.get("SHMRPC_W4A16_MMA_CFG")
        cfg = None
        if forced:
            v = [int(p) for p in forced.split(",")]
            cfg = tuple(v) if len(v) in (3, 4, 6, 7, 8) else (v[0], v[1], v[2], v[3], v[4] if len(v) > 4 else 0)
        return cls(blocks_per_sm=int(env.get("SHMRPC_W4A16_BLOCKS_PER_SM", "2")),
                   dequant_min_m=int(env.get("SHMRPC_W4A16_DEQUANT_MIN_M", "5")),
                   h2=env.get("SHMRPC_W4A16_H2", "0") == "1", prefetch=env.get("SHMRPC_W4A16_PF", "0") == "1",
                   mma=env.get("SHMRPC_W4A16_MMA", "1") != "0", mma_m1=env.get("SHMRPC_W4A16_MMA_M1", "1") != "0",
                   pdl=env.get("SHMRPC_W4A16_PDL", "1") != "0", mma_cfg=cfg)


_TUNING = W4A16Tuning.from_env()


def tuning() -> W4A16Tuning:
    """The knobs in force."""
    return _TUNING


@contextlib.contextmanager
def use_tuning(**changes: Any) -> Iterator[W4A16Tuning]:
    """Run a block with some knobs changed (benchmarks and tests; not thread-safe against running ops).

    Example::

        with use_tuning(mma=False):
            ...  # the CUDA-core path
    """
    global _TUNING
    before = _TUNING
    _TUNING = dataclasses.replace(before, **changes)
    try:
        yield _TUNING
    finally:
        _TUNING = before

def w4a16_launch_config(m: int, k: int, n: int, n_sm: int) -> tuple[tuple[int, int], int, int]:
    """(grid, rows_per_split, mb) of ``cuda/gemm_w4a16.cu`` for x (m, k), qweight (k/2, n)."""
    rows = k // 2
    grid_x = -(-n // 128)
    per_sm = _TUNING.blocks_per_sm
    want = max(1, -(-per_sm * n_sm // grid_x))  # about per_sm blocks per SM
    per_split = -(-rows // want)
    rps = max(256, -(-per_split // 256) * 256)
    rps = min(rps, rows)
    ksplit = -(-rows // rps)
    mb = 1 if m == 1 else 2  # MB=4 would hold 3x64 accumulators: register spills
    return (grid_x, ksplit), rps, mb


# float16 M <= 4: w4a16_h2<MB, CT, RT, MINB> (float16x2 dequant, see cuda/gemm_w4a16.cu). Per M, the
# configurations in order of preference (measured on an H200); the first whose RT divides
# group_size / 2 is used (the last has RT = 8, which always does: group_size % 16 == 0).
_H2_CFG: dict[int, tuple[tuple[int, int, int, int], ...]] = {
    1: ((1, 16, 32, 1), (1, 16, 16, 2), (1, 16, 8, 2)),
    2: ((2, 16, 16, 2), (2, 8, 8, 4)),
    3: ((4, 8, 16, 2), (2, 8, 8, 4)),
    4: ((4, 8, 16, 2), (2, 8, 8, 4)),
}


def _h2_cfg(m: int, group_rows: int) -> tuple[int, int, int, int]:
    return next(c for c in _H2_CFG[m] if group_rows % c[2] == 0)


def _h2_name(cfg: tuple[int, int, int, int]) -> str:
    return "w4a16_h2<" + ",".join(map(str, cfg)) + ">"


@functools.cache  # a module's name list, asked for on every launch: built once
def _w4a16_names(kt: str) -> tuple[str, ...]:
    h2 = sorted({_h2_name(c) for cfgs in _H2_CFG.values() for c in cfgs}) if kt == "F16" else []
    return (*(f"w4a16_gemm<{kt},{mb},{'true' if pf else 'false'}>" for mb in (1, 2) for pf in (False, True)),
            "w4_dequant_f16<0>", *h2)


def _dequant_min_m() -> int:
    """Batch size from which float16 inputs go dequantize-kernel + cuBLAS (SHMRPC_W4A16_DEQUANT_MIN_M, default 5)."""
    return _TUNING.dequant_min_m

# Tensor-core kernels (cuda/w4a16_mma.cu). A configuration is (MT, NWORD, WARPS, BPS, S): 16-row m-tiles,
# 32-bit weight words per thread per packed row (a warp covers 32*NWORD columns, a block WARPS of those),
# warps per block, blocks per SM aimed at (sets the K split), and S > 0: w4a16_mma_async with S shared-memory
# stages (cp.async), S = 0: w4a16_mma (register prefetch). Six numbers (MT, NWORD, WK, BPS, S, XSM) name
# w4a16_wk: WK warps split the chunks of one 32*NWORD-column slab, each warp with its own S-stage cp.async
# pipeline (XSM = 1: activations staged too; 0: read through L1), BPS blocks per SM aimed at (0: no K split);
# MT = 0 there: the operands swapped (weights as the A operand, 8 activation rows as B: M <= 8 per m-block);
# MT = -NB: the same with NB such B operands, each dequantized A-tile used by NB mma (M <= 8*NB per m-block).
# Seven numbers (MT, NWORD, WK, 0, S, XSM, CL) name w4a16_wkc: the same blocks, the K split always CL ways, the CL
# blocks of a column tile one cluster that adds its sums through distributed shared memory (no global partials);
# a table entry is taken only where CL is the split BPS = 1 would choose (round(SMs / column tiles)) and the CL
# blocks of every tile fit in one wave (one block per SM); a forced one wherever they fit in one wave.
# Eight numbers (MT, NWORD, WK, 0, S, 1, 1, CN) name w4a16_wkm: w4a16_wk without a K split whose CN neighbouring column
# slabs form a cluster: x is first packed by chunk (w4_xpack: MR padded 144-byte rows per 64-k chunk, one contiguous
# block), and each chunk's rows are read from L2 once per cluster, CN bulk copies multicast into the CN blocks
# (mbarriers; CN = 1: one bulk copy, no cluster); it takes N where the column tiles divide into clusters, and (unless
# forced) only where they fit in one wave of one block per SM that BPS = 1 would not split (round(SMs / tiles) == 1).
_MMA_VARIANTS = ((1, 4, 4), (1, 2, 4), (1, 1, 4), (1, 1, 8), (2, 2, 4), (2, 1, 4), (4, 1, 4), (4, 1, 2))
_ASYNC_VARIANTS = ((1, 2, 4, 4), (1, 2, 4, 3), (1, 2, 4, 2), (1, 1, 8, 3), (1, 1, 4, 4), (1, 1, 4, 6), (1, 1, 8, 4), (2, 1, 4, 4), (2, 2, 4, 3),
                   (4, 1, 4, 3), (4, 1, 2, 4))
# (MT, NWORD, WK, S, XSM) of w4a16_wk built into the module
_WK_VARIANTS = ((0, 4, 8, 4, 0), (0, 4, 8, 3, 1), (0, 2, 8, 4, 0), (0, 2, 8, 4, 1), (0, 4, 4, 4, 0),
                (1, 4, 8, 4, 0), (1, 4, 8, 3, 1), (1, 2, 8, 4, 1), (1, 2, 8, 4, 0), (1, 1, 8, 4, 1), (1, 2, 4, 4, 1),
                (2, 2, 8, 3, 1), (2, 2, 4, 3, 1), (4, 2, 4, 2, 1), (4, 2, 2, 3, 1), (4, 1, 4, 2, 1), (1, 2, 8, 3, 0),
                (1, 2, 4, 3, 1), (4, 2, 8, 2, 1), (2, 4, 8, 2, 1), (2, 4, 8, 3, 1), (-2, 4, 8, 3, 1), (0, 4, 12, 3, 1))
# (MT, NWORD, WK, S, XSM, CL) of w4a16_wkc built into the module
_WKC_VARIANTS = ((0, 4, 8, 3, 1, 2), (0, 2, 8, 4, 0, 2), (1, 4, 8, 3, 1, 2), (1, 2, 8, 4, 1, 2), (2, 2, 8, 3, 1, 2),
                 (4, 2, 4, 2, 1, 2), (4, 2, 8, 2, 1, 2), (2, 4, 8, 2, 1, 2), (2, 4, 8, 3, 1, 2), (-2, 4, 8, 3, 1, 2),
                 (0, 4, 12, 3, 1, 2))
# (MT, NWORD, WK, S, CN) of w4a16_wkm built into the module
_WKM_VARIANTS = ((4, 2, 8, 2, 2), (4, 2, 8, 2, 1), (4, 2, 8, 2, 4), (4, 2, 6, 3, 2))
# Four numbers (MT, NWORD, S, CL) name w4a16_wg (CL = 1) / w4a16_wgc (cuda/w4a16_wg.cu, sm_90a only): one warpgroup per
# block, the weights as wgmma's A operand from registers (4 warps x 32*NWORD columns), the activations as B from shared
# memory (NB = 16*MT rows, 8 at MT = 0), S stages, the K split a cluster of CL blocks. Taken only where the device is
# sm_90, and (unless forced) where its blocks make two per SM or more within one wave (_takes, _WG_PER_SM).
_WG_VARIANTS = ((4, 2, 4, 1), (4, 2, 4, 2), (4, 2, 4, 4), (4, 2, 4, 8), (4, 1, 4, 2), (4, 1, 4, 4), (2, 2, 4, 4),
                (2, 2, 4, 8), (2, 4, 4, 4), (1, 2, 4, 4), (1, 2, 4, 8), (1, 4, 4, 4), (1, 4, 4, 8), (0, 4, 4, 8),
                (0, 2, 4, 8), (4, 2, 3, 4), (4, 2, 6, 4), (4, 1, 4, 8), (4, 1, 6, 4), (2, 2, 6, 4), (4, 1, 4, 7),
                (4, 1, 4, 6))
# Three numbers (MT, S, CL) name w4a16_wgm (cuda/w4a16_wg.cu, sm_90a only): four warpgroups per block, each as a
# w4a16_wg block with NWORD 1 on its own K slice (one block per SM: 512 threads of 128 registers, 4 x S stages), the
# four tiles added in shared memory and then the cluster's CL through distributed shared memory: K split 4*CL ways
# with CL - 1 tiles per block crossing between SMs (w4a16_wgc at clusters of 7: 6 of 7 per block). Taken where the
# column tiles times CL make one wave of one block per SM, at least 0.6 of the SMs (_takes).
_WGM_VARIANTS = ((4, 4, 1), (4, 4, 2))
_WGM_WARPGROUPS = 4
_WGM_MIN_FILL = 0.6  # the least share of the SMs that w4a16_wgm's blocks fill where the table takes it
_WK_SMEM_MAX = 227 * 1024  # dynamic shared memory a block may opt in to (sm_90)
# Per largest M: the configurations in order of preference (the first that takes the shape is used), measured
# on an H200 (bench/gpu/w4a16_probe.py: results w4a16-probe-2026-11-30-5df42e6 and -07d7ec0; M 9..64 from
# w4a16-probe-2026-12-01-3cb2d08, -4e37619 and -7105858). M = 1 takes an entry only where it splits K through a cluster or
# not at all (_NO_GLOBAL_SPLIT_MAX_M), else the float32 CUDA-core kernel. M 17..32: the wide slab (MT 2, NWORD 4:
# each A fragment over 16 n-tiles) first; M 33..64: MT 4 NWORD 2 with 8 warps (one m-block: the weights read once),
# and at M 33..48 4 warps first where the column tiles outnumber the SMs (_MANY_TILES_FIRST).
# M 33..64 on sm_90: w4a16_wgc with MT 4, NWORD 1 (128 registers: four blocks per SM), the cluster as large as one wave
# of four blocks per SM allows, where that makes at least two blocks per SM (_takes); else the kernels after it. Run of
# 07c92e2 (us, M = 33 / 48 / 64, against the best w4a16_wk of the same call): 8192^2 CL 8 36.7 / 37.8 / 38.0 against
# 36.0 / 42.1 / 47.7; 4096 x 14336 CL 4 28.0 / 28.6 / 28.9 against 35.4 / 38.2 / 47.6; 8192 x 28672 CL 2 88.4 / 90.1 /
# 92.6 against 128.8 / 138.4 / 172.7; N = 4096 (CL 8: 256 blocks) lost at M = 33 (4096^2 15.5 against 14.4, 14336 x
# 4096 34.9 against 31.3) and tied at 64: not taken there.
# Clusters of 7 before 8 where those of 8 make a second wave: the H200 holds 62 clusters of 8 at four blocks per SM
# (cuOccupancyMaxActiveClusters; 124 of its 132 SMs: a cluster stays in one GPC), 69 of 7, and N = 8192 launches 64
# (cluster-probe-cl7-2026-12-03-c25ece8: M = 33 / 48 / 64 31.3 / 32.1 / 33.1 us against 35.1 / 36.1 / 36.3 for 8).
# Where 8's clusters fit in one wave, 7 would give each block more chunks (19 against 16 at K = 8192): not taken there.
# M 33..64 on sm_90, before those: w4a16_wgm, clusters of 2 where they fill the SMs, else none (macro-probe-wgm{,2,3}-
# 2026-12-03-*, us, M = 64, against the op's choice before it in the same call): 8192^2 26.06 / 25.76 against 31.11 /
# 30.73 (M = 48 25.70 against 30.25, M = 33 25.08 against 29.47), 4096 x 14336 (CL 1) 24.70 against 26.67, 8192 x 7936
# 25.52 against 27.09, 8192 x 16384 (CL 1) 43.56 against 57.18, 28672 x 8192 72.26 against 85.31, 4096 x 8192 16.64
# against 20.73, 8192 x 5120 (40 tiles, 80 blocks) 24.91 against 26.67. Lost where its clusters would be of 4 (4096^2
# 21.70 against 13.64, 14336 x 4096 44.54 against 33.97) and at M <= 32 (MT 2 or less: 23.23 against 20.76 at M = 32
# 8192^2); tied in two waves (8192 x 28672 CL 1, 224 blocks: 83.43 against 84.19): not taken there.
# Clusters of 6 before 7 where those of 7 make a second wave (70 to 79 column tiles on 132 SMs; from 80 w4a16_wgm):
# macro-probe-cl6-2026-12-03-05ea538, us, M = 64: N = 8960 34.01 against 36.71 for 7, 9600 34.26 against 37.62, 10112
# 34.48 against 44.24 for clusters of 4 (79 clusters of 6 resident: cluster-probe-cl6-2026-12-03-05ea538).
_WG_M64 = ((4, 4, 2), (4, 4, 1), (4, 1, 4, 6), (4, 1, 4, 7), (4, 1, 4, 8), (4, 1, 4, 4), (4, 1, 4, 2))
# Clusters of CL resident at four blocks per SM on the H200 (the driver's count), and of the clusters a wave would hold:
# 8: 62 of 66 (cluster-probe-cl7-2026-12-03-c25ece8), 7: 69 of 75 (cluster-probe-wgm-2026-12-03-3f1c0c6). Clusters of
# CL - 1 are a table entry only where more clusters of CL are launched than stay resident (_takes).
_WG_RESIDENT = {8: (62, 66), 7: (69, 75)}
_WG_PER_SM = {(4, 1): 4}  # w4a16_wg blocks an SM holds, by (MT, NWORD), where more than one (128 registers: W4_WGLB)
# M 1..8 where the cluster split takes N (N = 8192): 8 warps first again since the chunk's copies run from running
# sources (efec061; 126 registers): 8192^2 M = 1 / 2 / 4 / 8 12.5 / 12.6 / 13.0 / 13.1 us against 13.0 / 13.0 / 13.2 / 13.4
# for 12 warps, two rounds of w4a16-probe-extra-r{1,2}-2026-12-02-5c7ce43 (12 warps had won by 4% at 164 registers).
# M 17..32 without a cluster (4096 x 14336): three stages before two since a chunk's copies are two groups at MT > 0
# (W4_HALF): 18.8 against 19.6-19.7 us for two stages, two rounds of macro-probe-half-r{1,2}-2026-12-02-9b109a9.
_MMA_TABLE: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...] = (
    (1, ((0, 4, 8, 0, 3, 1, 2), (0, 4, 8, 1, 3, 1))),
    (8, ((0, 4, 8, 0, 3, 1, 2), (0, 4, 8, 1, 3, 1), (1, 2, 4, 2, 3))),
    (16, ((-2, 4, 8, 0, 3, 1, 2), (-2, 4, 8, 1, 3, 1), (1, 4, 8, 0, 3, 1, 2), (1, 4, 8, 1, 3, 1), (1, 2, 4, 2, 3))),
    (32, ((2, 4, 8, 0, 3, 1, 2), (2, 2, 8, 0, 3, 1, 2), (2, 4, 8, 1, 3, 1), (2, 4, 8, 1, 2, 1), (2, 2, 8, 1, 3, 1),
          (2, 1, 4, 4, 4))),
    (48, (*_WG_M64, (4, 2, 8, 0, 2, 1, 2), (4, 2, 8, 1, 2, 1), (4, 2, 4, 1, 2, 1), (4, 1, 4, 2, 3))),
    (64, (*_WG_M64, (4, 2, 8, 0, 2, 1, 2), (4, 2, 8, 1, 2, 1), (4, 2, 4, 1, 2, 1), (4, 1, 4, 2, 3))),
)
# Per table row (its largest M): an entry tried before the row where N / (32 NWORD) column tiles outnumber the SMs, so
# that the row's 8-warp blocks (one per SM by shared memory) would need a second wave; (4, 2, 4, 1, 2, 1) runs two
# blocks per SM. M 33..48 at 4096 x 14336 (224 tiles): 38.5 against 40.8 us (M = 33) and 42.3 against 44.6 (M = 48),
# run of 403d932 (b59dae7: 38.7 against 40.9, 40.5 against 43.5); at M = 64 not (49.3 against 48.4 us there).
_MANY_TILES_FIRST: dict[int, tuple[int, ...]] = {48: (4, 2, 4, 1, 2, 1)}
# Up to this M a table entry whose launch would add K-split partials in global memory is passed over: at M = 1 the
# CUDA-core kernel is faster than that (4096^2: 9.4 against 9.9 us, 8192^2: 20.2 against 21.0 us, run of 07d7ec0),
# slower than a cluster split or none (8192^2: 19.6, 4096x14336: 19.2 against 21.3 us). Not where the tensor-core
# kernels are dependent launches (sm_90, SHMRPC_W4A16_PDL): there the split was faster at 6 of 7 shapes (us, split /
# CUDA-core: 2048^2 5.6 / 8.2, 4096^2 7.6 / 9.5, 5120^2 10.0 / 13.2, 8192x1024 7.0 / 7.7, 11008x4096 12.6 / 17.2,
# 14336x4096 14.6 / 20.6; 4096x11008 18.1 / 17.8), run of da170c2 (w4a16-probe-m1-2026-12-02-da170c2).
_NO_GLOBAL_SPLIT_MAX_M = 1


def _wg_smem(cfg: tuple[int, ...]) -> int:
    """Dynamic shared memory of w4a16_wg / w4a16_wgc (the kernel's layout: S stages of x, weights, scales and zeros
    rounded up to 1024 bytes, or the block's float32 tile if larger; plus 1024 bytes to align the stages); of
    w4a16_wgm (three numbers), four warpgroups' stages (NWORD 1)."""
    if len(cfg) == 3:
        return _WGM_WARPGROUPS * (_wg_smem((cfg[0], 1, cfg[1], cfg[2])) - 1024) + 1024
    mt, nword, st = cfg[:3]
    nb, bc = _wk_rows(mt), 32 * nword  # the B operand's rows: the wgmma kernels take MT >= 0
    stage = -(-(nb * 128 + 4 * 32 * bc + 4 * 4 * bc) // 1024) * 1024
    return max(st * stage, nb * (4 * bc + 4) * 4) + 1024


def _wk_rows(mt: int) -> int:
    """Rows of one m-block of w4a16_wk / w4a16_wkc / w4a16_wkm (and of w4a16_wg / w4a16_wgc, MT >= 0 only): 16 per
    m-tile (MT > 0), 8 per B operand (MT = 0: one, MT = -NB: NB)."""
    return 16 * mt if mt > 0 else 8 * max(1, -mt)


def _wk_smem(cfg: tuple[int, ...]) -> int:
    """Dynamic shared memory of w4a16_wk / w4a16_wkc (the kernel's layout: WK*S stages, then a float32 tile, then for
    w4a16_wkc an mbarrier; staged activation rows of 144 bytes, padded, or, where that would pass _WK_SMEM_MAX at
    MT > 0, 128 bytes, swizzled)."""
    mt, nword, wk, _, st, xsm = cfg[:6]
    bc, mr = 32 * nword, _wk_rows(mt)
    smem = wk * st * (36 * bc + xsm * mr * 144) + mr * (bc + 4) * 4  # padded rows
    if len(cfg) == 8:  # w4a16_wkm: always padded rows (as packed), then two mbarriers per warp and stage
        return smem + 16 * wk * st
    if mt > 0 and xsm and smem > _WK_SMEM_MAX:  # swizzled 128-byte rows
        smem = wk * st * (36 * bc + mr * 128) + mr * (bc + 4) * 4
    return smem + (16 if len(cfg) == 7 else 0)  # w4a16_wkc: an mbarrier after the tile (the push of CL = 2)


def _mma_cfg(m: int, k: int, n: int, gs: int, smem_max: int = _WK_SMEM_MAX, n_sm: int = 132,
             wg: bool = False) -> tuple[int, ...] | None:
    """The tensor-core configuration for this shape, or None (other paths); ``smem_max``: the dynamic shared
    memory a block may opt in to on the device (w4a16_wk configurations above it are passed over); ``n_sm``:
    the device's SMs (see ``_takes``); ``wg``: the device runs sm_90a code (w4a16_wg is passed over elsewhere).

    SHMRPC_W4A16_MMA=0 turns the path off; SHMRPC_W4A16_MMA_M1=0 keeps M = 1 on the CUDA-core kernel;
    SHMRPC_W4A16_MMA_CFG="MT,NWORD,WARPS,BPS,S", "MT,NWORD,WK,BPS,S,XSM", "MT,NWORD,WK,0,S,XSM,CL" or "MT,NWORD,S,CL"
    (w4a16_wg) forces one configuration (tuning only)."""
    t = _TUNING
    if not t.mma or m < 1 or m > _MMA_TABLE[-1][0]:
        return None
    if m == 1 and not t.mma_m1:
        return None  # the float32 CUDA-core kernel
    if m <= 4 and t.h2:
        return None  # the opt-in float16x2 kernel
    if k % 64 or gs % 64:
        return None
    wg = wg and _wg_offsets_fit(m, k, n)
    if t.mma_cfg:
        ok = _mma_known(t.mma_cfg, smem_max) and _takes(t.mma_cfg, n, n_sm, forced=True) and (wg or not _is_wg(t.mma_cfg))
        return t.mma_cfg if ok else None
    row = _mma_row(m, n, n_sm)
    split_ok = m > _NO_GLOBAL_SPLIT_MAX_M or (wg and t.pdl)  # wg: an sm_90 device, where the launches are dependent
    return next((c for c in row if _mma_known(c, smem_max) and _takes(c, n, n_sm) and (wg or not _is_wg(c))
                 and (split_ok or not _global_split(c, k, n, n_sm))), None)


def _is_wg(cfg: tuple[int, ...]) -> bool:
    """Whether ``cfg`` names a wgmma kernel (sm_90a): w4a16_wg / wgc (four numbers) or w4a16_wgm (three)."""
    return len(cfg) in (3, 4)


def _wg_offsets_fit(m: int, k: int, n: int) -> bool:
    """Whether w4a16_wg / wgc may take the shape: its copies address x, qweight, the scales and the zeros by 32-bit
    offsets from their bases (W4_WGOFF), so x's M*K elements and qweight's K/2*N bytes (the scales' K/gs*N elements
    are fewer) stay under 2**32; a larger layer takes the other tensor-core kernels (64-bit addresses)."""
    return m * k < 2**32 and k // 2 * n < 2**32


def _mma_row(m: int, n: int, n_sm: int) -> tuple[tuple[int, ...], ...]:
    """The table's configurations for M rows and N columns in order of preference (_MMA_TABLE, _MANY_TILES_FIRST)."""
    mmax, row = next((mmax, c) for mmax, c in _MMA_TABLE if m <= mmax)
    first = _MANY_TILES_FIRST.get(mmax)
    if first is not None and n % (32 * first[1]) == 0 and n // (32 * first[1]) > n_sm:
        wg = tuple(c for c in row if _is_wg(c))  # the wgmma entries stay ahead of it
        return (*wg, first, *row[len(wg):])
    return row


def _global_split(cfg: tuple[int, ...], k: int, n: int, n_sm: int) -> bool:
    """Whether ``cfg``'s launch splits K through float32 partials in global memory (not a cluster, more than one split)."""
    if len(cfg) >= 7 or _is_wg(cfg):
        return False
    if len(cfg) == 6:
        return w4a16_wk_launch(1, k, n, n_sm, cfg)[0][1] > 1
    return w4a16_mma_launch(1, k, n, n_sm, cfg)[0][1] > 1


def _takes(cfg: tuple[int, ...], n: int, n_sm: int, forced: bool = False) -> bool:
    """Whether ``cfg`` takes N columns: 32*NWORD divides N (128*NWORD for w4a16_wg / wgc: a table entry makes two
    blocks per SM or more in one wave, clusters of 7 only where those of 8 would not all be resident); for
    w4a16_wkc, the column tiles times CL fit in one wave of one block per SM, and (unless forced) CL is the split
    BPS = 1 would choose, round(n_sm / tiles): the cluster replaces that split's global partials and never makes a
    split of its own."""
    if len(cfg) == 3:  # w4a16_wgm: 128 columns per block; a table entry: one wave of one block per SM, 0.6 of it or more
        tiles = n // 128
        return n % 128 == 0 and (forced or _WGM_MIN_FILL * n_sm <= tiles * cfg[2] <= n_sm)
    if len(cfg) == 4:  # w4a16_wg: 128*NWORD columns per block; a table entry: two blocks per SM or more, one wave
        tiles, per_sm = n // (128 * cfg[1]), _WG_PER_SM.get(cfg[:2], 1)
        if n % (128 * cfg[1]) or not (forced or 2 * n_sm <= tiles * cfg[3] <= per_sm * n_sm):
            return False
        # clusters of 7 (of 6), a table entry: only where more clusters of 8 (of 7) are launched than stay resident
        resident = _WG_RESIDENT.get(cfg[3] + 1)
        if forced or resident is None:
            return True
        held, wave = resident
        return tiles * (cfg[3] + 1) * wave > held * per_sm * n_sm
    if n % (32 * cfg[1]):
        return False
    if len(cfg) == 8:  # the column tiles divide into clusters of CN; a table entry: one wave that BPS 1 would not split
        tiles = n // (32 * cfg[1])
        return tiles % cfg[7] == 0 and (forced or (tiles <= n_sm and round(n_sm / tiles) == 1))
    if len(cfg) < 7:
        return True
    tiles = n // (32 * cfg[1])
    return tiles * cfg[6] <= n_sm and (forced or max(1, round(n_sm / tiles)) == cfg[6])


def _mma_known(cfg: tuple[int, ...], smem_max: int = _WK_SMEM_MAX) -> bool:
    """Whether ``cfg`` names a kernel built into the module (and, for w4a16_wk, one whose shared memory fits)."""
    if _is_wg(cfg):
        return cfg in (_WG_VARIANTS if len(cfg) == 4 else _WGM_VARIANTS) and _wg_smem(cfg) <= min(smem_max, _WK_SMEM_MAX)
    if len(cfg) == 8:
        return (cfg[3] == 0 and cfg[5] == 1 and cfg[6] == 1 and (*cfg[:3], cfg[4], cfg[7]) in _WKM_VARIANTS
                and _wk_smem(cfg) <= min(smem_max, _WK_SMEM_MAX))
    if len(cfg) == 7:
        return cfg[3] == 0 and (*cfg[:3], *cfg[4:]) in _WKC_VARIANTS and _wk_smem(cfg) <= min(smem_max, _WK_SMEM_MAX)
    if len(cfg) == 6:
        return (*cfg[:3], *cfg[4:]) in _WK_VARIANTS and _wk_smem(cfg) <= min(smem_max, _WK_SMEM_MAX)
    if len(cfg) == 5:
        return (cfg[:3] in _MMA_VARIANTS) if cfg[4] == 0 else ((*cfg[:3], cfg[4]) in _ASYNC_VARIANTS)
    return False


def w4a16_mma_launch(m: int, k: int, n: int, n_sm: int, cfg: tuple[int, ...]) -> tuple[tuple[int, int], int]:
    """(grid, chunks per block) of ``cuda/w4a16_mma.cu`` (a chunk = 64 k; a block = WARPS*32*NWORD columns)."""
    nword, warps, bps = cfg[1], cfg[2], cfg[3]
    tiles = -(-n // (32 * nword * warps))
    chunks = k // 64
    ksplit = max(1, min(round(bps * n_sm / tiles), chunks))
    cpb = -(-chunks // ksplit)
    ksplit = -(-chunks // cpb)
    return (tiles, ksplit), cpb


def w4a16_wk_launch(m: int, k: int, n: int, n_sm: int, cfg: tuple[int, ...]) -> tuple[tuple[int, int], int, int]:
    """(grid, chunks per block, dynamic shared bytes) of w4a16_wk: a block = one 32*NWORD-column slab, WK warps;
    w4a16_wkc (seven numbers): the K split is the cluster, CL blocks (a block may get no chunk when K is short);
    w4a16_wkm (eight numbers): no K split, the column tiles in clusters of CN along the grid's x."""
    nword, bps = cfg[1], cfg[3]
    tiles = n // (32 * nword)
    chunks = k // 64
    if len(cfg) == 8:
        return (tiles, 1), chunks, _wk_smem(cfg)
    if len(cfg) == 7:
        return (tiles, cfg[6]), -(-chunks // cfg[6]), _wk_smem(cfg)
    ksplit = max(1, min(round(bps * n_sm / tiles), chunks)) if bps > 0 else 1
    cpb = -(-chunks // ksplit)
    ksplit = -(-chunks // cpb)
    return (tiles, ksplit), cpb, _wk_smem(cfg)


def w4a16_wg_launch(m: int, k: int, n: int, cfg: tuple[int, ...]) -> tuple[tuple[int, int], int, int]:
    """(grid, chunks per warpgroup, dynamic shared bytes) of w4a16_wg / w4a16_wgc: a block = 128*NWORD columns, the K
    split the cluster of CL blocks along the grid's y (a block may get no chunk when K is short); of w4a16_wgm: a block
    = 128 columns, K split among the CL blocks' four warpgroups each."""
    if len(cfg) == 3:
        cl = cfg[2]
        return (n // 128, cl), -(-(k // 64) // (_WGM_WARPGROUPS * cl)), _wg_smem(cfg)
    cl = cfg[3]
    return (n // (128 * cfg[1]), cl), -(-(k // 64) // cl), _wg_smem(cfg)


def _wg_warps(cfg: tuple[int, ...]) -> int:
    """Warps per block of a wgmma configuration: 4 (w4a16_wg / wgc), 16 (w4a16_wgm)."""
    return 4 * _WGM_WARPGROUPS if len(cfg) == 3 else 4


def _wg_name(kt: str, cfg: tuple[int, ...]) -> str:
    if len(cfg) == 3:
        return f"w4a16_wgm<{kt},{cfg[0]},{cfg[1]},{cfg[2]}>"
    mt, nw, st, cl = cfg
    return f"w4a16_wg<{kt},{mt},{nw},{st}>" if cl == 1 else f"w4a16_wgc<{kt},{mt},{nw},{st},{cl}>"


@functools.cache  # a module's name list, asked for on every launch: built once
def _wg_names(kt: str) -> tuple[str, ...]:
    return tuple(_wg_name(kt, c) for c in (*_WG_VARIANTS, *_WGM_VARIANTS))


def _wk_name(kt: str, cfg: tuple[int, ...]) -> str:
    mt, nw, wk, _, st, xsm = cfg[:6]
    if len(cfg) == 8:
        return f"w4a16_wkm<{kt},{mt},{nw},{wk},{st},{cfg[7]}>"
    if len(cfg) == 7:
        return f"w4a16_wkc<{kt},{mt},{nw},{wk},{st},{xsm},{cfg[6]}>"
    return f"w4a16_wk<{kt},{mt},{nw},{wk},{st},{xsm}>"


@functools.cache  # a module's name list, asked for on every launch: built once
def _mma_names(kt: str) -> tuple[str, ...]:
    return (*(f"w4a16_mma<{kt},{mt},{nw},{wp}>" for mt, nw, wp in _MMA_VARIANTS),
            *(f"w4a16_mma_async<{kt},{mt},{nw},{wp},{st}>" for mt, nw, wp, st in _ASYNC_VARIANTS),
            *(_wk_name(kt, (mt, nw, wk, 0, st, xsm)) for mt, nw, wk, st, xsm in _WK_VARIANTS),
            *(_wk_name(kt, (mt, nw, wk, 0, st, xsm, cl)) for mt, nw, wk, st, xsm, cl in _WKC_VARIANTS),
            *(_wk_name(kt, (mt, nw, wk, 0, st, 1, 1, cn)) for mt, nw, wk, st, cn in _WKM_VARIANTS),
            *sorted({f"w4_xpack<{16 * v[0]}>" for v in _WKM_VARIANTS}))
