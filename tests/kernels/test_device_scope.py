"""``kernels._cuda.DeviceScope``: the CuPy backend's device context, against a counting fake runtime (no GPU).

It must leave every thread on the device it found, as ``cupy.cuda.Device`` does, and call cudaSetDevice
only where the device changes (CuPy's ``Device.__exit__`` calls it every time).
"""

from __future__ import annotations

import threading

import pytest

from shmrpc.kernels._cuda import DeviceScope


class FakeRuntime:
    """A per-thread current device (as CUDA's is), counting setDevice calls."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.sets: list[int] = []

    def getDevice(self) -> int:  # noqa: N802 - CuPy's name
        return getattr(self._local, "dev", 0)

    def setDevice(self, dev: int) -> None:  # noqa: N802
        self.sets.append(dev)
        self._local.dev = dev


def test_same_device_calls_no_set_device() -> None:
    rt = FakeRuntime()
    scope = DeviceScope(0, rt)
    for _ in range(100):
        with scope:
            assert rt.getDevice() == 0
    assert rt.sets == []


def test_other_device_is_entered_and_left() -> None:
    rt = FakeRuntime()
    scope = DeviceScope(1, rt)
    with scope:
        assert rt.getDevice() == 1
        with scope:  # re-entered: nothing to change
            assert rt.getDevice() == 1
        assert rt.getDevice() == 1
    assert rt.getDevice() == 0
    assert rt.sets == [1, 0]


def test_restores_after_an_exception() -> None:
    rt = FakeRuntime()
    with pytest.raises(RuntimeError, match="boom"):
        with DeviceScope(2, rt):
            raise RuntimeError("boom")
    assert rt.getDevice() == 0


def test_a_block_that_leaves_another_device_set_is_undone() -> None:
    rt = FakeRuntime()
    with DeviceScope(0, rt):
        rt.setDevice(3)  # e.g. a library call that switched and did not switch back
    assert rt.getDevice() == 0


def test_each_thread_restores_its_own_device() -> None:
    rt = FakeRuntime()
    scope = DeviceScope(1, rt)
    inside, release = threading.Event(), threading.Event()
    seen: list[int] = []

    def other() -> None:
        rt.setDevice(2)
        with scope:
            inside.set()
            release.wait(5)
            seen.append(rt.getDevice())
        seen.append(rt.getDevice())

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(5)
    with scope:  # this thread enters while the other is inside: separate stacks
        assert rt.getDevice() == 1
    assert rt.getDevice() == 0
    release.set()
    t.join(5)
    assert seen == [1, 2]
