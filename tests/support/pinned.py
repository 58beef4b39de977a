"""Host memory for the CuPy backend's GPU tests: page-locked (or pageable) memory handing out views, with a
check that nothing was written outside them."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Pinned"]


class Pinned:
    """Page-locked (or, with ``pinned=False``, pageable) host memory handing out views one after another: each
    ``shift`` bytes past where the last one left off, which is its size rounded up to ``align`` bytes plus
    ``gap`` bytes (the defaults: 4 KiB-aligned views, as the worker's slots are); every byte not handed out
    keeps 0xAB.

    Example: ``host = Pinned(cp); x = host.view((16, 64), "float16"); ...; assert host.untouched()``.
    """

    def __init__(self, cp: Any, nbytes: int = 4 << 20, *, align: int = 4096, gap: int = 0, pinned: bool = True) -> None:
        self.mem = cp.cuda.alloc_pinned_memory(nbytes) if pinned else bytearray(nbytes)
        self.raw = np.frombuffer(self.mem, np.uint8, nbytes)
        self.raw[:] = 0xAB
        self.align, self.gap = align, gap
        self.off = 0
        self.used: list[tuple[int, int]] = []

    def view(self, shape: tuple[int, ...], dtype: Any, shift: int = 0) -> np.ndarray:
        """A view of ``shape`` (bfloat16: its uint16 storage) ``shift`` bytes past the next free offset."""
        dt = np.dtype(np.uint16 if dtype == "bfloat16" else dtype)
        n = int(np.prod(shape))
        off = self.off + shift
        v = np.frombuffer(self.mem, dt, n, off).reshape(shape)
        self.used.append((off, off + v.nbytes))
        self.off = off + -(-v.nbytes // self.align) * self.align + self.gap
        return v

    def untouched(self) -> bool:
        """Whether every byte outside the views handed out still holds 0xAB."""
        mask = np.ones(self.raw.size, bool)
        for a, b in self.used:
            mask[a:b] = False
        return bool((self.raw[mask] == 0xAB).all())
