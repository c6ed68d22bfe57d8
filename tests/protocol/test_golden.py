"""Golden byte fixtures: read them as another language would (plain msgpack), then through the codec.

Regenerate with `.venv/bin/python tests/protocol/make_fixtures.py` only for a deliberate wire change.
"""

from __future__ import annotations

import json
import struct
import typing

import msgpack
import msgspec
import pytest
from make_fixtures import DECODERS, EXAMPLES, FIXTURES, UNIONS, Example, frame_of, index

import protocol as p

BY_NAME = {ex.name: ex for ex in EXAMPLES}


def fixture_bytes(ex: Example) -> bytes:
    return (FIXTURES / f"{ex.name}.msgpack").read_bytes()


def test_every_message_class_has_a_fixture() -> None:
    covered = {type(ex.msg) for ex in EXAMPLES}
    for direction, union in UNIONS.items():
        for cls in typing.get_args(union):
            assert cls in covered, f"{cls.__name__} ({direction}) has no golden fixture: add one to make_fixtures.EXAMPLES"
            assert any(ex.direction == direction for ex in EXAMPLES if type(ex.msg) is cls)


def test_fixture_files_match_the_examples() -> None:
    on_disk = {f.name for f in FIXTURES.glob("*.msgpack")}
    assert on_disk == {f"{ex.name}.msgpack" for ex in EXAMPLES}
    for ex in EXAMPLES:
        assert fixture_bytes(ex) == frame_of(ex), f"{ex.name}.msgpack is stale: run tests/protocol/make_fixtures.py"
    assert json.loads((FIXTURES / "index.json").read_text()) == json.loads(json.dumps(index(), ensure_ascii=False))


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda ex: ex.name)
def test_plain_msgpack_reads_the_fixture(ex: Example) -> None:
    """What a Go/Node client sees: a map with string keys, `type`, `v`, token fields as int32 LE `bin`."""
    raw = msgpack.unpackb(fixture_bytes(ex), raw=False, strict_map_key=True)
    assert isinstance(raw, dict)
    assert all(isinstance(k, str) for k in raw)
    assert raw["type"] == ex.msg.__struct_config__.tag
    assert raw["v"] == 1 and type(raw["v"]) is int
    if ex.raw is None:  # canonical: every field, `type` then `v` first, in declaration order
        assert list(raw)[:2] == ["type", "v"]
        assert list(raw)[2:] == [f for f in ex.msg.__struct_fields__ if f != "v"]
    for path, ids in ex.tokens.items():
        data = raw[path]
        assert type(data) is bytes, f"{path} must be msgpack bin"
        assert len(data) == 4 * len(ids)
        assert list(struct.unpack(f"<{len(ids)}i", data)) == ids
    bin_fields = [k for k, val in raw.items() if isinstance(val, bytes)]
    assert sorted(bin_fields) == sorted(ex.tokens), "every bin field must be listed with its token ids"


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda ex: ex.name)
def test_codec_decodes_and_reencodes_the_fixture(ex: Example) -> None:
    frame = fixture_bytes(ex)
    msg = DECODERS[ex.direction]().decode(frame)
    assert not isinstance(msg, p.Invalid), msg
    assert msg == ex.msg
    assert type(msg) is type(ex.msg)
    if ex.raw is None:
        assert p.encode(msg) == frame
    else:  # a hand-written frame: the canonical encoding has the defaults filled in, and reads back equal
        assert DECODERS[ex.direction]().decode(p.encode(msg)) == msg
    for path, ids in ex.tokens.items():
        assert p.unpack_tokens(getattr(msg, path)) == ids


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda ex: ex.name)
def test_other_sockets_refuse_the_fixture(ex: Example) -> None:
    """A message type is taken by the decoders whose socket takes it (a client's reply_to takes some of the worker's
    messages to the router); the others name the type."""
    for direction, make in DECODERS.items():
        if type(ex.msg) in typing.get_args(UNIONS[direction]):
            continue
        got = make().decode(fixture_bytes(ex))
        assert isinstance(got, p.Invalid)
        assert got.code == p.ErrorCode.BAD_REQUEST
        assert "unknown message type" in got.reason and repr(ex.msg.__struct_config__.tag) in got.reason


def test_job_done_fixture_keeps_the_slot_invariant() -> None:
    """The worked numbers in the job_done fixture obey the contract: slot = first slot_tokens of prompt + generated."""
    done = BY_NAME["job_done"].msg
    job = BY_NAME["job"].msg
    assert isinstance(done, p.JobDone) and isinstance(job, p.Job)
    kept = (p.unpack_tokens(job.tokens) + p.unpack_tokens(done.tokens))[: done.slot_tokens]
    assert done.slot_hash == p.token_hash(kept)
    assert done.reused_tokens + done.prefilled_tokens == done.prompt_tokens
    assert done.slot_tokens == done.prompt_tokens + done.generated_tokens - 1


def test_fixtures_are_plain_builtins() -> None:
    """No msgpack ext types anywhere: any msgpack library reads the fixtures without hooks."""

    def no_ext(code: int, data: bytes) -> None:
        raise AssertionError(f"ext type {code} in a fixture")

    for ex in EXAMPLES:
        msgpack.unpackb(fixture_bytes(ex), raw=False, ext_hook=no_ext)
        msgspec.msgpack.decode(fixture_bytes(ex))
