"""bench/gpu/sass_loop.py reads cuobjdump's SASS: instructions per function, the chunk loop, template arguments."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "sass_loop.py"
_spec = importlib.util.spec_from_file_location("sass_loop", _PATH)
assert _spec is not None and _spec.loader is not None
sass_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sass_loop)

# two kernels; the first has an outer loop (0x0010-0x00a0) around the chunk loop (0x0020-0x0070), which holds
# the HMMA, a predicated instruction and opcodes with modifiers; a forward branch and an inner copy loop without HMMA
_SASS = """
        code for sm_90
                Function : _Z9w4a16_wkcI3F16Li1ELi4ELi8ELi3ELi1ELi2EEvPKtPKhS2_S2_PfPjPtiiiii
        .headerflags    @"EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
                                                                            /* 0x000ff00000000800 */
        /*0010*/                   MOV R2, RZ ;                             /* 0x0 */
        /*0020*/                   LOP3.LUT R3, R4, 0xf000f, R5, 0xea, !PT ; /* 0x0 */
        /*0030*/                   PRMT R6, R7, 0x5140, R8 ;                /* 0x0 */
        /*0040*/               @!P0 BRA 0x60 ;                              /* 0x0 */
        /*0050*/                   HMMA.16816.F32 R8, R12, R16, R8 ;        /* 0x0 */
        /*0060*/               @!PT LDS RZ, [RZ] ;                          /* 0x0 */
        /*0070*/               @P1 BRA 0x20 ;                               /* 0x0 */
        /*0080*/                   IADD3 R2, R2, 0x1, RZ ;                  /* 0x0 */
        /*0090*/                   ISETP.GE.AND P2, PT, R2, R9, PT ;        /* 0x0 */
        /*00a0*/              @!P2 BRA 0x10 ;                               /* 0x0 */
        /*00b0*/                   EXIT ;                                   /* 0x0 */
                Function : _Z9w4a16_wkcI3F16Li0ELi4ELi8ELi3ELi1ELi2EEvPKtPKhS2_S2_PfPjPtiiiii
        /*0000*/                   LDGSTS.E.BYPASS.128 [R65], desc[UR10][R36.64] ;  /* 0x0 */
        /*0010*/                   IADD3 R1, R1, 0x1, RZ ;                  /* 0x0 */
        /*0020*/               @P0 BRA 0x0 ;                                /* 0x0 */
        /*0030*/                   EXIT ;                                   /* 0x0 */
"""
_PTXAS = """ptxas info    : Compiling entry function '_Z9w4a16_wkcI3F16Li1ELi4ELi8ELi3ELi1ELi2EEvPKtPKhS2_S2_PfPjPtiiiii' for 'sm_90'
ptxas info    : Used 254 registers, used 1 barriers
ptxas info    : Compiling entry function '_Z9w4a16_wkcI3F16Li0ELi4ELi8ELi3ELi1ELi2EEvPKtPKhS2_S2_PfPjPtiiiii' for 'sm_90'
ptxas info    : Used 154 registers, used 1 barriers
"""
_MT1 = "_Z9w4a16_wkcI3F16Li1ELi4ELi8ELi3ELi1ELi2EEvPKtPKhS2_S2_PfPjPtiiiii"
_MT0 = "_Z9w4a16_wkcI3F16Li0ELi4ELi8ELi3ELi1ELi2EEvPKtPKhS2_S2_PfPjPtiiiii"


def test_instructions_per_function_with_predicates_and_modifiers() -> None:
    funcs = sass_loop.parse_sass(_SASS)
    assert list(funcs) == [_MT1, _MT0]
    assert [op for _, op, _ in funcs[_MT1]] == ["LDC", "MOV", "LOP3", "PRMT", "BRA", "HMMA", "LDS", "BRA", "IADD3",
                                              "ISETP", "BRA", "EXIT"]
    assert funcs[_MT1][4] == (0x40, "BRA", "0x60")


def test_the_chunk_loop_is_the_smallest_loop_with_the_most_hmma() -> None:
    funcs = sass_loop.parse_sass(_SASS)
    start, end, counts = sass_loop.chunk_loop(funcs[_MT1])
    assert (start, end) == (0x20, 0x70)
    assert counts == {"LOP3": 1, "PRMT": 1, "BRA": 2, "HMMA": 1, "LDS": 1}
    assert sass_loop.chunk_loop(funcs[_MT0]) is None  # a loop, but no HMMA in it


def test_template_arguments_and_registers() -> None:
    assert sass_loop.template_args(_MT1) == [1, 4, 8, 3, 1, 2]
    # a negative argument (MT = -NB, the swapped operands with NB B tiles) is mangled Lin<digits>E
    assert sass_loop.template_args("_Z9w4a16_wkcI3F16Lin2ELi4ELi8ELi3ELi1ELi2EEvPKtPKhS2_S2_PfPjPtiiiii") == [-2, 4, 8, 3, 1, 2]
    assert sass_loop.registers(_PTXAS) == {_MT1: 254, _MT0: 154}


# a wgmma kernel: its chunk loop holds HGMMA (and the WARPGROUP fences), not HMMA
_WG = "_Z9w4a16_wgcI3F16Li4ELi1ELi4ELi8EEvPKtPKhS2_S2_Ptiiiii"
_SASS_WG = f"""
                Function : {_WG}
        /*0000*/                   MOV R2, RZ ;                                        /* 0x0 */
        /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;                       /* 0x0 */
        /*0020*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;                     /* 0x0 */
        /*0030*/                   PRMT R91, R20, 0x4400, R95 ;                        /* 0x0 */
        /*0040*/                   WARPGROUP.ARRIVE ;                                  /* 0x0 */
        /*0050*/                   HGMMA.64x64x16.F32 R56, R184, gdesc[UR20], R56, gsb0 ; /* 0x0 */
        /*0060*/              @!P0 BRA 0x10 ;                                          /* 0x0 */
        /*0070*/                   EXIT ;                                              /* 0x0 */
"""


def test_a_wgmma_chunk_loop_is_found_by_its_hgmma() -> None:
    start, end, counts = sass_loop.chunk_loop(sass_loop.parse_sass(_SASS_WG)[_WG])
    assert (start, end) == (0x10, 0x60)
    assert counts == {"BAR": 1, "WARPGROUP": 2, "PRMT": 1, "HGMMA": 1, "BRA": 1}
    assert sass_loop.template_args(_WG) == [4, 1, 4, 8]


def _nvrtc_tools() -> bool:
    from shmrpc.kernels._nvrtc import load, tool

    try:
        return load() is not None and tool("cuobjdump") is not None and tool("nvdisasm") is not None
    except OSError:
        return False


@pytest.mark.skipif(not _nvrtc_tools(), reason="needs NVRTC, cuobjdump and nvdisasm (pip install nvidia-cuda-nvrtc "
                                               "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
def test_the_op_s_own_build_without_a_gpu(tmp_path) -> None:
    """--nvrtc: the modules built as the op builds them; each kernel's chunk loop found, with its HMMA or HGMMA (six
    numbers: w4a16_wkc, five: w4a16_wk, four: w4a16_wgc)."""
    sass, log = sass_loop.build_nvrtc([(0, 4, 8, 3, 1, 2), (0, 4, 8, 3, 1), (4, 1, 4, 8)], tmp_path)
    funcs = sass_loop.parse_sass(sass)
    regs = sass_loop.registers(log)
    wk = next(n for n in funcs if n.startswith("_Z9w4a16_wkc"))
    wg = next(n for n in funcs if n.startswith("_Z9w4a16_wgc"))
    assert sass_loop.chunk_loop(funcs[wk])[2]["HMMA"] > 0 and sass_loop.chunk_loop(funcs[wg])[2]["HGMMA"] > 0
    assert 0 < regs[wk] <= 255 and 0 < regs[wg] <= 255
    plain = next(n for n in funcs if n.startswith("_Z8w4a16_wkI"))
    assert sass_loop.template_args(plain) == [0, 4, 8, 3, 1] and sass_loop.chunk_loop(funcs[plain])[2]["HMMA"] > 0
