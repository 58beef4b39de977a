"""NVRTC called directly through ctypes, without CuPy or a GPU: the CUDA sources of ``kernels/cuda/`` compiled to a
cubin for a named target. For the developers' checks (``tests/kernels/test_cuda_compile.py``) and tools
(``bench/gpu/sass_loop.py --nvrtc``); the op's own builds go through CuPy (:mod:`._cuda`).

The library is the one of the ``nvidia-cuda-nvrtc`` wheel (the dev extra installs it), else the system's;
``tool("cuobjdump")`` finds the binary utilities the same way (the ``nvidia-cuda-cuobjdump`` and
``nvidia-cuda-nvdisasm`` wheels, else ``PATH``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import importlib.util
import re
import shutil
from pathlib import Path

__all__ = ["OPTIONS", "Compiled", "NvrtcError", "compile_cubin", "load", "registers", "tool"]

OPTIONS = ("-std=c++17", "--device-as-default-execution-space")  # as CuPy builds a RawModule (it adds the -arch)


class NvrtcError(RuntimeError):
    """NVRTC refused the program; the message ends with its log."""


@dataclasses.dataclass(frozen=True)
class Compiled:
    cubin: bytes
    log: str  # NVRTC's log (ptxas's lines with "--ptxas-options=-v")
    lowered: dict[str, str]  # name expression -> mangled kernel name


def _nvidia_dirs() -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def load() -> ctypes.CDLL | None:
    """The NVRTC library (the wheel's newest, else the system's), or None where there is none."""
    for root in _nvidia_dirs():
        for lib in sorted(root.glob("*/lib/libnvrtc.so*"), reverse=True):
            if "builtins" not in lib.name and ".alt." not in lib.name:
                return ctypes.CDLL(str(lib))
    found = ctypes.util.find_library("nvrtc")
    return ctypes.CDLL(found) if found else None


def tool(name: str) -> str | None:
    """The path of a CUDA binary utility (``cuobjdump``, ``nvdisasm``) from the nvidia wheels or ``PATH``."""
    for root in _nvidia_dirs():
        for path in sorted(root.glob(f"*/bin/{name}"), reverse=True):
            return str(path)
    return shutil.which(name)


def compile_cubin(lib: ctypes.CDLL, code: str, names: tuple[str, ...], arch: str,
                  options: tuple[str, ...] = OPTIONS) -> Compiled:
    """``code`` compiled for ``arch`` (``"sm_90"``, ``"sm_90a"``) with every name expression of ``names``
    instantiated. Raises NvrtcError with NVRTC's log where it does not compile, or a name has no kernel."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"shmrpc.cu", 0, None, None):
        raise NvrtcError("nvrtcCreateProgram failed")
    try:
        for n in names:
            if lib.nvrtcAddNameExpression(prog, n.encode()):
                raise NvrtcError(f"nvrtcAddNameExpression failed for {n}")
        opts = [o.encode() for o in (*options, f"-arch={arch}")]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc:
            raise NvrtcError(f"NVRTC error {rc} for {arch}:\n{log[-4000:]}")
        lowered: dict[str, str] = {}
        for n in names:
            out = ctypes.c_char_p()
            if lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(out)) or not out.value:
                raise NvrtcError(f"no kernel for {n}")
            lowered[n] = out.value.decode()
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if not size.value or lib.nvrtcGetCUBIN(prog, cubin):
            raise NvrtcError(f"no cubin for {arch}")
        return Compiled(cubin.raw, log, lowered)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def registers(ptxas: str) -> dict[str, int]:
    """ptxas -v output (``--ptxas-options=-v`` in a compile's log, or nvcc's) -> registers per thread by mangled name."""
    out: dict[str, int] = {}
    name = None
    for line in ptxas.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            name = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and name:
            out[name] = int(m.group(1))
    return out
