"""protocol/PROTOCOL.md stays exact: its field tables are the structs, its codes are the enums, its example is the fixture."""

from __future__ import annotations

import re

from make_fixtures import ALL_STRUCTS, FIXTURES, SPEC, render_spec, spec_tables

import protocol as p

TEXT = SPEC.read_text()


def test_every_struct_has_one_table() -> None:
    names = spec_tables(TEXT)
    assert sorted(names) == sorted({cls.__name__ for cls in ALL_STRUCTS}), "add a <!-- table:Name --> block per struct"
    assert len(names) == len(set(names))


def test_tables_match_the_code() -> None:
    assert render_spec(TEXT) == TEXT, "field tables are stale: run .venv/bin/python tests/protocol/make_fixtures.py"


def test_every_field_has_a_meaning() -> None:
    for block in re.findall(r"<!-- table:\w+ -->\n(.*?)\n<!-- /table -->", TEXT, re.S):
        for row in block.splitlines()[2:]:
            meaning = row.rstrip().rstrip("|").rsplit("|", 1)[-1].strip()
            assert meaning, f"no meaning written for {row.split('|')[1].strip()} in PROTOCOL.md"


def test_error_codes_and_finish_reasons_are_documented() -> None:
    for code in p.ErrorCode:
        assert re.search(rf"^\| `{code.value}` \|", TEXT, re.M), f"error code {code.value} missing from PROTOCOL.md section 5"
    for reason in p.FinishReason:
        assert re.search(rf"^\| `{reason.value}` \|", TEXT, re.M), f"finish reason {reason.value} missing"


def test_worked_example_is_the_fixture() -> None:
    m = re.search(r"<!-- example:(\w+) -->\n```\n([0-9a-f]+)\n```", TEXT)
    assert m, "worked example block missing"
    frame = (FIXTURES / f"{m.group(1)}.msgpack").read_bytes()
    assert bytes.fromhex(m.group(2)) == frame
    assert f"Its {len(frame)} bytes" in TEXT


def test_stated_numbers() -> None:
    assert f"**{p.MAX_FRAME_BYTES // 2**20} MiB** = {p.MAX_FRAME_BYTES} bytes" in TEXT
    assert f"version {p.PROTOCOL_VERSION}" in TEXT
    assert f"tokens `[]` → `{p.token_hash([])}`" in TEXT
    packed = p.pack_tokens([2, 9259, 1902, 563]).hex()
    assert f"(packed `{packed}`) → `{p.token_hash([2, 9259, 1902, 563])}`" in TEXT
