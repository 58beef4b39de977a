"""The example decoder's users' ops (examples/decoder_ops.py) through the parity helper users run on their own
ops: NumPy against a float64 reference here, and CuPy against NumPy where there is a GPU."""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shmrpc.kernels import REGISTRY
from shmrpc.kernels._registry import unregister
from shmrpc.kernels.testing import check_parity

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module", autouse=True)
def decoder_ops() -> Iterator[Any]:
    sys.path.insert(0, str(EXAMPLES))
    before = set(REGISTRY)
    try:
        yield importlib.import_module("decoder_ops")
    finally:
        sys.path.remove(str(EXAMPLES))
        sys.modules.pop("decoder_ops", None)
        for n in set(REGISTRY) - before:
            unregister(n)


def test_residual_add_parity() -> None:
    rep = check_parity("residual_add", shapes=[{"x": (2, 64), "y": (2, 64)}, {"x": (1, 2048), "y": (1, 2048)}],
                       dtypes=["float32"], in_dtypes={"x": "float32", "y": "float16"},
                       reference=lambda f, a: {"out": f["x"] + f["y"]})
    assert len(rep.compared) == 2


def test_rmsnorm_f16_parity() -> None:
    def ref(f: dict[str, np.ndarray], a: Any) -> dict[str, np.ndarray]:
        x = f["x"]
        return {"out": x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + a["eps"]) * f["g"]}

    rep = check_parity("rmsnorm_f16", shapes=[{"x": (3, 64), "g": (64,)}, {"x": (1, 512), "g": (512,)}],
                       dtypes=["float32"], reference=ref)
    assert len(rep.compared) == 2


def test_kv_attend_parity_over_positions(decoder_ops: Any) -> None:
    d, h, t = 32, 4, 8

    def make(dt: str, rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        pos = int(rng.integers(0, t))
        kc = rng.standard_normal((t, d)).astype(np.float32)
        vc = rng.standard_normal((t, d)).astype(np.float32)
        return {"qkv": rng.standard_normal((1, 3 * d)).astype(np.float32), "kcache": kc, "vcache": vc,
                "pos": np.array([pos], np.int32)}, {"n_heads": h}

    def ref(f: dict[str, np.ndarray], a: Any) -> dict[str, np.ndarray]:
        pos = int(f["pos"][0])
        row = f["qkv"].reshape(-1)
        q = decoder_ops.rope(np, row[:d], pos, h)
        k, v = f["kcache"].copy(), f["vcache"].copy()
        k[pos], v[pos] = decoder_ops.rope(np, row[d:2 * d], pos, h), row[2 * d:]
        hd = d // h
        s = np.einsum("hd,thd->ht", q.reshape(h, hd), k[: pos + 1].reshape(-1, h, hd)) / math.sqrt(hd)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        return {"out": np.einsum("ht,thd->hd", p, v[: pos + 1].reshape(-1, h, hd)).reshape(1, d)}

    # kcache and vcache are updated in place (mutates): the helper passes them as resident tensors
    rep = check_parity("kv_attend", dtypes=["float32"] * 5, make_inputs=make, reference=ref,
                       in_dtypes={"pos": "int32"})
    assert len(rep.compared) == 5
