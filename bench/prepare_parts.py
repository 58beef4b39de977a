"""What the worker does for a new call signature, part by part, in one process (no sockets, no client).

    python bench/prepare_parts.py --out bench/results/prepare-parts-DATE-COMMIT.json

A new signature (docs/client.md, "The steady path") is checked in full by the worker: its descriptor decoded,
then ``Dispatcher.prepare``'s checks, the op's shape rule and plan, the cost estimate, the outputs placed, the
response's bytes; then the NumPy views of the slot made and the run bound to them. The case is the one
``bench/new_signature.py`` times end to end: ``scale`` of 16 float32 with a new ``a`` every call. Each part is
timed over ``--n`` descriptors that differ only in ``a`` (so no cache of the worker answers for a whole
request), the best of ``--rounds`` runs, µs per call, with the garbage collector off while timing. ``whole``
is what the worker's loop calls (``prepare``, ``views``, ``bind``) from the descriptor's bytes to the bound run.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

from shmrpc import kernels
from shmrpc.schema.descriptor import (
    RequestDesc,
    ResponseDesc,
    StepDesc,
    TensorRef,
    decode_request,
    encode_request,
    encode_response,
)
from shmrpc.server._dispatch import Dispatcher

SLOT_NBYTES, DESC_NBYTES = 64 << 10, 4096


def _request(a: float) -> RequestDesc:
    return RequestDesc(steps=(StepDesc("scale", 0, (("x", "x"),), (("out", "out"),), (("a", a), ("b", 0.0))),),
                       inputs=(TensorRef("x", "float32", (16,), DESC_NBYTES, 64),), outputs=("out",))


def _timed(fn: Callable[[Any], Any], items: list[Any]) -> float:
    gc.collect()
    gc.disable()
    try:
        t = time.perf_counter()
        for it in items:
            fn(it)
        return (time.perf_counter() - t) / len(items) * 1e6
    finally:
        gc.enable()


def _parts(be: kernels.Backend, values: list[float]) -> dict[str, tuple[Callable[[Any], Any], list[Any]]]:
    """Each part's function and the items it is timed over, for requests of these values of ``a``."""
    slot = memoryview(bytearray(SLOT_NBYTES))
    spec = {"x": kernels.TensorSpec((16,), "float32")}
    payloads = [encode_request(_request(a)) for a in values]
    descs = [decode_request(p) for p in payloads]
    d, again, fresh = Dispatcher(be, DESC_NBYTES), Dispatcher(be, DESC_NBYTES), Dispatcher(be, DESC_NBYTES)
    steps = [d._steps(x) for x in descs]
    preps = [d._prepare(x, 0, 0, SLOT_NBYTES, 1) for x in descs]
    plans = [p.plan for p in preps]
    views = [d.views(p, slot) for p in preps]

    def whole(payload: bytes) -> Any:
        prep = fresh.prepare(payload, 0, 0, SLOT_NBYTES, 1)
        return fresh.bind(prep, fresh.views(prep, slot))

    return {
        "encode_request (the client's)": (lambda a: encode_request(_request(a)), values),
        "decode_request": (decode_request, payloads),
        "prepare, after decoding": (lambda x: again._prepare(x, 0, 0, SLOT_NBYTES, 1), descs),
        "  the op's rule and plan": (lambda s: be.plan(s, spec, ["out"], keep=[], resident={}), steps),
        "  the cost estimate": (kernels.estimate, plans),
        "  the response's bytes (no cache)": (lambda p: encode_response(ResponseDesc(outputs=p.outputs)), preps),
        "views": (lambda p: d.views(p, slot), preps),
        "bind": (lambda pv: d.bind(pv[0], pv[1]), list(zip(preps, views))),
        "whole": (whole, payloads),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    be = kernels.select_backend("numpy")
    best: dict[str, float] = {}
    for r in range(args.rounds):
        # fresh attribute values every round: nothing a round before made is found in a cache
        values = [float(2 + r * args.n + i) for i in range(args.n)]
        parts = _parts(be, values)
        for k, (fn, items) in parts.items():
            best[k] = min(best.get(k, float("inf")), _timed(fn, items))
    for k, v in best.items():
        print(f"{k:<36} {v:8.2f} µs")
    if args.out:
        from shmrpc.bench._report import write_probe

        write_probe({"mode": "prepare-parts", "n": args.n, "rounds": args.rounds,
                     "us_per_call": {k: round(v, 2) for k, v in best.items()}}, None, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
