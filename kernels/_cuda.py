"""Loading the CUDA sources in ``kernels/cuda/`` as CuPy RawModules (lazily, cached).

Only the CuPy paths import this module, and it imports CuPy only inside functions.
Compiled binaries land in CuPy's on-disk kernel cache (``CUPY_CACHE_DIR``, default
``~/.cupy/kernel_cache``), so a worker restart does not recompile.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

__all__ = ["CUDA_DIR", "source", "get_function", "sm_count"]

CUDA_DIR = Path(__file__).with_name("cuda")
_lock = threading.Lock()
_modules: dict[tuple[int, str, tuple[str, ...], str | None], Any] = {}
_sm: dict[int, int] = {}


def source(name: str) -> str:
    """``common.cuh`` followed by ``cuda/<name>`` (no #include: NVRTC needs no include path); ``name`` may list
    several files joined by ``+`` (``"w4a16_mma.cu+w4a16_wg.cu"``), read in that order."""
    return "\n".join((CUDA_DIR / f).read_text() for f in ("common.cuh", *name.split("+")))


def get_function(file: str, names: tuple[str, ...], name: str, arch: str | None = None) -> Any:
    """The kernel ``name`` (a C++ name expression such as ``"ln_rows<F16,8,1,true>"``).

    ``names`` lists every name expression of the module built from ``file`` (see :func:`source`) on the
    current device; the module is compiled once per (device, file, names, arch). ``arch`` (e.g. ``"sm_90a"``):
    compile for that exact target instead of CuPy's choice (architecture-specific instructions such as wgmma);
    such a module is compiled by NVRTC in the process (CuPy's disk cache takes only its own targets).
    """
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    key = (dev, file, names, arch)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            if arch is None:
                mod = cupy.RawModule(code=source(file), options=("-std=c++17",), name_expressions=list(names))
            else:
                mod = _ArchModule(source(file), names, arch)
            _modules[key] = mod
    return mod.get_function(name)


class _ArchModule:
    """A module compiled by NVRTC to a cubin for one target (``-arch=<arch>``), loaded with the driver."""

    def __init__(self, code: str, names: tuple[str, ...], arch: str) -> None:
        from cupy.cuda import compiler, function

        prog = compiler._NVRTCProgram(code, "shmrpc_" + arch + ".cu", name_expressions=list(names), method="cubin")
        cubin, self._lowered = prog.compile(("-std=c++17", "--device-as-default-execution-space", f"-arch={arch}"))
        self._mod = function.Module()
        self._mod.load(cubin)

    def get_function(self, name: str) -> Any:
        return self._mod.get_function(self._lowered[name])


def sm_count() -> int:
    """Streaming multiprocessors of the current device."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    if dev not in _sm:
        _sm[dev] = int(cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
    return _sm[dev]
