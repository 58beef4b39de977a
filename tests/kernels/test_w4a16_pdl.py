"""gemm_w4a16's tensor-core kernels (w4a16_wk, wkc, wkm, wg, wgc) launched as programmatic dependent launches (the
default; ``SHMRPC_W4A16_PDL=0`` turns them off): the driver's launch structures as cuda.h lays them out, a driver
without the call; on the GPU (sm_90), the same bits as plain launches, and a kernel that may start before the one
ahead of it finishes still reads that kernel's output (a writer that lets it launch at once, and two calls chained).
The GPU tests skip with the reason where there is no CuPy/GPU or no sm_90."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
from support.w4a16 import case, check, run

from shmrpc.kernels._cuda import _LaunchAttr, _LaunchConfig, source
from shmrpc.kernels._w4a16_config import W4A16Tuning


def test_the_launch_structures_are_laid_out_as_cuda_h_says() -> None:
    # CUlaunchAttribute: a 4-byte id, its value union (64 bytes) at offset 8; CUlaunchConfig: 7 unsigned ints, then
    # the stream, the attributes and their count, 8-byte aligned
    assert ctypes.sizeof(_LaunchAttr) == 72 and _LaunchAttr.value.offset == 8
    assert [getattr(_LaunchConfig, f).offset for f in ("shared_mem", "stream", "attrs", "n_attrs")] == [24, 32, 40, 48]
    assert ctypes.sizeof(_LaunchConfig) == 56


def test_dependent_launches_are_the_default_and_can_be_turned_off() -> None:
    assert W4A16Tuning.from_env({}).pdl is True and W4A16Tuning().pdl is True
    assert W4A16Tuning.from_env({"SHMRPC_W4A16_PDL": "0"}).pdl is False


def test_a_driver_without_the_extended_launch_gets_plain_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    # no cuLaunchKernelEx in the driver (before CUDA 12): the dependent launch declines, wk_launch launches plainly
    import sys
    import types

    from shmrpc.kernels import _cuda, quant

    stream = types.SimpleNamespace(ptr=0)
    fake = types.ModuleType("cupy")
    fake.ndarray = type("ndarray", (), {})  # type: ignore[attr-defined]
    fake.cuda = types.SimpleNamespace(get_current_stream=lambda: stream,  # type: ignore[attr-defined]
                                      runtime=types.SimpleNamespace(streamIsCapturing=lambda ptr: False))
    monkeypatch.setitem(sys.modules, "cupy", fake)

    def no_driver(name: str) -> Any:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    monkeypatch.setattr(_cuda, "_launch_ex", [])
    launched = []

    def kernel(grid: Any, block: Any, args: Any, shared_mem: int = 0) -> None:
        launched.append((grid, block, shared_mem))

    kernel.ptr = 1  # type: ignore[attr-defined]
    assert _cuda.launch_dependent(kernel, (2, 1), (256,), (np.int32(3),)) is False
    quant.wk_launch(kernel, (2, 1), 8, 1024, (np.int32(3),), pdl=True)
    assert launched == [((2, 1), (256,), 1024)]


@pytest.fixture
def sm90(cp: Any) -> Any:
    from shmrpc.kernels.quant import _sm90a

    if not _sm90a():
        pytest.skip("programmatic dependent launch needs an sm_90 device")
    return cp


def _tuning(monkeypatch: Any, cfg: str, pdl: bool) -> None:
    from shmrpc.kernels import _w4a16_config

    monkeypatch.setattr(_w4a16_config, "_TUNING", W4A16Tuning.from_env(
        {"SHMRPC_W4A16_MMA_M1": "1", "SHMRPC_W4A16_MMA_CFG": cfg, "SHMRPC_W4A16_PDL": "1" if pdl else "0"}))


@pytest.mark.gpu
@pytest.mark.parametrize(("cfg", "m", "k"), [("0,4,12,0,3,1,2", 1, 2048), ("0,4,8,1,3,1", 3, 2048),
                                             ("-2,4,8,0,3,1,2", 16, 2048), ("-2,4,8,2,3,1", 12, 2048),
                                             ("2,4,8,0,3,1,2", 32, 2048), ("1,2,8,2,3,0", 13, 2048),
                                             ("4,2,8,0,2,1,1,2", 40, 2048), ("4,2,4,1,2,1", 13, 2048),
                                             ("4,1,4,2", 64, 1024), ("4,2,4,4", 40, 1024), ("0,4,4,8", 5, 1024)])
def test_a_dependent_launch_gives_the_bits_of_a_plain_one(gpu, sm90, monkeypatch, cfg, m, k) -> None:
    from shmrpc.kernels._w4a16_config import _mma_cfg

    ins, want = case(m, k, 512, 64, "float16")
    got = []
    for pdl in (False, True):
        _tuning(monkeypatch, cfg, pdl)
        assert _mma_cfg(m, k, 512, 64, wg=True) == tuple(int(v) for v in cfg.split(","))
        got.append(run(gpu, ins, "float16"))
        check(got[-1], want, "float16")
    assert got[0].tobytes() == got[1].tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize(("cfg", "m"), [("0,4,12,0,3,1,2", 1), ("-2,4,8,2,3,1", 16), ("4,2,8,0,2,1,1,2", 40),
                                        ("4,1,4,2", 64)])
def test_a_dependent_launch_waits_for_the_kernel_before_it(sm90, monkeypatch, cfg, m) -> None:
    cp = sm90
    from shmrpc.kernels import REGISTRY, TensorSpec
    from shmrpc.kernels._registry import OpCall
    from shmrpc.kernels._w4a16_config import _mma_cfg
    from shmrpc.kernels.quant import dequantize_int4

    k = n = 2048
    ins, _ = case(m, k, n, 64, "float16")
    w = dequantize_int4(np, ins["q"], ins["s"], ins["z"]).astype(np.float64)
    specs = {"x": TensorSpec((m, k), "float16"), "qweight": TensorSpec((k // 2, n), "uint8"),
             "scales": TensorSpec((k // 64, n), "float16"), "zeros": TensorSpec((k // 64, n), "float16")}
    op = REGISTRY["gemm_w4a16"].cupy
    write_late = cp.RawKernel(source("pdl_check.cu"), "write_late", options=("-std=c++17",))
    with cp.cuda.Stream(non_blocking=True) as stream:
        q, s, z = (cp.asarray(ins[v]) for v in "qsz")
        x = cp.zeros((m, k), dtype=cp.float16)

        def call(x: Any) -> Any:
            return op(OpCall(cp, {"x": x, "qweight": q, "scales": s, "zeros": z}, specs,
                             {"out": TensorSpec((m, n), "float16")}, {}, {}, {}))["out"]

        _tuning(monkeypatch, cfg, True)
        assert _mma_cfg(m, k, n, 64, wg=True) == tuple(int(v) for v in cfg.split(","))
        for v in (0.25, -0.5, 0.125, -0.25):  # x written by the kernel before, late: the answer is that of the new x
            write_late((8,), (256,), (x, np.int64(m * k), np.float16(v).view(np.uint16), np.int64(200_000)))
            got = cp.asnumpy(call(x)).astype(np.float64)
            want = np.broadcast_to(v * w.sum(axis=0), (m, n))
            check(got, want, "float16")
        xr = cp.asarray(ins["x"])
        chained = []
        for pdl in (False, True):  # two calls chained: the second's x is the first's output
            _tuning(monkeypatch, cfg, pdl)
            chained.append(cp.asnumpy(call(call(xr))))
        stream.synchronize()
    assert chained[0].tobytes() == chained[1].tobytes()
    check(chained[1], (ins["x"].astype(np.float64) @ w).astype(np.float16).astype(np.float64) @ w, "float16")
