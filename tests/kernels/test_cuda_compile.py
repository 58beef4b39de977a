"""Every CUDA source of ``kernels/cuda/`` compiles with NVRTC for the GPU it runs on, without a GPU: the modules as
the CuPy paths build them (``_cuda.source``: common.cuh first), with every name expression they instantiate, for
sm_90 (what CuPy picks on an H100 / H200) and the wgmma module for sm_90a. A kernel edit that does not compile fails
here in CI instead of on the device. Skipped with the reason where NVRTC is not installed (the dev extra installs the
``nvidia-cuda-nvrtc`` wheel on Linux)."""

from __future__ import annotations

import concurrent.futures
import os
import struct
from pathlib import Path

import pytest

from shmrpc.kernels._cuda import CUDA_DIR, source
from shmrpc.kernels._dtypes import itemsize
from shmrpc.kernels._nvrtc import OPTIONS, Compiled, NvrtcError, compile_cubin, load, registers
from shmrpc.kernels._w4a16_config import (
    _WG_VARIANTS,
    _WGM_VARIANTS,
    _mma_names,
    _w4a16_names,
    _wg_name,
    _wg_names,
    _wg_smem,
)
from shmrpc.kernels.norm import _KT, _LN_BLOCKS, _ln_names, _sm_names

try:
    NVRTC = load()
except OSError:
    NVRTC = None


def _compile(code: str, names: tuple[str, ...], arch: str) -> Compiled:
    assert NVRTC is not None
    return compile_cubin(NVRTC, code, names, arch)


def _shared_sections(cubin: bytes) -> dict[str, int]:
    """The sizes of a cubin's ``.nv.shared.<kernel>`` sections (ELF64): each kernel's static shared memory, the 1 KiB
    the system reserves on sm_90 included."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i: int) -> tuple[int, ...]:
        return struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)

    names = header(shstrndx)[4]
    out: dict[str, int] = {}
    for i in range(shnum):
        h = header(i)
        name = cubin[names + h[0]:cubin.index(b"\0", names + h[0])].decode()
        if name.startswith(".nv.shared.") and not name.startswith(".nv.shared.reserved"):
            out[name[len(".nv.shared."):]] = h[5]
    return out


def _both(names) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for kt in ("F16", "BF16") for n in names(kt)))


MODULES = {
    "gemm_w4a16.cu": lambda: _both(_w4a16_names),
    "w4a16_mma.cu": lambda: _both(_mma_names),
    "layernorm_gelu.cu": lambda: tuple(n for dt, kt in _KT.items() for v in {16 // itemsize(dt), 1}
                                       for b in _LN_BLOCKS for n in _ln_names(kt, v, b)),
    "softmax.cu": lambda: tuple(dict.fromkeys(n for dt, kt in _KT.items() for n in _sm_names(kt, 16 // itemsize(dt)))),
    "copy_rows.cu": lambda: (),
    "pdl_check.cu": lambda: (),  # the dependency check's writer (tests/kernels/test_w4a16_pdl.py, bench/gpu/pdl_probe.py)
}


CASES = [*((f, "sm_90") for f in MODULES), ("w4a16_mma.cu+w4a16_wg.cu", "sm_90a")]


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, str], list[concurrent.futures.Future[Compiled]]]:
    """Every case compiled at once on the machine's cores (NVRTC releases the GIL in ctypes calls); the biggest,
    w4a16_mma.cu, in two halves of its names."""
    jobs = []
    for file, arch in CASES:
        names = _both(_wg_names) if file.endswith("w4a16_wg.cu") else MODULES[file]()
        halves = (names[: len(names) // 2], names[len(names) // 2:]) if len(names) > 60 else (names,)
        jobs += [((file, arch), source(file), h, arch) for h in halves]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
    futures: dict[tuple[str, str], list[concurrent.futures.Future[Compiled]]] = {}
    for key, code, names, arch in sorted(jobs, key=lambda j: -len(j[2])):
        opts = (*OPTIONS, "--ptxas-options=-v") if arch == "sm_90a" else OPTIONS  # the wgmma kernels' registers
        futures.setdefault(key, []).append(pool.submit(compile_cubin, NVRTC, code, names, arch, opts))
    pool.shutdown(wait=False)
    return futures


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
@pytest.mark.parametrize(("file", "arch"), CASES)
def test_kernel_module_compiles(compiled, file, arch) -> None:
    for f in compiled[file, arch]:
        assert "error" not in f.result().log.lower()


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
def test_the_staging_kernels_have_no_static_shared_memory(compiled) -> None:
    """w4a16_wk, w4a16_wkc and w4a16_wkm stage weights and activations in dynamic shared memory in 128-byte rows: it
    starts where static shared memory ends, so none of theirs may have any beyond the 1 KiB the system reserves. (A
    4-byte flag of the K split's last block once put w4a16_wk's rows 16 bytes off: its copies took twice the L2 sectors
    and three times the shared-memory wavefronts of w4a16_wkc's, docs/kernels.md.)"""
    sizes: dict[str, int] = {}
    lowered: dict[str, str] = {}
    for f in compiled["w4a16_mma.cu", "sm_90"]:
        sizes.update(_shared_sections(f.result().cubin))
        lowered.update(f.result().lowered)
    staging = [n for n in lowered if n.startswith(("w4a16_wk<", "w4a16_wkc<", "w4a16_wkm<"))]
    assert len(staging) >= 60
    for n in staging:
        assert sizes[lowered[n]] == 1024, (n, sizes[lowered[n]])
    assert any(v > 1024 for v in sizes.values())  # the kernels with static staging (w4a16_mma) are seen


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
def test_a_source_that_does_not_compile_fails() -> None:
    code = source("copy_rows.cu") + "\n__global__ void broken(int* p) { p[0] = undefined_name; }\n"
    with pytest.raises(NvrtcError, match="undefined_name"):
        _compile(code, (), "sm_90")
    with pytest.raises(NvrtcError, match="no_such_kernel"):
        _compile(source("softmax.cu"), ("no_such_kernel<F16>",), "sm_90")


def test_every_source_is_compiled_here() -> None:
    assert {p.name for p in Path(CUDA_DIR).glob("*.cu")} == {*MODULES, "w4a16_wg.cu"}


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
def test_the_product_build_takes_the_push_epilogue() -> None:
    """w4a16_wkc with clusters of 2 is built with the push epilogue (rank 1's sum stored into rank 0 with st.async):
    its code differs from the -DW4_PUSH=0 build's, the two-barrier path that the GPU test
    (test_w4a16_cluster_push_gives_the_bits_of_two_barriers) checks it against bit for bit. Were the push off by
    default, that test would compare a build with itself."""
    assert NVRTC is not None
    name = "w4a16_wkc<F16,0,4,8,3,1,2>"
    assert name in _mma_names("F16")
    code = source("w4a16_mma.cu")
    push = compile_cubin(NVRTC, code, (name,), "sm_90")
    two = compile_cubin(NVRTC, code, (name,), "sm_90", (*OPTIONS, "-DW4_PUSH=0"))
    assert push.cubin != two.cubin
    assert compile_cubin(NVRTC, code, (name,), "sm_90", (*OPTIONS, "-DW4_PUSH=1")).cubin == push.cubin


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
def test_each_loop_and_epilogue_switch_changes_the_product_where_it_applies() -> None:
    """w4a16_wk's product build has five switches on that keep the arithmetic (W4_HALF=2: two copy groups at MT > 0;
    W4_M1, W4_ZLATE, W4_EDEAD, W4_SZV: one row's correction at M = 1, the late zeroing, and at MT = 0 the epilogue's
    live slots and 16-byte scale reads). Each switched off changes the code of a kernel it applies to, and W4_HALF=0 leaves an MT = 0
    kernel as it is (one group there already), so the GPU test that compares the product's bits with the build of all
    five off (test_w4a16_loop_and_epilogue_switches_give_the_bits_of_before) compares two codes, and each switch is
    in the product."""
    assert NVRTC is not None
    code = source("w4a16_mma.cu")
    mt2, mt0 = "w4a16_wk<F16,2,4,8,3,1>", "w4a16_wk<F16,0,4,8,3,1>"
    assert {mt2, mt0} <= set(_mma_names("F16"))

    def cubin(name: str, *opts: str) -> bytes:
        return compile_cubin(NVRTC, code, (name,), "sm_90", (*OPTIONS, *opts)).cubin

    product0, product2 = cubin(mt0), cubin(mt2)
    assert cubin(mt2, "-DW4_HALF=0") != product2
    assert cubin(mt0, "-DW4_HALF=0") == product0
    for off in ("-DW4_M1=0", "-DW4_ZLATE=0", "-DW4_EDEAD=0", "-DW4_SZV=0"):
        assert cubin(mt0, off) != product0, off
    on = ("-DW4_HALF=2", "-DW4_M1=1", "-DW4_ZLATE=1", "-DW4_EDEAD=1", "-DW4_SZV=1")
    assert cubin(mt0, *on) == product0 and cubin(mt2, *on) == product2


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
def test_the_wgmma_kernels_keep_the_blocks_their_shared_memory_allows(compiled) -> None:
    """w4a16_wg / w4a16_wgc at NWORD 1 (128 threads) run as many blocks per SM as their shared memory allows, up to 4
    (228 KiB per SM, 1 KiB reserved per block; 64 K registers): held by __launch_bounds__ (W4_WGLB). Without it the
    same source took 128 registers from the GPU host's NVRTC in the product's module and 144-146 from this one's
    (13.5), and probe modules of a few kernels took 146-152 there: three blocks per SM, and 43 µs instead of 33 at M = 64,
    8192² (docs/kernels.md, "The epilogue's barrier and the registers of the wgmma kernels")."""
    regs: dict[str, int] = {}
    lowered: dict[str, str] = {}
    for f in compiled["w4a16_mma.cu+w4a16_wg.cu", "sm_90a"]:
        regs.update(registers(f.result().log))
        lowered.update(f.result().lowered)
    seen = 0
    for cfg in _WG_VARIANTS:
        if cfg[1] != 1:
            continue
        blocks = min(4, 228 * 1024 // (_wg_smem(cfg) + 1024))
        for kt in ("F16", "BF16"):
            used = regs[lowered[_wg_name(kt, cfg)]]
            per_warp = -(-used // 8) * 8 * 32  # registers are given to a warp in units of 8 per thread
            assert per_warp * 4 * blocks <= 64 * 1024, (cfg, kt, used, blocks)
            seen += 1
    assert seen >= 8  # (4, 1, 4, 2), (4, 1, 4, 4), (4, 1, 4, 7), (4, 1, 4, 8), ... in both dtypes
    for cfg in _WGM_VARIANTS:  # w4a16_wgm: one block of 16 warps per SM (__launch_bounds__(512, 1))
        for kt in ("F16", "BF16"):
            used = regs[lowered[_wg_name(kt, cfg)]]
            assert -(-used // 8) * 8 * 32 * 16 <= 64 * 1024, (cfg, kt, used)


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
def test_bfloat16_scale_conversion_is_in_the_product_and_bfloat16s_alone() -> None:
    """bfloat16's scales and zeros are converted two per hardware instruction (W4_BFSZ) in w4a16_wk at MT >= 1 and in
    the wgmma kernels: their bfloat16 code differs from the -DW4_BFSZ=0 build's, which the GPU tests
    (test_w4a16_bfloat16_scales_*_give_the_bits_of_before) compare it with bit for bit, and float16's is the same."""
    assert NVRTC is not None
    for file, arch, names in (("w4a16_mma.cu", "sm_90", ("w4a16_wk<{},2,4,8,3,1>",)),
                              ("w4a16_mma.cu+w4a16_wg.cu", "sm_90a", (_wg_name("{}", (4, 4, 2)), _wg_name("{}", (4, 1, 4, 7))))):
        code = source(file)
        for name in names:
            bf16, f16 = name.format("BF16"), name.format("F16")
            product = compile_cubin(NVRTC, code, (bf16,), arch).cubin
            for kernel, opt, same in ((bf16, "-DW4_BFSZ=0", False), (bf16, "-DW4_BFSZ=1", True),
                                      (f16, "-DW4_BFSZ=0", True)):
                built = compile_cubin(NVRTC, code, (kernel,), arch, (*OPTIONS, opt)).cubin
                want = product if kernel == bf16 else compile_cubin(NVRTC, code, (f16,), arch).cubin
                assert (built == want) is same, (kernel, opt)


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
def test_float16_weights_through_subnormals_at_mt_1_and_more_are_in_the_product() -> None:
    """w4a16_wk at MT >= 1 in float16 dequantizes through subnormals (W4_WKSUB): its code differs from the
    -DW4_WKSUB=0 build's; bfloat16's and the MT <= 0 kernels' (dq_sub, or the float32 correction) are the same. The GPU
    tests (test_w4a16_wk_float16_*) check its results against float64 by scale."""
    assert NVRTC is not None
    code = source("w4a16_mma.cu")
    for name, changed in (("w4a16_wk<F16,2,4,8,3,1>", True), ("w4a16_wkc<F16,1,4,8,3,1,2>", True),
                          ("w4a16_wkc<F16,0,4,8,3,1,2>", False), ("w4a16_wkc<F16,-2,4,8,3,1,2>", False),
                          ("w4a16_wk<BF16,2,4,8,3,1>", False)):
        product = compile_cubin(NVRTC, code, (name,), "sm_90").cubin
        assert compile_cubin(NVRTC, code, (name,), "sm_90", (*OPTIONS, "-DW4_WKSUB=1")).cubin == product, name
        assert (compile_cubin(NVRTC, code, (name,), "sm_90", (*OPTIONS, "-DW4_WKSUB=0")).cubin != product) is changed, name


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
def test_the_wgmma_switches_are_in_the_product() -> None:
    """w4a16_wgc's second cluster barrier arrives without release (W4_WGEPI) and the wgmma kernels address their copies
    by 32-bit offsets (W4_WGOFF) and issue them in one predicated run (W4_WGCP), and make the k16 steps' descriptors from
    the chunk's (W4_WGDS): the product's code differs from each build with one of them off, which the GPU test
    (test_w4a16_wgc_switches_give_the_bits_of_before) checks it against bit for bit; w4a16_wg (no cluster) is the same
    with W4_WGEPI off. float16's weights through subnormals (W4_WGSUB) change the code of float16 only (the GPU tests
    check its results by scale against float64: test_w4a16_wgmma_float16_weights_through_subnormals_by_scale)."""
    assert NVRTC is not None
    code = source("w4a16_mma.cu+w4a16_wg.cu")
    wgc, wg = _wg_name("F16", (4, 1, 4, 7)), _wg_name("F16", (4, 2, 4, 1))
    assert {wgc, wg} <= set(_wg_names("F16"))

    def cubin(name: str, *opts: str) -> bytes:
        return compile_cubin(NVRTC, code, (name,), "sm_90a", (*OPTIONS, *opts)).cubin

    product, product_wg = cubin(wgc), cubin(wg)
    assert cubin(wgc, "-DW4_WGEPI=0") != product
    assert cubin(wgc, "-DW4_WGOFF=0") != product
    assert cubin(wgc, "-DW4_WGCP=0") != product
    assert cubin(wgc, "-DW4_WGDS=0") != product
    assert cubin(wgc, "-DW4_WGSUB=0") != product
    assert cubin(wgc, "-DW4_WGEPI=1", "-DW4_WGOFF=1", "-DW4_WGLB=1", "-DW4_WGCP=1", "-DW4_WGDS=1", "-DW4_WGSUB=1") == product
    bf16 = _wg_name("BF16", (4, 4, 2))  # W4_WGSUB is float16's: bfloat16's code is the same without it
    assert cubin(bf16, "-DW4_WGSUB=0") == cubin(bf16)
    assert cubin(wg, "-DW4_WGEPI=0") == product_wg
    assert cubin(wg, "-DW4_WGOFF=0") != product_wg
    assert cubin(wg, "-DW4_WGCP=0") != product_wg
    assert cubin(wg, "-DW4_WGDS=0") != product_wg
