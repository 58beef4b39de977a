"""Nsight Compute's sampled warp stalls of one kernel, summed by part of the kernel: prologue, chunk loop, the loop's end
up to the first cluster barrier, the sums between the two cluster barriers, the second barrier and the rest.

    python3 bench/gpu/ncu_parts.py bench/results/ncu-src-m64-sass-2026-12-03-aa80992.csv

Reads the CSV of ``ncu -i REPORT --page source --csv --print-source sass`` (``bash bench/gpu/run.sh ncusrc``). The chunk
loop is the backward branch right after the last HGMMA (or HMMA), from its target to it (its first part up to the
``LDGDEPBAR`` that commits the next chunk's copies: the chunk's barrier and the copies' issue); the cluster barriers are
the ``UCGABAR_WAIT`` instructions after it, the second one's part starting at its fence (``MEMBAR``) or arrival. Prints
each part's share of all samples, and the share of each barrier's wait alone.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys


def parts(path: str) -> dict[str, float]:
    """Part name -> its share of the samples (and ``"... wait"`` entries: the barriers' waits alone)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    hdr = next(r for r in rows if "Address" in r and "Source" in r)
    data = [r for r in rows[rows.index(hdr) + 1:] if len(r) == len(hdr)]
    ia, isrc, iall = hdr.index("Address"), hdr.index("Source"), hdr.index("Warp Stall Sampling (All Samples)")
    addr = [int(r[ia], 16) for r in data]
    src = [r[isrc] for r in data]
    samples = [float(r[iall] or 0) for r in data]
    total = sum(samples) or 1.0
    last_mma = max(i for i, s in enumerate(src) if "HGMMA" in s or "HMMA" in s)
    end = next(i for i in range(last_mma, len(src)) if re.search(r"BRA 0x[0-9a-f]+", src[i])
               and int(re.search(r"BRA (0x[0-9a-f]+)", src[i]).group(1), 16) < addr[i])  # type: ignore[union-attr]
    head = addr.index(int(re.search(r"BRA (0x[0-9a-f]+)", src[end]).group(1), 16))  # type: ignore[union-attr]
    waits = [i for i in range(end, len(src)) if "UCGABAR_WAIT" in src[i]]
    share = lambda a, b: sum(samples[a:b]) / total  # noqa: E731
    commit = next((i for i in range(head, end) if "LDGDEPBAR" in src[i]), head)  # the chunk's copies committed
    out = {"prologue": share(0, head), "chunk loop": share(head, end + 1),
           "of it the chunk's barrier and the copies' issue": share(head, commit + 1)}
    if len(waits) >= 2:
        arv = max(i for i in range(waits[0] + 1, waits[1]) if "UCGABAR_ARV" in src[i])
        start2 = next((i for i in range(waits[0] + 1, arv + 1) if "MEMBAR" in src[i] and i > arv - 5), arv)
        out.update({"loop's end to the first cluster barrier": share(end + 1, waits[0] + 1),
                    "first barrier's wait": share(waits[0], waits[0] + 1),
                    "sums between the barriers": share(waits[0] + 1, start2),
                    "second cluster barrier and after": share(start2, len(src)),
                    "second barrier's fence and arrival": share(start2, arv + 1),
                    "second barrier's wait": share(waits[1], waits[1] + 1)})
    else:
        out["after the loop"] = share(end + 1, len(src))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+")
    args = ap.parse_args(argv)
    for path in args.csv:
        print(path)
        for name, v in parts(path).items():
            print(f"  {name:<48} {100 * v:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
