"""Probe: how fast the device streams gemm_w4a16's weight tiles from memory, by layout and by how many tiles.

A block reads one column tile of a (K/2, N) uint8 weight (``--tile`` bytes of each packed row, 16-byte loads, sixteen in
flight per thread, as the w4a16 kernels read it: rows N bytes apart), or the same bytes laid out tile after tile (each
tile one contiguous run): the layout question of the M = 1 rows. One block per tile, so N / tile blocks run at once
(112 at N = 14336, 128 at 16384). Each case is timed as the median of batches (``gpu_kernels._timer``) over weight
copies that together pass the L2 three times. Prints a table and writes JSON (date, commit from SHMRPC_COMMIT,
device, command) to ``--out``.

    python3 bench/gpu/stride_probe.py --out bench/results/stride-probe-DATE-COMMIT.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_kernels import _timer, probe_record, write_json  # noqa: E402

_SRC = r"""
__device__ __forceinline__ uint4 ld_nc4(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// Block b sums the bytes of its tile: `rows` rows of `tile` bytes, row r at w + r * stride + b * tile_off
// (strided: stride = N, tile_off = tile; contiguous: stride = tile, tile_off = rows * tile).
extern "C" __global__ void __launch_bounds__(256) rd_tile(const uint4* __restrict__ w, int rows, long long stride,
                                                          long long tile_off, int tile, unsigned* out) {
  const int per_row = tile / 16, total = rows * per_row;
  const unsigned char* base = reinterpret_cast<const unsigned char*>(w) + blockIdx.x * tile_off;
  unsigned acc = 0;
  for (int i0 = threadIdx.x; i0 < total; i0 += 16 * blockDim.x) {
    uint4 v[16];
#pragma unroll
    for (int u = 0; u < 16; ++u) {
      int i = i0 + u * blockDim.x;
      if (i < total) v[u] = ld_nc4(reinterpret_cast<const uint4*>(base + (long long)(i / per_row) * stride) + i % per_row);
      else v[u] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 16; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) out[blockIdx.x] = acc;  // never true for the data used; keeps the loads
}
"""

# (K, N) of the weight; tile bytes per row
CASES = [(4096, 14336), (4096, 14208), (4096, 14464), (4096, 16384), (4096, 16896), (4096, 12288), (8192, 8192),
         (8192, 14336)]


def _time_tiles(cp: Any, fn: Any, ws: list[Any], out: Any, tiles: int, rows: int, stride: int, tile_off: int,
                tile: int, reps: int) -> float:
    """GPU seconds per launch of ``rd_tile`` over ``tiles`` blocks, the weight copies ``ws`` taken in turn."""
    it = iter(range(10**9))

    def launch() -> Any:
        w = ws[next(it) % len(ws)]
        fn((tiles,), (256,), (w, cp.int32(rows), cp.int64(stride), cp.int64(tile_off), cp.int32(tile), out))
        return out

    launch()
    return float(_timer(cp, launch, reps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tile", type=int, default=128, help="bytes of a packed row per tile (128: NWORD 4)")
    args = ap.parse_args(argv)
    import cupy as cp

    from shmrpc.kernels._cuda import sm_count

    n_sm = sm_count()
    res: dict[str, Any] = {**probe_record(cp, "bench/gpu/stride_probe.py", argv, n_sm), "mode": "stride-probe",
                           "tile": args.tile, "rows": []}
    fn = cp.RawModule(code=_SRC, options=("-std=c++17",)).get_function("rd_tile")
    out = cp.zeros(1 << 16, dtype=cp.uint32)
    print(f"{'K x N':>14} {'tiles':>6} {'layout':>10} {'us':>8} {'GB/s':>8}")
    for k, n in CASES:
        rows, tiles = k // 2, n // args.tile
        nbytes = rows * n
        copies = max(2, -(-3 * (60 << 20) // nbytes))
        ws = [cp.random.randint(0, 256, nbytes, dtype=cp.uint8) for _ in range(copies)]
        for layout, stride, tile_off in (("strided", n, args.tile), ("contiguous", args.tile, rows * args.tile)):
            s = _time_tiles(cp, fn, ws, out, tiles, rows, stride, tile_off, args.tile, args.reps)
            row = {"K": k, "N": n, "tiles": tiles, "layout": layout, "seconds": s, "GBps": nbytes / s / 1e9}
            res["rows"].append(row)
            print(f"{k:>6} x {n:<6} {tiles:>6} {layout:>10} {s * 1e6:8.2f} {nbytes / s / 1e9:8.0f}", flush=True)
        ws.clear()
        cp.get_default_memory_pool().free_all_blocks()
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
