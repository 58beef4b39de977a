"""Inputs from other libraries: DLPack producers, array-likes in a Pipeline, PyTorch tensors (CPU,
bfloat16, requires_grad) where PyTorch is installed; outputs as PyTorch views without a copy."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest

from shmrpc.client import Client, InvalidRequestError, Pipeline

if TYPE_CHECKING:
    from conftest import WorkerProc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


class DLPackOnly:
    """A tensor that offers nothing but DLPack (no ``__array__``, no buffer): NumPy's own DLPack export."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, **kw: Any) -> Any:
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


class DLPackNoDevice:
    """An older producer: ``__dlpack__`` alone, without keyword arguments or ``__dlpack_device__``."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self) -> Any:
        return self._a.__dlpack__()


class FakeGPU:
    """Claims to live on CUDA device 0."""

    def __dlpack__(self, **kw: Any) -> Any:
        raise AssertionError("must not be exported without CuPy or PyTorch")

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


@pytest.fixture
def client(worker: WorkerProc) -> Iterator[Client]:
    with Client(worker.name, timeout_s=10) as c:
        yield c


def test_dlpack_only_inputs(client: Client) -> None:
    x, y = np.arange(6, dtype=np.float32).reshape(2, 3), np.full((2, 3), 0.5, np.float32)
    out = client.call("vector_add", x=DLPackOnly(x), y=DLPackNoDevice(y))["out"]
    np.testing.assert_array_equal(out, x + y)
    client.put("w", DLPackOnly(x))
    assert client.resident()["w"] == ((2, 3), np.dtype(np.float32))


def test_array_likes_in_a_pipeline_and_numpy_scalar_attrs(client: Client) -> None:
    p = Pipeline().then("scale", a=2.0).then("vector_add", inputs={"x": "0.out", "y": "y"})
    out = client.call(p, x=[1.0, 2.0, 3.0], y=memoryview(np.ones(3)))["1.out"]
    np.testing.assert_array_equal(out, [3.0, 5.0, 7.0])
    np.testing.assert_array_equal(client.call("scale", x=(1.0, 2.0), a=np.float64(3.0))["out"], [3.0, 6.0])


def test_gpu_input_without_a_gpu_library_is_a_clear_error(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy / import torch raise ImportError
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(InvalidRequestError) as e:
        client.call("echo", x=FakeGPU())
    assert e.value.field == "device" and e.value.tensor == "x" and "CuPy or PyTorch" in str(e.value)


def test_bfloat16_by_wire_name(client: Client) -> None:
    bits = np.array([0x3F80, 0x4000, 0xC040], np.uint16)  # 1.0, 2.0, -3.0 in bfloat16
    with client.loan(4096) as req:
        req.array("x", 3, "bfloat16").view(np.uint16)[...] = bits  # bits, also where ml_dtypes makes a bfloat16 view
        out = req.send("scale", a=2.0)["out"]
        np.testing.assert_array_equal(out.view(np.uint16), [0x4000, 0x4080, 0xC0C0])  # 2.0, 4.0, -6.0


def test_ml_dtypes_bfloat16_arrays_through_call(client: Client) -> None:
    # an ml_dtypes bfloat16 array has no buffer format: call() copies it in through a bfloat16 view of the slot
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed (pip install ml-dtypes to run this)")
    x = np.array([1.0, 2.0, -3.0], ml_dtypes.bfloat16)
    for _ in range(2):  # the first call makes the signature's plan, the second takes the steady path
        out = client.call("scale", x=x, a=2.0)["out"]
        np.testing.assert_array_equal(out.view(np.uint16), [0x4000, 0x4080, 0xC0C0])  # 2.0, 4.0, -6.0


# ------------------------------------------------------------------ PyTorch (skipped where absent)


@pytest.fixture
def torch() -> Any:
    return pytest.importorskip("torch", reason="PyTorch is not installed (pip install torch to run these)")


def test_torch_cpu_requires_grad_and_bfloat16(client: Client, torch: Any) -> None:
    t = torch.arange(4, dtype=torch.float32, requires_grad=True)
    np.testing.assert_array_equal(client.call("scale", x=t, a=2.0)["out"], [0.0, 2.0, 4.0, 6.0])
    assert t.grad is None and t.requires_grad  # detached copy travelled; the caller's tensor is untouched
    b = torch.tensor([1.0, 2.0, -3.0], dtype=torch.bfloat16)
    out = client.call("scale", x=b, a=2.0)["out"]
    back = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    assert torch.equal(back, b * 2)
    nc = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # not contiguous
    np.testing.assert_array_equal(client.call("echo", x=nc)["out"], nc.numpy())


def test_torch_view_of_an_output_without_a_copy(client: Client, torch: Any) -> None:
    out = client.call("scale", x=np.ones(8, np.float32), a=3.0, copy=False)["out"]
    t = torch.from_numpy(out)  # shares the slot's memory; holding it keeps the slot reserved
    assert t.data_ptr() == out.ctypes.data
    assert torch.equal(t, torch.full((8,), 3.0))
    d = torch.from_dlpack(out)
    assert d.data_ptr() == out.ctypes.data


# ------------------------------------------------------------------ GPU arrays (the GPU machine only)


def _cupy() -> Any:
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception as e:  # noqa: BLE001 - any failure means no usable GPU here
        pytest.skip(f"no CuPy/GPU here ({type(e).__name__})")


class CudaInterfaceOnly:
    """A device array known only by ``__cuda_array_interface__`` (as Numba's are)."""

    def __init__(self, a: Any) -> None:
        self._a = a
        self.__cuda_array_interface__ = a.__cuda_array_interface__


@pytest.mark.gpu
def test_gpu_arrays_are_copied_device_to_slot(client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    cp = _cupy()
    x = cp.arange(1024, dtype=cp.float32).reshape(32, 32)
    y = cp.ones((32, 32), dtype=cp.float32)
    calls = []
    real_get = cp.ndarray.get

    def spy(self: Any, *args: Any, **kw: Any) -> Any:
        calls.append(kw.get("out") is not None)
        return real_get(self, *args, **kw)

    monkeypatch.setattr(cp.ndarray, "get", spy)
    out = client.call("vector_add", x=x, y=CudaInterfaceOnly(y))["out"]
    assert calls == [True, True]  # each input: one get(out=slot view), no intermediate host array
    np.testing.assert_array_equal(out, cp.asnumpy(x + y))
    t = x[:, ::2]  # not contiguous on the device
    np.testing.assert_array_equal(client.call("echo", x=t)["out"], cp.asnumpy(t))
    client.put("gw", x)
    assert client.resident()["gw"] == ((32, 32), np.dtype(np.float32))


@pytest.mark.gpu
def test_torch_cuda_tensors_are_copied_device_to_slot(client: Client, torch: Any) -> None:
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")
    x = torch.arange(64, dtype=torch.float32, device="cuda", requires_grad=True)
    np.testing.assert_array_equal(client.call("scale", x=x, a=2.0)["out"], 2 * np.arange(64, dtype=np.float32))
    b = torch.tensor([1.0, 2.0, -3.0], dtype=torch.bfloat16, device="cuda")
    out = client.call("scale", x=b, a=2.0)["out"]
    assert torch.equal(torch.from_numpy(out.view(np.int16)).view(torch.bfloat16), (b * 2).cpu())
    t = torch.arange(12, dtype=torch.float64, device="cuda").reshape(3, 4).t()
    np.testing.assert_array_equal(client.call("echo", x=t)["out"], t.cpu().numpy())
