"""The golden bytes of docs/protocol.md ("One call, byte by byte"), parsed for the tests that check them.

Blocks are marked ``<!-- golden: NAME -->`` and fenced as ``text``; each line is
``OFFSET: HEX BYTES [# note]`` and the offsets must follow on from each other.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["DOC", "golden_names", "golden_blocks", "parse_block"]

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
_BLOCK = re.compile(r"<!-- golden: ([\w-]+) -->\s*```text\n(.*?)```", re.DOTALL)


def parse_block(text: str) -> bytes:
    """The bytes of one block; AssertionError naming the line when an offset is wrong."""
    out = bytearray()
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        offset, sep, hexes = line.partition(":")
        assert sep, f"line {n}: no 'OFFSET:' prefix: {line!r}"
        assert int(offset, 16) == len(out), f"line {n}: offset {offset} but {len(out):#06x} bytes came before"
        out += bytes.fromhex(hexes)
    return bytes(out)


def golden_names() -> list[str]:
    """The block names, in document order (duplicates kept, so a test can refuse them)."""
    return [name for name, _ in _BLOCK.findall(DOC.read_text())]


def golden_blocks() -> dict[str, bytes]:
    """Block name -> its bytes."""
    return {name: parse_block(body) for name, body in _BLOCK.findall(DOC.read_text())}
