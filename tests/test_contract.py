"""Pieces of the contract that live in more than one place, checked to agree.

``kernels`` may not import ``schema`` (it sees arrays only; see test_imports.py), so it keeps
its own list of dtype names and produces the op table as plain data. These tests are the guard
that keeps those copies equal to the schema's.
"""

from __future__ import annotations

import re
from pathlib import Path

from shmrpc import kernels
from shmrpc.kernels import _dtypes as kernel_dtypes
from shmrpc.schema import dtypes
from shmrpc.schema.optable import build_op_table, parse_op_table

FBS = Path(__file__).resolve().parents[1] / "schema" / "shmrpc.fbs"


def _fbs_dtypes() -> dict[str, int]:
    body = re.search(r"enum\s+DType\s*:\s*ubyte\s*\{([^}]*)\}", FBS.read_text())
    assert body, "enum DType not found in shmrpc.fbs"
    pairs = re.findall(r"(\w+)\s*=\s*(\d+)", re.sub(r"//[^\n]*", "", body.group(1)))
    # FlatBuffers' Python code cannot have a member named `bool`: the .fbs spells it `bool_`
    return {name.rstrip("_"): int(code) for name, code in pairs if name != "invalid"}


def test_three_dtype_lists_agree() -> None:
    fbs = _fbs_dtypes()
    assert fbs == dtypes.DTYPE_CODES, "schema/dtypes.py and the .fbs enum DType differ"
    # kernels/_dtypes.py lists names only, in wire-code order
    assert list(kernel_dtypes.DTYPE_NAMES) == sorted(fbs, key=fbs.__getitem__), \
        "kernels/_dtypes.py and the .fbs enum DType differ"


def test_dtype_item_sizes_agree() -> None:
    for name in dtypes.DTYPE_CODES:
        assert kernel_dtypes.itemsize(name) == dtypes.itemsize(name), name


def test_kernels_op_table_is_a_valid_schema_op_table() -> None:
    plain = kernels.op_table()
    parsed = parse_op_table(plain)
    assert build_op_table(parsed.values()) == plain  # the worker sends it unchanged
    assert {name: e.code for name, e in parsed.items()} == {n: s.code for n, s in kernels.REGISTRY.items()}


def test_user_code_range_agrees() -> None:
    from shmrpc.kernels import api
    from shmrpc.schema import optable

    assert api.USER_CODE_MIN == optable.USER_CODE_MIN
    assert all(e.builtin for e in parse_op_table(kernels.op_table()).values())
