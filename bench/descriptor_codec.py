"""The descriptor's codec: ``schema/_flat.py`` (by hand, the product's) against the generated FlatBuffers code.

    python bench/descriptor_codec.py --out bench/results/descriptor-codec-DATE-COMMIT.json

Times, in one process and interleaved, building and reading the one-step request of a first call of ``scale``
(one float32 input, two float attributes) and its response, through ``shmrpc.schema.descriptor`` and through
``tests/support/fbref.py`` (the product's codec before 2026-12-04, the generated code driven through
``flatbuffers.Builder`` and ``Table``; the reference the tests check the new codec against). Per case the best of
``--rounds`` runs of ``--n`` calls, µs per call.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

from shmrpc.schema import descriptor as mine
from shmrpc.schema.descriptor import RequestDesc, ResponseDesc, StepDesc, TensorRef

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import fbref  # noqa: E402  (the reference codec lives with the tests)

REQUEST = RequestDesc(steps=(StepDesc("scale", 3, (("x", "x"),), (("out", "out"),), (("a", 1.5), ("b", 0.0))),),
                      inputs=(TensorRef("x", "float32", (16,), 4096, 64),), outputs=("out",))
RESPONSE = ResponseDesc(outputs=(TensorRef("out", "float32", (16,), 4160, 64),))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases = {}
    for label, codec in (("flat", mine), ("generated", fbref)):
        req, resp = codec.encode_request(REQUEST), codec.encode_response(RESPONSE)
        assert mine.decode_request(req) == fbref.decode_request(req) == REQUEST
        cases.update({
            f"{label}_encode_request": lambda c=codec: c.encode_request(REQUEST),
            f"{label}_decode_request": lambda c=codec, b=req: c.decode_request(b),
            f"{label}_encode_response": lambda c=codec: c.encode_response(RESPONSE),
            f"{label}_decode_response": lambda c=codec, b=resp: c.decode_response(b),
        })
    best = {k: float("inf") for k in cases}
    for _ in range(args.rounds):
        for k, fn in cases.items():
            best[k] = min(best[k], timeit.timeit(fn, number=args.n) / args.n * 1e6)
    for k, v in best.items():
        print(f"{k:<28} {v:8.2f} µs")
    if args.out:
        from shmrpc.bench._report import write_probe

        write_probe({"mode": "descriptor-codec", "n": args.n, "rounds": args.rounds, "us_per_call": {k: round(v, 2) for k, v in best.items()}},
                    None, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
