"""bench/gpu/ncu_parts.py sums Nsight Compute's sampled stalls by part of a kernel: on the recorded M = 64 profile the
parts cover every sample once and give docs/kernels.md's table ("The epilogue's barrier and the registers")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ncu_parts", _ROOT / "bench" / "gpu" / "ncu_parts.py")
assert _spec is not None and _spec.loader is not None
ncu_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_parts)

_WHOLE = ("prologue", "chunk loop", "loop's end to the first cluster barrier", "sums between the barriers",
          "second cluster barrier and after")


@pytest.mark.parametrize(("name", "want"), [
    ("m64", {"prologue": 6, "chunk loop": 57, "of it the chunk's barrier and the copies' issue": 23,
             "loop's end to the first cluster barrier": 16, "sums between the barriers": 11,
             "second cluster barrier and after": 9}),
    ("m64n14k", {"prologue": 7, "chunk loop": 62, "of it the chunk's barrier and the copies' issue": 27,
                 "loop's end to the first cluster barrier": 6, "sums between the barriers": 15,
                 "second cluster barrier and after": 10})])
def test_the_recorded_profile_gives_the_docs_table(name, want) -> None:
    got = ncu_parts.parts(str(_ROOT / "bench" / "results" / f"ncu-src-{name}-sass-2026-12-03-aa80992.csv"))
    assert sum(got[p] for p in _WHOLE) == pytest.approx(1.0)
    assert {p: round(100 * got[p]) for p in want} == want
    assert got["first barrier's wait"] < got["loop's end to the first cluster barrier"]
    assert got["second barrier's wait"] < got["second cluster barrier and after"]
