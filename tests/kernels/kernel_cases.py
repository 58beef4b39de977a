"""Per-op test cases: random inputs (never zero) and float64 references written independently
of shmrpc.kernels (own bfloat16 conversion, own formulas). Used by the NumPy and GPU parity tests."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Arrays = dict[str, np.ndarray]


def bf16_bits(f: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bits by truncation (test-side, independent of the kernels' rounding)."""
    return (np.asarray(f, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def to_f64(a: np.ndarray, dtype: str) -> np.ndarray:
    """Storage array of ``dtype`` -> float64."""
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def storage(f: np.ndarray, dtype: str) -> np.ndarray:
    return bf16_bits(f) if dtype == "bfloat16" else np.asarray(f).astype(dtype)


def nonzero(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """Magnitudes in [0.5, 1.5) * scale, random signs: never zero."""
    return rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape) * scale


@dataclass
class Case:
    """make(dtype, rng) -> (inputs, attrs); ref(f64 inputs, attrs) -> f64 outputs; or check(...) instead."""

    dtypes: tuple[str, ...]
    make: Callable[[str, np.random.Generator], tuple[Arrays, dict[str, Any]]]
    ref: Callable[[dict[str, np.ndarray], dict[str, Any]], dict[str, np.ndarray]] | None = None
    check: Callable[[Arrays, Arrays, dict[str, Any]], None] | None = None
    in_dtypes: dict[str, str] = field(default_factory=dict)  # param -> dtype when not the case dtype


FLOATS = ("float16", "bfloat16", "float32", "float64")
K_SQRT = math.sqrt(2 / math.pi)


def _gelu(f: np.ndarray) -> np.ndarray:
    return 0.5 * f * (1 + np.tanh(K_SQRT * (f + 0.044715 * f**3)))


def _ln(x: np.ndarray, g: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def _elem(n_in: int, shape=(3, 17)):
    def make(dt: str, rng: np.random.Generator):
        names = ["x", "y"][:n_in]
        if dt in FLOATS:
            return {n: storage(nonzero(rng, shape), dt) for n in names}, {}
        info = np.iinfo(dt)
        hi = min(info.max // 2, 100)
        return {n: rng.integers(1, hi, shape).astype(dt) for n in names}, {}
    return make


def _make_scale(dt, rng):
    return {"x": storage(nonzero(rng, (5, 33)), dt)}, {"a": 1.7, "b": -0.3}


def _make_rows(dt, rng, d=64, rows=(3, 5)):
    x = storage(nonzero(rng, (*rows, d)), dt)
    return {"x": x, "gamma": storage(nonzero(rng, (d,)), dt), "beta": storage(nonzero(rng, (d,), 0.1), dt)}, {"eps": 1e-5}


def _make_gemm(dt, rng, bias=False):
    m, k, n = 7, 64, 24
    ins = {"x": storage(nonzero(rng, (m, k), 1 / math.sqrt(k)), dt), "w": storage(nonzero(rng, (k, n)), dt)}
    if bias:
        ins["bias"] = storage(nonzero(rng, (n,), 0.5), dt)
    return ins, {}


def _make_quant(dt, rng):
    return {"w": storage(nonzero(rng, (256, 48)), dt)}, {"group_size": 64}


def _make_w4a16(dt, rng, m=3, k=256, n=64, gs=128):
    g = k // gs
    ins = {
        "x": storage(nonzero(rng, (m, k), 1 / math.sqrt(k)), dt),
        "qweight": rng.integers(0, 256, (k // 2, n)).astype(np.uint8),
        "scales": rng.uniform(0.05, 0.2, (g, n)).astype(np.float16),
        "zeros": rng.integers(0, 16, (g, n)).astype(np.float16),
    }
    return ins, {}


def dequant_ref(qweight: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """float64 (K, N) from the documented packing: low nibble = even k."""
    k2, n = qweight.shape
    q = np.empty((2 * k2, n), np.float64)
    q[0::2] = qweight & 0x0F
    q[1::2] = qweight >> 4
    gs = 2 * k2 // scales.shape[0]
    return (q - np.repeat(zeros.astype(np.float64), gs, 0)) * np.repeat(scales.astype(np.float64), gs, 0)


def check_quant(ins: Arrays, outs: Arrays, attrs: dict[str, Any], dtype: str) -> None:
    """|w - dequant| <= scale/2 (+ float16 rounding of the scale, relative to the group range)."""
    w = to_f64(ins["w"], dtype)
    qw, sc, zr = outs["qweight"], outs["scales"], outs["zeros"]
    assert qw.dtype == np.uint8 and sc.dtype == np.float16 and zr.dtype == np.float16
    assert np.all(zr == np.round(zr)) and zr.min() >= 0 and zr.max() <= 15
    deq = dequant_ref(qw, sc, zr)
    gs = attrs["group_size"]
    s = np.repeat(sc.astype(np.float64), gs, 0)
    rng_ = np.repeat(np.abs(w).reshape(-1, gs, w.shape[1]).max(1) * 2, gs, 0)
    err = np.abs(w - deq)
    bound = 0.5 * s * (1 + 1e-3) + rng_ * 2e-3
    assert np.all(err <= bound), float((err - bound).max())


CASES: dict[str, Case] = {
    "echo": Case(("float16", "bfloat16", "float32", "int32", "uint8", "bool"),
                 lambda dt, rng: ({"x": storage(nonzero(rng, (4, 9)), dt) if dt in FLOATS else rng.integers(0, 2, (4, 9)).astype(dt)}, {}),
                 lambda f, a: {"out": f["x"]}),
    "vector_add": Case(("float16", "bfloat16", "float32", "float64", "int32", "uint8"), _elem(2),
                       lambda f, a: {"out": f["x"] + f["y"]}),
    "scale": Case(FLOATS, _make_scale, lambda f, a: {"out": a["a"] * f["x"] + a["b"]}),
    "gelu": Case(FLOATS, _elem(1), lambda f, a: {"out": _gelu(f["x"])}),
    "softmax": Case(FLOATS, lambda dt, rng: ({"x": storage(nonzero(rng, (4, 6, 40), 3.0), dt)}, {}),
                    lambda f, a: {"out": np.exp(f["x"] - f["x"].max(-1, keepdims=True))
                                  / np.exp(f["x"] - f["x"].max(-1, keepdims=True)).sum(-1, keepdims=True)}),
    "layernorm": Case(FLOATS, _make_rows, lambda f, a: {"out": _ln(f["x"], f["gamma"], f["beta"], a["eps"])}),
    "layernorm_gelu": Case(FLOATS, _make_rows, lambda f, a: {"out": _gelu(_ln(f["x"], f["gamma"], f["beta"], a["eps"]))}),
    "gemm": Case(FLOATS, _make_gemm, lambda f, a: {"out": f["x"] @ f["w"]}),
    "gemm_bias": Case(FLOATS, lambda dt, rng: _make_gemm(dt, rng, bias=True), lambda f, a: {"out": f["x"] @ f["w"] + f["bias"]}),
    "quantize_int4": Case(("float16", "bfloat16", "float32"), _make_quant),
    "gemm_w4a16": Case(("float16", "bfloat16"), _make_w4a16,
                       lambda f, a: {"out": f["x"] @ dequant_ref(f["qweight"].astype(np.uint8), f["scales"], f["zeros"])},
                       in_dtypes={"qweight": "uint8", "scales": "float16", "zeros": "float16"}),
}
