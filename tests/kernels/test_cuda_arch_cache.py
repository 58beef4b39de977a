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
