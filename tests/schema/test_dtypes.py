"""Wire names of NumPy dtypes: every wire dtype round-trips, the rest is refused, the name cache changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from shmrpc.schema import dtypes
from shmrpc.schema.dtypes import DTYPE_CODES


@pytest.mark.parametrize("name", sorted(DTYPE_CODES))
def test_every_wire_dtype_round_trips(name: str) -> None:
    dt = dtypes.numpy_dtype(name)
    for _ in range(2):  # the second answer comes from the cache
        got = dtypes.name_of_numpy(dt)
        assert got == name or (name == "bfloat16" and got == "uint16" and dt == np.dtype(np.uint16))


@pytest.mark.parametrize("spec", ["<f4", np.float32, "float32", np.dtype("f4")])
def test_spellings_of_one_dtype(spec: object) -> None:
    assert dtypes.name_of_numpy(spec) == "float32"  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", [">f4", ">i8", "complex64", "O", "U4", [("a", "f4")]])
def test_dtypes_that_cannot_travel(spec: object) -> None:
    dtypes.name_of_numpy("<f4")  # a cached little-endian float32 must not make big-endian pass
    for _ in range(2):
        with pytest.raises(KeyError):
            dtypes.name_of_numpy(spec)  # type: ignore[arg-type]
