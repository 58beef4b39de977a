"""Every CUDA source of ``kernels/cuda/`` compiles with NVRTC for the GPU it runs on, without a GPU: the modules as
the CuPy paths build them (``_cuda.source``: common.cuh first), with every name expression they instantiate, for
sm_90 (what CuPy picks on an H100 / H200) and the wgmma module for sm_90a. A kernel edit that does not compile fails
here in CI instead of on the device. Skipped with the reason where NVRTC is not installed (the dev extra installs the
``nvidia-cuda-nvrtc`` wheel on Linux x86-64)."""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import importlib.util
import os
from pathlib import Path

import pytest

from shmrpc.kernels._cuda import source
from shmrpc.kernels._dtypes import itemsize
from shmrpc.kernels._w4a16_config import _mma_names, _w4a16_names, _wg_names
from shmrpc.kernels.norm import _KT, _LN_BLOCKS, _ln_names, _sm_names

OPTIONS = ("-std=c++17", "--device-as-default-execution-space")  # as CuPy compiles a RawModule (plus -arch)


def _libnvrtc() -> ctypes.CDLL | None:
    """The NVRTC of the nvidia-cuda-nvrtc wheel (nvidia/cu13/lib or nvidia/cuda_nvrtc/lib), else the system's."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(Path(root).glob("*/lib/libnvrtc.so*"), reverse=True):
            if "builtins" not in lib.name and "alt" not in lib.name:
                return ctypes.CDLL(str(lib))
    found = ctypes.util.find_library("nvrtc")
    return ctypes.CDLL(found) if found else None


try:
    NVRTC = _libnvrtc()
except OSError:
    NVRTC = None


def _compile(code: str, names: tuple[str, ...], arch: str) -> str:
    """Compile ``code`` for ``arch`` to a cubin with ``names`` instantiated; returns the log; raises with it on failure."""
    lib, prog = NVRTC, ctypes.c_void_p()
    assert lib is not None
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"shmrpc.cu", 0, None, None) == 0
    try:
        for n in names:
            assert lib.nvrtcAddNameExpression(prog, n.encode()) == 0, n
        opts = [o.encode() for o in (*OPTIONS, f"-arch={arch}")]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        text = log.value.decode(errors="replace")
        assert rc == 0, f"NVRTC error {rc} for {arch}:\n{text[-4000:]}"
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        assert size.value > 0
        for n in names:  # every name expression has its kernel
            lowered = ctypes.c_char_p()
            assert lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(lowered)) == 0 and lowered.value, n
        return text
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _both(names) -> tuple[str, ...]:
    return tuple(dict.fromkeys(n for kt in ("F16", "BF16") for n in names(kt)))


MODULES = {
    "gemm_w4a16.cu": lambda: _both(_w4a16_names),
    "w4a16_mma.cu": lambda: _both(_mma_names),
    "layernorm_gelu.cu": lambda: tuple(n for dt, kt in _KT.items() for v in {16 // itemsize(dt), 1}
                                       for b in _LN_BLOCKS for n in _ln_names(kt, v, b)),
    "softmax.cu": lambda: tuple(dict.fromkeys(n for dt, kt in _KT.items() for n in _sm_names(kt, 16 // itemsize(dt)))),
    "copy_rows.cu": lambda: (),
}


CASES = [*((f, "sm_90") for f in MODULES), ("w4a16_mma.cu+w4a16_wg.cu", "sm_90a")]


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, str], list[concurrent.futures.Future[str]]]:
    """Every case compiled at once on the machine's cores (NVRTC releases the GIL in ctypes calls); the biggest,
    w4a16_mma.cu, in two halves of its names."""
    jobs = []
    for file, arch in CASES:
        names = _both(_wg_names) if file.endswith("w4a16_wg.cu") else MODULES[file]()
        halves = (names[: len(names) // 2], names[len(names) // 2:]) if len(names) > 60 else (names,)
        jobs += [((file, arch), source(file), h, arch) for h in halves]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
    futures: dict[tuple[str, str], list[concurrent.futures.Future[str]]] = {}
    for key, code, names, arch in sorted(jobs, key=lambda j: -len(j[2])):
        futures.setdefault(key, []).append(pool.submit(_compile, code, names, arch))
    pool.shutdown(wait=False)
    return futures


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
@pytest.mark.parametrize(("file", "arch"), CASES)
def test_kernel_module_compiles(compiled, file, arch) -> None:
    for f in compiled[file, arch]:
        assert "error" not in f.result().lower()


@pytest.mark.skipif(NVRTC is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc, in the dev extra)")
def test_a_source_that_does_not_compile_fails() -> None:
    code = source("copy_rows.cu") + "\n__global__ void broken(int* p) { p[0] = undefined_name; }\n"
    with pytest.raises(AssertionError, match="undefined_name"):
        _compile(code, (), "sm_90")
    with pytest.raises(AssertionError, match="no_such_kernel"):
        _compile(source("softmax.cu"), ("no_such_kernel<F16>",), "sm_90")


def test_every_source_is_compiled_here() -> None:
    cuda = Path(source.__globals__["CUDA_DIR"])
    assert {p.name for p in cuda.glob("*.cu")} == {*MODULES, "w4a16_wg.cu"}
