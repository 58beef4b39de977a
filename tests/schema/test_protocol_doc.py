"""docs/protocol.md's golden bytes are what schema/ builds: the document cannot drift from the code.

The blocks marked ``<!-- golden: NAME -->`` hold one ``scale`` call, byte by byte
(``support.protocol_doc`` parses them); tests/e2e/test_calls.py checks a real worker answers
the document's request with the document's response bytes.
"""

from __future__ import annotations

import pytest
from support.protocol_doc import golden_blocks, golden_names

from shmrpc.schema import messages as m
from shmrpc.schema.control import Hello, Welcome
from shmrpc.schema.descriptor import (
    RequestDesc,
    ResponseDesc,
    StepDesc,
    TensorRef,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from shmrpc.schema.header import HEADER_NBYTES, Flag, Header, unpack_from
from shmrpc.schema.layout import DESC_NBYTES, TENSOR_ALIGN, align_up

# The call the document describes.
REGION, SLOT, REQUEST_ID, GENERATION, SCALE_CODE = 1, 0, 7, 1, 3
X = TensorRef("x", "float32", (4,), DESC_NBYTES, 16)
OUT = TensorRef("out", "float32", (4,), align_up(X.offset + X.nbytes, TENSOR_ALIGN), 16)
REQUEST = RequestDesc(steps=(StepDesc("scale", SCALE_CODE, (("x", "x"),), (("out", "out"),), (("a", 2.0),)),),
                      inputs=(X,), outputs=("out",))
RESPONSE = ResponseDesc(outputs=(OUT,))
# The handshake the document describes (§1): a client asking for one 64 KiB slot, and its WELCOME.
HELLO = Hello(m.PROTOCOL_VERSION, "0123456789abcdef", 4242, 1000, 123456, [1])
WELCOME = Welcome(m.PROTOCOL_VERSION, "0123456789abcdef", 3, "00" * 16, 77, 9999, "numpy",
                  [{"index": 1, "name": "memfd:shmrpc.w.1", "nbytes": 69632}],
                  {"desc_nbytes": 4096, "classes": [[65536, 1]]}, [[1, 0, 1]], {})


def _built() -> dict[str, bytes]:
    desc, resp = encode_request(REQUEST), encode_response(RESPONSE)
    return {
        "request-descriptor": desc,
        "request-header": Header(REQUEST_ID, SCALE_CODE, len(desc), 0, GENERATION).pack(),
        "call": m.pack_call(REGION, SLOT, REQUEST_ID, GENERATION),
        "response-descriptor": resp,
        "response-header": Header(REQUEST_ID, SCALE_CODE, len(resp), int(Flag.RESPONSE), GENERATION).pack(),
        "done": m.pack_done(REGION, SLOT, REQUEST_ID, 0),
        "hello": HELLO.encode(),
        "welcome": WELCOME.encode(),
    }


def test_the_document_has_every_golden_block_once() -> None:
    names = golden_names()
    assert sorted(names) == sorted(_built()), names


@pytest.mark.parametrize("name", sorted(_built()))
def test_golden_bytes_are_what_the_schema_builds(name: str) -> None:
    doc, built = golden_blocks()[name], _built()[name]
    assert doc == built, (f"docs/protocol.md block {name!r} differs from what schema/ builds; "
                          f"the code builds:\n" + "\n".join(f"{i:04x}: {built[i:i + 16].hex(' ')}"
                                                            for i in range(0, len(built), 16)))


def test_golden_bytes_decode_to_the_described_call() -> None:
    b = golden_blocks()
    assert decode_request(b["request-descriptor"]) == REQUEST
    assert decode_response(b["response-descriptor"]) == RESPONSE
    h = unpack_from(b["request-header"])
    assert (h.request_id, h.op_code, h.payload_length, h.flags, h.generation) == \
        (REQUEST_ID, SCALE_CODE, len(b["request-descriptor"]), 0, GENERATION)
    assert HEADER_NBYTES + h.payload_length <= DESC_NBYTES
    rh = unpack_from(b["response-header"])
    assert rh.flags == Flag.RESPONSE and rh.payload_length == len(b["response-descriptor"])
    assert m.unpack_call(b["call"]) == (REGION, SLOT, REQUEST_ID, GENERATION)
    assert m.unpack_done(b["done"]) == (REGION, SLOT, REQUEST_ID, 0)
    assert OUT.offset == 4160
