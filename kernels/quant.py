"""Int4 weights: quantize_int4 (pack) and gemm_w4a16 (x @ dequant(w), fused).

Format (asymmetric, per group of ``group_size`` rows along K, per column)::

    w (K, N)  ->  qweight (K/2, N) uint8   qweight[r, n] = q[2r, n] | q[2r+1, n] << 4  (low nibble: even k)
                  scales  (K/gs, N) float16
                  zeros   (K/gs, N) float16  (integers 0..15)
    w[k, n] ~= (q[k, n] - zeros[k // gs, n]) * scales[k // gs, n]

Per group: lo = min(w, 0), hi = max(w, 0) (zero stays exact), scale = (hi - lo) / 15 rounded
to float16 (1.0 for an all-zero group), zero = clip(round(-lo / scale), 0, 15),
q = clip(round(w / scale) + zero, 0, 15), round half to even. |w - dequant| <= scale/2 plus
float16 rounding of the scale. A packed row is contiguous along N, which is what makes the
GPU kernel's 16-byte loads coalesce (see ``cuda/gemm_w4a16.cu``). Which kernel and launch a shape gets,
and the knobs that change it, are in :mod:`._w4a16_config`; this module runs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

from ._common import TOL_MATMUL, require_dtype, require_ndim
from ._dtypes import from_float, to_float
from ._errors import KernelInputError
from ._plan import bounded_put
from ._registry import AttrSpec, OpCall, OpSpec, TensorSpec
from ._w4a16_config import (
    _WK_SMEM_MAX,
    W4A16Tuning,
    _dequant_min_m,
    _h2_cfg,
    _h2_name,
    _is_wg,
    _mma_cfg,
    _mma_names,
    _w4a16_names,
    _wg_name,
    _wg_names,
    _wg_warps,
    _wk_name,
    tuning,
    use_tuning,
    w4a16_launch_config,
    w4a16_mma_launch,
    w4a16_wg_launch,
    w4a16_wk_launch,
)
from .api import register_op

__all__ = ["QUANTIZE_INT4", "GEMM_W4A16", "dequantize_int4", "w4a16_launch_config", "w4a16_mma_launch",
           "w4a16_choice", "w4a16_wg_launch", "w4a16_wk_launch", "pack_x", "W4A16Tuning", "tuning", "use_tuning"]

_FP16_TINY = 2.0**-24  # smallest float16 subnormal: a scale never rounds to 0


def _infer_quantize(inputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> dict[str, TensorSpec]:
    w = inputs["w"]
    require_dtype(w, ("float16", "bfloat16", "float32"), "w")
    require_ndim(w, "w", 2)
    gs = attrs["group_size"]
    if gs < 2 or gs % 2:
        raise KernelInputError(f"group_size must be even and >= 2, got {gs}", field="group_size")
    k, n = w.shape
    if k == 0 or k % gs or k % 2:
        raise KernelInputError(f"'w' has K={k} rows; K must be a positive multiple of group_size={gs} (and even)",
                               tensor="w", field="shape")
    return {"qweight": TensorSpec((k // 2, n), "uint8"), "scales": TensorSpec((k // gs, n), "float16"),
            "zeros": TensorSpec((k // gs, n), "float16")}


def _quantize(call: OpCall) -> dict[str, Any]:
    xp, dt = call.xp, call.in_specs["w"].dtype
    w = call.inputs["w"]
    k, n = w.shape
    gs = call.attrs["group_size"]
    f = to_float(xp, w, dt).reshape(k // gs, gs, n)
    lo = xp.minimum(f.min(axis=1), 0.0)
    hi = xp.maximum(f.max(axis=1), 0.0)
    scale = (hi - lo) / 15.0
    scale = xp.where(scale > 0, xp.maximum(scale, _FP16_TINY), 1.0)
    s16 = scale.astype(xp.float16)
    s = s16.astype(xp.float32)
    zero = xp.clip(xp.rint(-lo / s), 0, 15)
    q = xp.clip(xp.rint(f / s[:, None, :]) + zero[:, None, :], 0, 15).astype(xp.uint8).reshape(k, n)
    packed = q[0::2] | (q[1::2] << 4)
    outs = {"qweight": packed, "scales": s16, "zeros": zero.astype(xp.float16)}
    for p, a in outs.items():
        d = call.dest(p)
        if d is not None:
            xp.copyto(d, a)
            outs[p] = d
    return outs


QUANTIZE_INT4 = register_op(OpSpec(
    name="quantize_int4", code=15, inputs=("w",), outputs=("qweight", "scales", "zeros"),
    attrs={"group_size": AttrSpec("int", 128)}, infer=_infer_quantize, numpy=_quantize, cupy=_quantize,
    tolerances={},  # checked by the round-trip bound |w - dequant| <= scale/2 (+ float16 rounding)
    doc="w (K, N) float16/bfloat16/float32 -> qweight (K/2, N) uint8 (qweight[r,n] = q[2r,n] | q[2r+1,n]<<4, "
        "low nibble = even k), scales and zeros (K/group_size, N) float16; asymmetric per group of group_size "
        "(=128) rows along K; K % group_size == 0, group_size even. w ~= (q - zero) * scale.",
    example={"w": TensorSpec((256, 64), "float16")},
))


def dequantize_int4(xp: Any, qweight: Any, scales: Any, zeros: Any) -> Any:
    """float32 (K, N) weights from the packed format (the reference the kernel must match)."""
    k2, n = qweight.shape
    g = scales.shape[0]
    q = xp.empty((k2 * 2, n), dtype=xp.float32)
    q[0::2] = qweight & 0xF
    q[1::2] = qweight >> 4
    q = q.reshape(g, (2 * k2) // g, n)
    q -= zeros.astype(xp.float32)[:, None, :]
    q *= scales.astype(xp.float32)[:, None, :]
    return q.reshape(2 * k2, n)


def _infer_w4a16(inputs: Mapping[str, TensorSpec], attrs: Mapping[str, Any]) -> dict[str, TensorSpec]:
    x, qw, sc, zr = inputs["x"], inputs["qweight"], inputs["scales"], inputs["zeros"]
    require_dtype(x, ("float16", "bfloat16"), "x")
    require_ndim(x, "x", 2)
    require_dtype(qw, ("uint8",), "qweight")
    require_ndim(qw, "qweight", 2)
    require_dtype(sc, ("float16",), "scales")
    require_dtype(zr, ("float16",), "zeros")
    m, k = x.shape
    k2, n = qw.shape
    if m < 1:
        raise KernelInputError("'x' has no rows", tensor="x", field="shape")
    if k != 2 * k2:
        raise KernelInputError(f"'qweight' has shape {qw.shape}; x has K={k}, so it needs ({k // 2}, N)", tensor="qweight", field="shape")
    require_ndim(sc, "scales", 2)
    g = sc.shape[0]
    if sc.shape[1] != n or g < 1 or k % g or (k // g) % 2:
        raise KernelInputError(f"'scales' has shape {sc.shape}; needs (K/group_size, {n}) with an even group_size dividing K={k}",
                               tensor="scales", field="shape")
    if zr.shape != sc.shape:
        raise KernelInputError(f"'zeros' has shape {zr.shape}, 'scales' has {sc.shape}; they must match", tensor="zeros", field="shape")
    return {"out": TensorSpec((m, n), x.dtype)}


def _w4a16_numpy(call: OpCall) -> dict[str, Any]:
    xp, dt = call.xp, call.in_specs["x"].dtype
    w = dequantize_int4(xp, call.inputs["qweight"], call.inputs["scales"], call.inputs["zeros"])
    f = xp.matmul(to_float(xp, call.inputs["x"], dt).astype(xp.float32, copy=False), w)
    return {"out": from_float(xp, f, dt, call.dest("out"))}


def _w4a16_cupy(call: OpCall) -> dict[str, Any]:
    import cupy

    from ._cuda import get_function, sm_count

    x, qw, sc, zr = (call.inputs[p] for p in ("x", "qweight", "scales", "zeros"))
    dt = call.in_specs["x"].dtype
    m, k = x.shape
    n = qw.shape[1]
    gs = k // sc.shape[0]
    arrays = (x, qw, sc, zr)
    fast = (n % 16 == 0 and k % 16 == 0 and gs % 16 == 0 and m < 2**20
            and all(a.flags.c_contiguous and a.data.ptr % 16 == 0 for a in arrays))
    if not fast:
        return _w4a16_numpy(call)
    mma = w4a16_choice(m, k, n, gs)
    if mma is not None:
        return {"out": _w4a16_mma(call, m, k, n, gs, mma)}
    if dt == "float16" and m >= _dequant_min_m():
        # CUDA-core dequant-in-registers loses to tensor cores once M grows: materialize float16
        # weights with one kernel (reads packed, writes K*N*2 bytes) and let cuBLAS (fp32 compute) run.
        w16 = cupy.empty((k, n), dtype=cupy.float16)
        threads = (k // 2) * (n // 16)
        dq = get_function("gemm_w4a16.cu", _w4a16_names("F16"), "w4_dequant_f16<0>")
        dq((-(-threads // 256),), (256,), (qw, sc, zr, w16, np.int32(k), np.int32(n), np.int32(gs // 2)))
        d = call.dest("out")
        return {"out": cupy.matmul(x, w16, out=d if d is not None and d.flags.c_contiguous else None)}
    if dt == "float16" and m <= 4 and k // 2 <= 65535 * 256 and tuning().h2:
        return {"out": _w4a16_h2(call, m, k, n, gs)}
    (grid_x, ksplit), rps, mb = w4a16_launch_config(m, k, n, sm_count())
    if ksplit > 65535:
        return _w4a16_numpy(call)
    out = call.dest("out")
    if out is None or not out.flags.c_contiguous:
        out = cupy.empty((m, n), dtype=x.dtype)
    partial = _partials(call, ksplit * m * n if ksplit > 1 else 1)  # no split: the kernel never reads it
    counters = _counters(call, grid_x)  # zeroed once; every launch leaves them zero again (one set per stream)
    kt = "F16" if dt == "float16" else "BF16"
    pf = "true" if mb == 1 and tuning().prefetch else "false"
    fn = get_function("gemm_w4a16.cu", _w4a16_names(kt), f"w4a16_gemm<{kt},{mb},{pf}>")
    fn((grid_x, ksplit), (256,), (x, qw, sc, zr, partial, counters, out,
                                  np.int32(m), np.int32(k), np.int32(n), np.int32(gs // 2), np.int32(rps)))
    return {"out": out}



# (m, k, n, gs, device facts, SMs, knobs) -> w4a16_choice's answer: the table walk is asked for on every launch
_CHOICES: dict[tuple[Any, ...], tuple[int, ...] | None] = {}


def w4a16_choice(m: int, k: int, n: int, gs: int) -> tuple[int, ...] | None:
    """The tensor-core configuration the op takes for this shape on the current device (None: another path)."""
    from ._cuda import sm_count

    optin, sm90a = _device_facts()
    key = (m, k, n, gs, optin, sm_count(), sm90a, tuning())
    if key not in _CHOICES:
        bounded_put(_CHOICES, key, _mma_cfg(m, k, n, gs, optin, key[5], sm90a), 4096)
    return _CHOICES[key]


def _partials(call: OpCall, n: int) -> Any:
    """A float32 buffer of at least ``n`` elements for split-K partials (or the unused pointer of a launch without a
    split)."""
    import cupy

    return _stream_buffer(call, "w4a16_partials", max(n, 1), cupy.float32, zeroed=False)


def _counters(call: OpCall, tiles: int) -> Any:
    """The split-K counters (zeroed once; every launch leaves them zero)."""
    import cupy

    return _stream_buffer(call, "w4a16_counters", max(tiles, 1024), cupy.uint32, zeroed=True)


def _stream_buffer(call: OpCall, key: str, n: int, dtype: Any, zeroed: bool) -> Any:
    """``call.workspace[key]``, this stream's buffer of at least ``n`` elements (launches on one stream run in order,
    so each may reuse it), made anew when shorter: with zeros if ``zeroed``, else uninitialized."""
    import cupy

    buf = call.workspace.get(key)
    if buf is None or buf.size < n:
        buf = call.workspace[key] = (cupy.zeros if zeroed else cupy.empty)(n, dtype=dtype)
    return buf


# function -> (the function, dynamic shared bytes opted in): per function object, not per name, since a module built
# again (another device, a rebuilt module) has functions of the same names without the attribute; the reference kept
# stops the id from being reused
_WK_SMEM_SET: dict[int, tuple[Any, int]] = {}
_DEVICE: dict[int, tuple[int, bool]] = {}  # device -> (opt-in shared memory per block, runs sm_90a code)


def _device_facts() -> tuple[int, bool]:
    """The current device's opt-in shared memory per block (227 KiB on sm_90; 48 KiB when not reported), and whether
    it runs sm_90a code (compute capability 9.0: wgmma); read once per device."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    if dev not in _DEVICE:
        props = cupy.cuda.runtime.getDeviceProperties(dev)
        optin = int(props.get("sharedMemPerBlockOptin") or (_WK_SMEM_MAX if props.get("major") == 9 else 48 * 1024))
        _DEVICE[dev] = optin, (props.get("major"), props.get("minor")) == (9, 0)
    return _DEVICE[dev]


def _sm90a() -> bool:
    """Whether the current device runs sm_90a code (wgmma)."""
    return _device_facts()[1]


def wk_launch(fn: Any, grid: tuple[int, int], wk: int, smem: int, args: tuple[Any, ...], pdl: bool = False) -> None:
    """Launch the tensor-core kernel ``fn`` (w4a16_wk and its kin, w4a16_wg) as ``wk`` warps per block with ``smem``
    bytes of dynamic shared memory (opted in once per function); ``pdl``: as a programmatic dependent launch
    (``_cuda.launch_dependent``; only for kernels that wait for the one before them: w4a16_wk, wkc, wkm, wg, wgc;
    a plain launch while the stream is being captured)."""
    import cupy

    from ._cuda import launch_dependent

    done = _WK_SMEM_SET.get(id(fn))
    if smem > 48 * 1024 and (done is None or done[0] is not fn or done[1] < smem):
        try:
            fn.max_dynamic_shared_size_bytes = smem
        except AttributeError:  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES on the function itself (a driver
            # Function of an sm_90a module has .ptr; a RawKernel without the property, .kernel.ptr)
            cupy.cuda.driver.funcSetAttribute(fn.ptr if hasattr(fn, "ptr") else fn.kernel.ptr, 8, smem)
        _WK_SMEM_SET[id(fn)] = (fn, smem)
    if not (pdl and launch_dependent(fn, grid, (32 * wk,), args, shared_mem=smem)):
        fn(grid, (32 * wk,), args, shared_mem=smem)


def pack_x(x: Any, m: int, k: int, mr: int, kt: str) -> Any:
    """x (m, k) packed by chunk for w4a16_wkm (``w4_xpack<mr>``): (m-blocks, K/64, mr, 72) in x's dtype, rows >= m zero,
    rows padded to 144 bytes (halves 64..71 not written), so that a chunk's rows are one contiguous block."""
    import cupy

    from ._cuda import get_function, sm_count

    xp = cupy.empty((-(-m // mr) * (k // 64) * mr * 72,), dtype=x.dtype)
    pieces = -(-m // mr) * (k // 64) * mr * 8  # 16-byte pieces of the rows (not the padding)
    pack = get_function("w4a16_mma.cu", _mma_names(kt), f"w4_xpack<{mr}>")
    pack((min(-(-pieces // 256), 4 * sm_count()),), (256,), (x, xp, np.int32(m), np.int32(k)))
    return xp


class _Launch(NamedTuple):
    """What a tensor-core launch of one shape needs besides its arrays (``_launch_of``)."""

    file: str
    names: tuple[str, ...]
    name: str
    arch: str | None
    grid: tuple[int, int]
    warps: int
    smem: int
    tail: tuple[Any, ...]  # the int32 arguments after the arrays: m, k, n, group rows, chunks per block
    partials: int  # float32 split-K partials (0: the kernel takes none, w4a16_wg)
    tiles: int  # split-K counters
    waits: bool  # the kernel waits for the one before it (griddepcontrol.wait): it may be a programmatic dependent launch


# (kt, m, k, n, gs, configuration, SMs) -> its _Launch: the geometry and names are asked for on every launch
_LAUNCHES: dict[tuple[Any, ...], _Launch] = {}


def _launch_of(kt: str, m: int, k: int, n: int, gs: int, cfg: tuple[int, ...], n_sm: int) -> _Launch:
    key = (kt, m, k, n, gs, cfg, n_sm)
    hit = _LAUNCHES.get(key)
    if hit is not None:
        return hit
    if _is_wg(cfg):
        grid, cpb, smem = w4a16_wg_launch(m, k, n, cfg)
        launch = _Launch("w4a16_mma.cu+w4a16_wg.cu", _wg_names(kt), _wg_name(kt, cfg), "sm_90a", grid, _wg_warps(cfg),
                         smem, _int32s(m, k, n, gs // 2, cpb), 0, 0, True)
    elif len(cfg) >= 6:
        (tiles, ksplit), cpb, smem = w4a16_wk_launch(m, k, n, n_sm, cfg)
        launch = _Launch("w4a16_mma.cu", _mma_names(kt), _wk_name(kt, cfg), None, (tiles, ksplit), cfg[2], smem,
                         _int32s(m, k, n, gs // 2, cpb), ksplit * m * n if ksplit > 1 and len(cfg) == 6 else 1, tiles, True)
    else:
        (tiles, ksplit), cpb = w4a16_mma_launch(m, k, n, n_sm, cfg)
        mt, nw, wp, _, st = cfg
        name = f"w4a16_mma<{kt},{mt},{nw},{wp}>" if st == 0 else f"w4a16_mma_async<{kt},{mt},{nw},{wp},{st}>"
        launch = _Launch("w4a16_mma.cu", _mma_names(kt), name, None, (tiles, ksplit), wp, 0,
                         _int32s(m, k, n, gs // 2, cpb), ksplit * m * n if ksplit > 1 else 1, tiles, False)
    if len(_LAUNCHES) >= 4096:
        _LAUNCHES.clear()
    _LAUNCHES[key] = launch
    return launch


def _int32s(*values: int) -> tuple[Any, ...]:
    return tuple(np.int32(v) for v in values)


def _w4a16_mma(call: OpCall, m: int, k: int, n: int, gs: int, cfg: tuple[int, ...]) -> Any:
    """One launch of a tensor-core kernel; split-K partials summed by the last block of a column tile."""
    import cupy

    from ._cuda import get_function, sm_count

    inputs = call.inputs
    x, qw, sc, zr = inputs["x"], inputs["qweight"], inputs["scales"], inputs["zeros"]
    kt = "F16" if call.in_specs["x"].dtype == "float16" else "BF16"
    out = call.dest("out")
    if out is None or not out.flags.c_contiguous or out.data.ptr % 16:
        out = cupy.empty((m, n), dtype=x.dtype)
    launch = _launch_of(kt, m, k, n, gs, cfg, sm_count())
    fn = get_function(launch.file, launch.names, launch.name, launch.arch)
    pdl = launch.waits and tuning().pdl and _sm90a()
    if not launch.partials:  # w4a16_wg / w4a16_wgc / w4a16_wgm
        wk_launch(fn, launch.grid, launch.warps, launch.smem, (x, qw, sc, zr, out, *launch.tail), pdl=pdl)
        return out
    if len(cfg) == 8:
        x = pack_x(x, m, k, 16 * cfg[0], kt)
    wk_launch(fn, launch.grid, launch.warps, launch.smem,
              (x, qw, sc, zr, _partials(call, launch.partials), _counters(call, launch.tiles), out, *launch.tail),
              pdl=pdl)
    return out


def _w4a16_h2(call: OpCall, m: int, k: int, n: int, gs: int) -> Any:
    """float16, M <= 4: one launch of w4a16_h2 (a block = 8*CT columns x 32*RT packed rows; K-split over blockIdx.y)."""
    import cupy

    from ._cuda import get_function

    x, qw, sc, zr = (call.inputs[p] for p in ("x", "qweight", "scales", "zeros"))
    cfg = _h2_cfg(m, gs // 2)
    _, ct, rt, _ = cfg
    grid = (-(-n // (8 * ct)), -(-(k // 2) // (32 * rt)))
    out = call.dest("out")
    if out is None or not out.flags.c_contiguous:
        out = cupy.empty((m, n), dtype=x.dtype)
    partial = _partials(call, grid[1] * m * n if grid[1] > 1 else 1)
    counters = _counters(call, grid[0])
    fn = get_function("gemm_w4a16.cu", _w4a16_names("F16"), _h2_name(cfg))
    fn(grid, (256,), (x, qw, sc, zr, partial, counters, out, np.int32(m), np.int32(k), np.int32(n), np.int32(gs // 2)))
    return out


GEMM_W4A16 = register_op(OpSpec(
    name="gemm_w4a16", code=16, inputs=("x", "qweight", "scales", "zeros"), outputs=("out",), attrs={},
    infer=_infer_w4a16, numpy=_w4a16_numpy, cupy=_w4a16_cupy,
    tolerances={"float16": TOL_MATMUL["float16"], "bfloat16": TOL_MATMUL["bfloat16"]},
    doc="x (M, K) float16/bfloat16, qweight (K/2, N) uint8, scales/zeros (K/gs, N) float16 as made by "
        "quantize_int4 -> out (M, N) in x's dtype = x @ ((q - zeros) * scales), float32 accumulation. "
        "CuPy: M = 1..64 on tensor cores (mma.sync, weights dequantized in registers and rounded once to x's "
        "dtype, cp.async pipeline; float16 at M 17..64: (q - z) * s / 16 rounded once after -z * s / 16 was, the "
        "sums of columns with a scale of 0.5 or more redone in float32) when K % 64 == 0, group_size % 64 == 0 and "
        "N % 64 == 0 (128 for M = 1, 32 for M > 16); other shapes with N, K, group_size % 16 == 0 and M <= 4 or bfloat16: one CUDA-core kernel dequantizing in "
        "registers with float32 math (SHMRPC_W4A16_H2=1 opts in to a faster float16 M <= 4 kernel that sums "
        "float16x2 products in float16 over 16 k before float32: less precise, and it overflows for |x| above "
        "~8000); float16 M >= 5 otherwise: a dequantize kernel then cuBLAS; other shapes: array code.",
    example={"x": TensorSpec((1, 256), "float16"), "qweight": TensorSpec((128, 128), "uint8"),
             "scales": TensorSpec((2, 128), "float16"), "zeros": TensorSpec((2, 128), "float16")},
))
