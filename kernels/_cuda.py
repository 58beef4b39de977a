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
_modules: dict[tuple[int, str, tuple[str, ...]], Any] = {}
_sm: dict[int, int] = {}


def source(name: str) -> str:
    """``common.cuh`` followed by ``cuda/<name>`` (no #include: NVRTC needs no include path)."""
    return (CUDA_DIR / "common.cuh").read_text() + "\n" + (CUDA_DIR / name).read_text()


def get_function(file: str, names: tuple[str, ...], name: str) -> Any:
    """The kernel ``name`` (a C++ name expression such as ``"ln_rows<F16,8,1,true>"``).

    ``names`` lists every name expression of the module built from ``file`` on the
    current device; the module is compiled once per (device, file, names).
    """
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    key = (dev, file, names)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            mod = cupy.RawModule(code=source(file), options=("-std=c++17",), name_expressions=list(names))
            _modules[key] = mod
    return mod.get_function(name)


def sm_count() -> int:
    """Streaming multiprocessors of the current device."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    if dev not in _sm:
        _sm[dev] = int(cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
    return _sm[dev]
