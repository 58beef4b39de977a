"""The schema hash covers the .fbs declarations: comments and line endings do not change it, fields do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shmrpc.schema import SCHEMA_HASH
from shmrpc.schema.fbshash import fbs_hash, fbs_tokens, hash_module_text, normalize_fbs
from shmrpc.schema.layout import DEFAULT_GEOMETRY, Superblock

SCHEMA = Path(__file__).resolve().parents[2] / "schema"
FBS = (SCHEMA / "shmrpc.fbs").read_bytes()


def test_committed_hash_module_is_the_hash_of_the_committed_fbs() -> None:
    assert fbs_hash(FBS) == SCHEMA_HASH, "run `make schema` after editing schema/shmrpc.fbs"
    assert (SCHEMA / "_hash.py").read_text() == hash_module_text(SCHEMA_HASH), "run `make schema`"


def test_script_prints_the_hash_make_schema_writes(tmp_path: Path) -> None:
    out = tmp_path / "_hash.py"
    run = subprocess.run([sys.executable, str(SCHEMA / "fbshash.py"), str(SCHEMA / "shmrpc.fbs"), "--write", str(out)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == SCHEMA_HASH
    assert out.read_text() == (SCHEMA / "_hash.py").read_text()


@pytest.mark.parametrize("edit", [
    lambda s: s.replace(b"\n", b"\r\n"),
    lambda s: b"\xef\xbb\xbf" + s,
    lambda s: b"// a new first line\n/* and a\n block */\n" + s,
    lambda s: s.replace(b"// 0 = ok, else the wire error code (errors.py)", b""),
    lambda s: s.replace(b"/// Binds an op parameter", b"/// Ties an op parameter"),
    lambda s: s.replace(b"  ", b"\t").replace(b"\n\n", b"\n\n\n"),
    lambda s: s.replace(b"name: string (required);", b"name :string(required) ;"),
], ids=["crlf", "bom", "new comments", "comment removed", "doc comment edited", "whitespace", "spacing in a field"])
def test_layout_and_comments_keep_the_hash(edit) -> None:  # type: ignore[no-untyped-def]
    changed = edit(FBS)
    assert changed != FBS
    assert fbs_hash(changed) == fbs_hash(FBS)


@pytest.mark.parametrize("edit", [
    lambda s: s.replace(b"nbytes: ulong;", b"nbytes: long;"),
    lambda s: s.replace(b"step: int = -1;", b"step: int = 0;"),
    lambda s: s.replace(b"resident: string;", b"resident: string;\n  device: int;"),
    lambda s: s.replace(b"float64 = 13,", b"float64 = 14,"),
    lambda s: s.replace(b"param: string (required);", b"param: string;"),
    lambda s: s.replace(b"  offset: ulong;\n  nbytes: ulong;", b"  nbytes: ulong;\n  offset: ulong;"),
    lambda s: s.replace(b"root_type Request;", b"root_type Response;"),
], ids=["type", "default", "new field", "enum value", "attribute", "field order", "root type"])
def test_declaration_changes_change_the_hash(edit) -> None:  # type: ignore[no-untyped-def]
    changed = edit(FBS)
    assert changed != FBS
    assert fbs_hash(changed) != fbs_hash(FBS)


def test_tokens() -> None:
    src = 'table T { s: string = "a // not a comment"; /* gone */ x:int=-1; } // gone too\r\n'
    assert fbs_tokens(src) == ["table", "T", "{", "s", ":", "string", "=", '"a // not a comment"', ";",
                               "x", ":", "int", "=", "-1", ";", "}"]
    assert normalize_fbs("a:int;") == normalize_fbs("a : int ;\n") == "a : int ;"


def test_superblock_holds_the_hash_as_raw_bytes() -> None:
    buf = bytearray(4096)
    Superblock.for_geometry(DEFAULT_GEOMETRY, worker_pid=1, worker_start_ticks=2, epoch=3).pack_into(memoryview(buf))
    assert bytes(buf[16:24]) == bytes.fromhex(SCHEMA_HASH)
    doc = (SCHEMA.parent / "docs" / "protocol.md").read_text()
    assert f"`{bytes.fromhex(SCHEMA_HASH).hex(' ')}` for\n`{SCHEMA_HASH}`" in doc, "protocol.md's example of the hash field"
