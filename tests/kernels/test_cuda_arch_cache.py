"""The on-disk cache of the modules built for one exact target (``_cuda._arch_cubin``), without a GPU: a compile
function that counts its calls stands in for NVRTC."""

from __future__ import annotations

import pytest

from shmrpc.kernels._cuda import _arch_cubin

NAMES = ("k<F16,1>", "k<BF16,1>")


class Compiler:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> tuple[bytes, dict[str, str]]:
        self.calls += 1
        return b"cubin-%d" % self.calls, {n: f"_Z{i}" for i, n in enumerate(NAMES)}


def test_compiled_once_then_read(tmp_path) -> None:
    c = Compiler()
    first = _arch_cubin("src", NAMES, "sm_90a", [12, 9], c, tmp_path)
    again = _arch_cubin("src", NAMES, "sm_90a", [12, 9], c, tmp_path)
    assert c.calls == 1 and again == first == (b"cubin-1", {"k<F16,1>": "_Z0", "k<BF16,1>": "_Z1"})
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".cubin", ".json"]  # no temporary file left


@pytest.mark.parametrize("change", ["code", "names", "arch", "version"])
def test_another_source_names_target_or_compiler_compiles_again(tmp_path, change) -> None:
    c = Compiler()
    base = {"code": "src", "names": NAMES, "arch": "sm_90a", "version": [12, 9]}
    _arch_cubin(**base, compile_fn=c, cache_dir=tmp_path)
    other = {**base, change: {"code": "src2", "names": NAMES[:1], "arch": "sm_100a", "version": [13, 0]}[change]}
    cubin, _ = _arch_cubin(**other, compile_fn=c, cache_dir=tmp_path)
    assert c.calls == 2 and cubin == b"cubin-2"
    assert _arch_cubin(**base, compile_fn=c, cache_dir=tmp_path)[0] == b"cubin-1"  # the first entry still read


def test_a_damaged_entry_is_compiled_again(tmp_path) -> None:
    c = Compiler()
    _arch_cubin("src", NAMES, "sm_90a", [12, 9], c, tmp_path)
    meta = next(tmp_path.glob("*.json"))
    meta.write_text("{not json")
    assert _arch_cubin("src", NAMES, "sm_90a", [12, 9], c, tmp_path)[0] == b"cubin-2"
    meta.write_text('{"k<F16,1>": "_Z0"}')  # a name missing
    assert _arch_cubin("src", NAMES, "sm_90a", [12, 9], c, tmp_path)[0] == b"cubin-3"
    next(tmp_path.glob("*.cubin")).write_bytes(b"")
    assert _arch_cubin("src", NAMES, "sm_90a", [12, 9], c, tmp_path)[0] == b"cubin-4"


def test_an_unwritable_cache_directory_only_costs_a_compile(tmp_path) -> None:
    c = Compiler()
    blocked = tmp_path / "file"
    blocked.write_text("")
    cache = blocked / "cache"  # under a regular file: no directory can be made there, whoever runs this
    assert _arch_cubin("src", NAMES, "sm_90a", [12, 9], c, cache)[0] == b"cubin-1"
    assert _arch_cubin("src", NAMES, "sm_90a", [12, 9], c, cache)[0] == b"cubin-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


class _FreshModule:
    """A stand-in CuPy module whose get_function makes a new object on every call, as CuPy's do."""

    def __init__(self, *a, **k) -> None:
        self.made = 0

    def get_function(self, name: str) -> object:
        self.made += 1
        return object()


def test_one_function_object_per_kernel_so_per_function_state_does_not_grow(monkeypatch) -> None:
    """get_function gives the same object for the same kernel (a module's get_function makes a new one per call: the
    op keeps its shared-memory opt-in per function object, and that table grew by one entry per launch), for another
    module list or device a module of its own, and a replaced module table (tests) is honoured."""
    import sys
    from types import SimpleNamespace

    from shmrpc.kernels import _cuda, quant

    current = [0]
    fake = SimpleNamespace(RawModule=_FreshModule, cuda=SimpleNamespace(runtime=SimpleNamespace(getDevice=lambda: current[0])))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(_cuda, "_modules", {})
    monkeypatch.setattr(_cuda, "source", lambda file: "src")
    names = ("k<1>", "k<2>")
    a = _cuda.get_function("f.cu", names, "k<1>")
    assert _cuda.get_function("f.cu", names, "k<1>") is a
    assert _cuda.get_function("f.cu", tuple(list(names)), "k<1>") is a  # an equal list, another tuple object
    assert _cuda.get_function("f.cu", names, "k<2>") is not a
    assert next(iter(_cuda._modules.values()))._mod.made == 2  # one per kernel name, not per call
    current[0] = 1
    assert _cuda.get_function("f.cu", names, "k<1>") is not a  # another device: its own module
    current[0] = 0
    monkeypatch.setattr(_cuda, "_modules", {})
    assert _cuda.get_function("f.cu", names, "k<1>") is not a  # a new module table: built again
    calls: list[int] = []
    launched = []

    class Kernel:
        max_dynamic_shared_size_bytes = 0

        def __setattr__(self, k, v) -> None:
            calls.append(v)

        def __call__(self, *a, **k) -> None:
            launched.append(a)

    fn = Kernel()
    monkeypatch.setattr(quant, "_WK_SMEM_SET", {})
    for _ in range(5):
        quant.wk_launch(fn, (1, 1), 4, 100 * 1024, ())
    assert calls == [100 * 1024] and len(quant._WK_SMEM_SET) == 1 and len(launched) == 5  # opted in once
