"""Fixtures of the CuPy backend's tests: skipped with the reason where there is no CuPy or no GPU."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from shmrpc.kernels import select_backend


@pytest.fixture
def cp() -> Any:
    """The ``cupy`` module, where it imports and sees a device."""
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as e:
        pytest.skip(f"no CuPy/GPU: {type(e).__name__}: {e}")
    return cupy


@pytest.fixture
def gpu(cp: Any) -> Iterator[Any]:
    """A CuPy backend of its own, closed after the test."""
    with select_backend("cupy") as be:
        yield be
