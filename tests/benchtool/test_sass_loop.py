"""bench/gpu/sass_loop.py reads cuobjdump's SASS: instructions per function, the chunk loop, template arguments."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
    assert sass_loop.registers(_PTXAS) == {_MT1: 254, _MT0: 154}
