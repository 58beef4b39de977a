"""Loading the CUDA sources in ``kernels/cuda/`` as CuPy RawModules (lazily, cached).

Only the CuPy paths import this module, and it imports CuPy only inside functions.
Compiled binaries land in CuPy's on-disk kernel cache directory (``CUPY_CACHE_DIR``, default
``~/.cupy/kernel_cache``), so a worker restart does not recompile: CuPy's own cache for the
RawModules, and ``shmrpc-<arch>-<hash>.cubin`` files (:func:`_arch_cubin`) for the modules built for one exact
target (``arch``).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._plan import bounded_put

__all__ = ["CUDA_DIR", "source", "get_function", "sm_count", "launch_dependent"]

CUDA_DIR = Path(__file__).with_name("cuda")
_lock = threading.Lock()
_modules: dict[tuple[int, str, tuple[str, ...], str | None], Any] = {}
_sm: dict[int, int] = {}
# get_function's answers by (device, file, id(names), arch, name) -> (names, the _modules dict, function): a launch
# asks for its kernel every time; this skips hashing the module's name list and taking the lock.
# An entry counts only for the very tuple it names (kept alive here, so its id is not reused) and the same _modules.
_functions: dict[tuple[int, str, int, str | None, str], tuple[tuple[str, ...], dict[Any, Any], Any]] = {}


def source(name: str) -> str:
    """``common.cuh`` followed by ``cuda/<name>`` (no #include: NVRTC needs no include path); ``name`` may list
    several files joined by ``+`` (``"w4a16_mma.cu+w4a16_wg.cu"``), read in that order."""
    return "\n".join((CUDA_DIR / f).read_text() for f in ("common.cuh", *name.split("+")))


def get_function(file: str, names: tuple[str, ...], name: str, arch: str | None = None) -> Any:
    """The kernel ``name`` (a C++ name expression such as ``"ln_rows<F16,8,1,true>"``).

    ``names`` lists every name expression of the module built from ``file`` (see :func:`source`) on the
    current device; the module is compiled once per (device, file, names, arch). ``arch`` (e.g. ``"sm_90a"``):
    compile for that exact target instead of CuPy's choice (architecture-specific instructions such as wgmma),
    by NVRTC through CuPy's compiler module, the cubin cached on disk by :func:`_arch_cubin`.
    """
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    fast = (dev, file, id(names), arch, name)
    hit = _functions.get(fast)
    if hit is not None and hit[0] is names and hit[1] is _modules:
        return hit[2]
    key = (dev, file, names, arch)
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            if arch is None:
                mod = _Module(cupy.RawModule(code=source(file), options=("-std=c++17",), name_expressions=list(names)))
            else:
                mod = _Module(_ArchModule(source(file), names, arch))
            _modules[key] = mod
        fn = mod.get_function(name)
        bounded_put(_functions, fast, (names, _modules, fn), 4096)
    return fn


class _ArchModule:
    """A module compiled by NVRTC to a cubin for one target (``-arch=<arch>``), loaded with the driver; the cubin
    kept in CuPy's cache directory (:func:`_arch_cubin`). ``extra``: more compile options (probe builds of the bench
    and the tests, e.g. ``("-DW4_WGEPI=0",)``; the op's own modules have none)."""

    def __init__(self, code: str, names: tuple[str, ...], arch: str, extra: tuple[str, ...] = ()) -> None:
        from cupy.cuda import compiler, function

        options = ("-std=c++17", "--device-as-default-execution-space", f"-arch={arch}", *extra)

        def build() -> tuple[bytes, dict[str, str]]:
            prog = compiler._NVRTCProgram(code, "shmrpc_" + arch + ".cu", name_expressions=list(names), method="cubin")
            cubin, lowered = prog.compile(options)
            return bytes(cubin), dict(lowered)

        version = [list(compiler._get_nvrtc_version()), list(options)]
        cache_dir = Path(os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache"))  # CuPy's
        cubin, self._lowered = _arch_cubin(code, names, arch, version, build, cache_dir)
        self._mod = function.Module()
        self._mod.load(cubin)

    def get_function(self, name: str) -> Any:
        return self._mod.get_function(self._lowered[name])


class _Module:
    """A loaded module and the functions asked of it, one object per kernel name: CuPy's modules make a new object per
    get_function call, and the op keeps per-function state (the shared-memory opt-in of ``quant.wk_launch``)."""

    def __init__(self, mod: Any) -> None:
        self._mod = mod
        self._fns: dict[str, Any] = {}

    def get_function(self, name: str) -> Any:
        fn = self._fns.get(name)
        if fn is None:
            fn = self._fns[name] = self._mod.get_function(name)
        return fn


def _arch_cubin(code: str, names: tuple[str, ...], arch: str, version: Any,
                compile_fn: Callable[[], tuple[bytes, dict[str, str]]], cache_dir: Path) -> tuple[bytes, dict[str, str]]:
    """The cubin and lowered names of (code, names, arch, version) read from ``cache_dir``, or ``compile_fn()`` and
    written there (each file replaced whole, so a concurrent reader sees the old one or the new one; an unwritable
    directory only means compiling again next time). The file names hash all four, so another source, name list,
    target or compiler never reads them."""
    key = hashlib.sha256(json.dumps([code, list(names), arch, version]).encode()).hexdigest()[:32]
    path = cache_dir / f"shmrpc-{arch}-{key}.cubin"
    meta = path.with_suffix(".json")
    try:
        lowered = json.loads(meta.read_text())
        cubin = path.read_bytes()
        if isinstance(lowered, dict) and set(lowered) == set(names) and cubin:
            return cubin, lowered
    except (OSError, ValueError):
        pass
    cubin, lowered = compile_fn()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        for dst, data in ((path, cubin), (meta, json.dumps(lowered).encode())):
            tmp = dst.with_name(f"{dst.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dst)
    except OSError:
        pass
    return cubin, lowered


def sm_count() -> int:
    """Streaming multiprocessors of the current device."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    if dev not in _sm:
        _sm[dev] = int(cupy.cuda.runtime.getDeviceProperties(dev)["multiProcessorCount"])
    return _sm[dev]


# cuLaunchKernelEx's arguments (cuda.h): CUlaunchAttribute is a 4-byte id, then its value union (64 bytes) at offset 8;
# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6, its value an int (programmaticStreamSerializationAllowed)
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_int), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttr)),
                ("n_attrs", ctypes.c_uint)]


_launch_ex: list[Any] = []  # [cuLaunchKernelEx or None (not in the driver), its attribute] once looked up


class _Prepared:
    """One launch geometry's cuLaunchKernelEx arguments, made once: the config, and the parameter array pointing at
    one 8-byte slot per argument (a pointer, or an int32 in the slot's low half: little-endian)."""

    __slots__ = ("fn", "handle", "cfg", "slots", "params")

    def __init__(self, fn: Any, grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int, stream: int, n: int,
                 attr: _LaunchAttr) -> None:
        self.fn = fn  # kept: the key holds its id
        self.handle = fn.ptr if hasattr(fn, "ptr") else fn.kernel.ptr
        g, b = (*grid, 1, 1), (*block, 1, 1)
        self.cfg = _LaunchConfig(g[0], g[1], g[2], b[0], b[1], b[2], shared_mem, stream, ctypes.pointer(attr), 1)
        self.slots = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self.slots)
        self.params = (ctypes.c_void_p * n)(*(base + 8 * i for i in range(n)))


_PREPARED: dict[tuple[Any, ...], _Prepared] = {}


def launch_dependent(fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
                     shared_mem: int = 0) -> bool:
    """Launch ``fn`` (a kernel of :func:`get_function`) on the current stream as a programmatic dependent launch
    (sm_90 and later): it may start before the kernel ahead of it in the stream has finished, so it must execute
    ``griddepcontrol.wait`` before it reads or writes anything that kernel may touch (``pdl_begin`` in
    ``cuda/w4a16_mma.cu``). ``args``: CuPy arrays (their device pointers) and NumPy int32 scalars, in order.

    Returns False, launching nothing, while the stream is being captured into a CUDA graph (the caller launches as
    usual: a graph's kernels are ordered by its edges), and where the driver has no ``cuLaunchKernelEx``. Raises
    ``RuntimeError`` with the driver's code if the launch fails. The prepared arguments are per thread (the key holds
    the thread's id): two threads never write one parameter array."""
    import cupy

    stream = cupy.cuda.get_current_stream().ptr
    if stream and cupy.cuda.runtime.streamIsCapturing(stream):
        return False
    if not _launch_ex:
        f: Any = None
        try:
            f = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            f.restype = ctypes.c_int
        except (OSError, AttributeError):  # a driver without it (before CUDA 12): plain launches from now on
            f = None
        _launch_ex.extend((f, _LaunchAttr(_PROGRAMMATIC_STREAM_SERIALIZATION, 0, 1)))
    if _launch_ex[0] is None:
        return False
    key = (id(fn), grid, block, shared_mem, stream, len(args), threading.get_ident())
    p = _PREPARED.get(key)
    if p is None or p.fn is not fn:
        p = _Prepared(fn, grid, block, shared_mem, stream, len(args), _launch_ex[1])
        bounded_put(_PREPARED, key, p, 1024)
    slots = p.slots
    ndarray = cupy.ndarray
    for i, a in enumerate(args):
        slots[i] = a.data.ptr if type(a) is ndarray else int(a) & 0xFFFFFFFF
    rc = _launch_ex[0](ctypes.addressof(p.cfg), p.handle, ctypes.addressof(p.params), None)
    if rc:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
    return True
