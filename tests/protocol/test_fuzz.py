"""Every decoder is total: random bytes, random msgpack values and mutated valid frames give a message or an
`Invalid` naming the field or the reason, never an exception.

Scale the hypothesis runs with KVROUTE_FUZZ_SCALE (default 1; e.g. 10 for a long local run). The exhaustive
sweeps (every truncation and every single-bit flip of every golden fixture) do not scale: they are all of them.
"""

from __future__ import annotations

import copy
import os
import random
import re
import typing
from typing import Any

import msgpack
import pytest
from fuzz_stats import STATS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from make_fixtures import EXAMPLES, UNIONS, frame_of

import protocol as p

SCALE = float(os.environ.get("KVROUTE_FUZZ_SCALE", "1"))
DECODERS: dict[str, p.Decoder[Any]] = {
    "client_request": p.client_request_decoder(),
    "router_reply": p.router_reply_decoder(),
    "worker_to_router": p.worker_to_router_decoder(),
    "router_to_worker": p.router_to_worker_decoder(),
    "direct_reply": p.direct_reply_decoder(),
}
UNCAPPED = {d: p.Decoder(u, max_bytes=2**40) for d, u in UNIONS.items()}
CLASSES = {d: tuple(typing.get_args(u)) for d, u in UNIONS.items()}
TAGS = sorted(cls.__struct_config__.tag for classes in CLASSES.values() for cls in classes)
SEEDS = [msgpack.unpackb(frame_of(ex), raw=False) for ex in EXAMPLES]
FIELD_NAMES = sorted({k for seed in SEEDS for k in seed} | {"sampling", "usage", "timings", "workers", "slots"})

# A rejection must say what is wrong: a field path or name in backticks, or one of the frame-level reasons.
REASON = re.compile(r"`[^`]+`|\$\.|\bmsgpack\b|\bmap\b|\bcap\b|\bversion\b|\btype\b|\b(prompt|messages|tokens|stop|logit_bias)\b")


def fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=max(1, int(n * SCALE)),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def decode(direction: str, frame: bytes, decoder: p.Decoder[Any] | None = None) -> Any:
    """One decode, counted and checked: a message of this socket's union, or a well-formed Invalid."""
    dec = decoder or DECODERS[direction]
    STATS.decodes += 1
    try:
        got = dec.decode(frame)
    except BaseException:
        STATS.escaped += 1
        raise
    if isinstance(got, p.Invalid):
        STATS.invalid += 1
        assert isinstance(got.code, p.ErrorCode)
        assert isinstance(got.reason, str) and got.reason.strip(), got
        assert REASON.search(got.reason), f"rejection names no field or reason: {got.reason!r}"
        assert got.id is None or (isinstance(got.id, str) and 0 < len(got.id) <= 128)
    else:
        STATS.valid += 1
        assert isinstance(got, CLASSES[direction]), (direction, got)
        again = p.encode(got)  # a message the decoder accepted is one we can send back unchanged
        assert p.encode(UNCAPPED[direction].decode(again)) == again
    return got


def feed(frame: bytes) -> dict[str, Any]:
    """A frame to all four decoders."""
    STATS.frames += 1
    return {d: decode(d, frame) for d in DECODERS}


# ---- strategies ----------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.integers(min_value=-3, max_value=300)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
keys = st.sampled_from(FIELD_NAMES) | st.text(max_size=8)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
    max_leaves=10,
)
odd_keys = st.integers(-5, 5) | st.binary(max_size=4) | st.booleans() | st.none() | st.floats(allow_nan=False)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack value, cheaper than a hypothesis strategy: for the bulk tests."""
    kind = rng.randrange(12 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-3, 300)
    if kind == 3:
        return rng.choice([-(2**63), -(2**31) - 1, -1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1])
    if kind == 4:
        return rng.choice([0.0, -0.0, 0.5, -1.5, 1e300, float("inf"), float("-inf"), float("nan"), rng.uniform(-200, 200)])
    if kind == 5:
        return rng.choice(["", "x", "stop", "\x00", "é", "1", "-1", "²", "req-1", *TAGS, *FIELD_NAMES])
    if kind == 6:
        return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(0, 300)))
    if kind == 7:
        return rng.randbytes(rng.choice([0, 1, 3, 4, 8, 12, 13]))
    if kind == 8:
        return rng.choice(["user", "system", "tool", "assistant", "bot", "cpu", "stop", "length"])
    if kind == 9:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 5))]
    return {random_key(rng): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))}


def random_key(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.8:
        return rng.choice(FIELD_NAMES)
    if r < 0.95:
        return rng.choice(["", "x", "0", "12", "type", "v", "\u00b2"])
    return rng.choice([0, -1, b"k", 1.5, None, True])


def random_message_map(rng: random.Random) -> dict[Any, Any]:
    """Something shaped like a message: a real tag and v = 1 mostly, known field names, random values."""
    doc: dict[Any, Any] = {
        "type": rng.choice(TAGS) if rng.random() < 0.9 else random_value(rng, 2),
        "v": 1 if rng.random() < 0.9 else random_value(rng, 2),
    }
    for _ in range(rng.randrange(0, 10)):
        doc[random_key(rng)] = random_value(rng)
    return doc


def mutate(rng: random.Random, doc: Any) -> tuple[Any, ...] | None:
    """Drop or retype one value somewhere in `doc`, in place; returns the path touched."""
    all_paths = paths(doc)
    if not all_paths:
        return None
    path = rng.choice(all_paths)
    holder = parent(doc, path)
    if rng.random() < 0.4:
        if isinstance(holder, list):
            holder.pop(path[-1])
        else:
            del holder[path[-1]]
    else:
        holder[path[-1]] = random_value(rng, 1)
    return path


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


# ---- random input --------------------------------------------------------------------------------


@fuzz_settings(1500)
@given(st.binary(max_size=256))
def test_random_bytes(frame: bytes) -> None:
    feed(frame)


@fuzz_settings(800)
@given(st.sampled_from([bytes([b]) for b in range(0x80, 0x90)] + [b"\xde", b"\xdf"]), st.binary(max_size=200))
def test_random_bytes_after_a_map_header(head: bytes, tail: bytes) -> None:
    feed(head + tail)


@fuzz_settings(800)
@given(values)
def test_random_msgpack_values(value: Any) -> None:
    feed(pack(value))


@fuzz_settings(150)
@given(st.dictionaries(odd_keys, values, min_size=1, max_size=4), st.sampled_from(TAGS))
def test_maps_with_non_string_keys(extra: dict[Any, Any], tag: str) -> None:
    feed(pack({"type": tag, "v": 1, **extra}))


@fuzz_settings(500)
@given(
    st.sampled_from(TAGS) | st.text(max_size=10),
    st.just(1) | values,
    st.dictionaries(keys, values, max_size=8),
)
def test_message_shaped_maps(tag: str, version: Any, fields: dict[str, Any]) -> None:
    feed(pack({"type": tag, "v": version, **fields}))


# ---- mutations of valid frames -------------------------------------------------------------------


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key/index path inside a decoded frame."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for k, v in items:
        out.append((*prefix, k))
        out += paths(v, (*prefix, k))
    return out


def parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for k in path[:-1]:
        doc = doc[k]
    return doc


def describe(path: tuple[Any, ...]) -> str:
    return "$" + "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


def check_names(got: dict[str, Any], ex_dir: str, path: tuple[Any, ...]) -> None:
    """When the owning decoder refuses a frame mutated at `path`, the reason names the top-level field."""
    res = got[ex_dir]
    if not isinstance(res, p.Invalid):
        return
    top = path[0]
    if top == "type" and res.reason.split(":")[0] in TAGS:
        return  # the tag now names another message of this socket: its own fields are what is wrong
    if top in ("type", "v"):
        assert f"`{top}`" in res.reason or "type" in res.reason or "version" in res.reason, res.reason
    else:
        assert str(top) in res.reason, f"mutating {describe(path)} gave {res.reason!r}"


@fuzz_settings(700)
@given(st.data())
def test_mutated_fixtures(data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(EXAMPLES) - 1), label="fixture")
    ex, doc = EXAMPLES[i], copy.deepcopy(SEEDS[i])
    op = data.draw(st.sampled_from(["drop", "retype", "version", "type", "add"]), label="op")
    if op in ("drop", "retype"):
        path = data.draw(st.sampled_from(paths(doc)), label="path")
        holder = parent(doc, path)
        if op == "drop":
            if isinstance(holder, list):
                holder.pop(path[-1])
            else:
                del holder[path[-1]]
        else:
            holder[path[-1]] = data.draw(values, label="value")
        check_names(feed(pack(doc)), ex.direction, path)
    elif op == "version":
        bad = data.draw(st.integers(-(2**63), 2**64 - 1) | values, label="v")
        if data.draw(st.booleans(), label="drop v"):
            del doc["v"]
        else:
            doc["v"] = bad
        got = feed(pack(doc))[ex.direction]
        if "v" in doc and type(doc["v"]) is int and doc["v"] != p.PROTOCOL_VERSION:
            assert isinstance(got, p.Invalid) and got.code == p.ErrorCode.UNSUPPORTED_VERSION
            assert "version" in got.reason
        elif doc.get("v") != p.PROTOCOL_VERSION or type(doc.get("v")) is not int:
            assert isinstance(got, p.Invalid) and got.code == p.ErrorCode.BAD_REQUEST and "`v`" in got.reason, got
    elif op == "type":
        doc["type"] = data.draw(st.sampled_from(TAGS) | values, label="type")
        got = feed(pack(doc))
        for direction, res in got.items():
            tags = {c.__struct_config__.tag for c in CLASSES[direction]}
            if doc["type"] not in tags if isinstance(doc["type"], str) else True:
                assert isinstance(res, p.Invalid) and "type" in res.reason, res
    else:  # unknown fields are ignored
        name = data.draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in doc), label="name")
        doc[name] = data.draw(values, label="value")
        got = feed(pack(doc))[ex.direction]
        assert got == ex.msg


@fuzz_settings(250)
@given(st.data())
def test_byte_level_mutations(data: st.DataObject) -> None:
    ex = data.draw(st.sampled_from(EXAMPLES), label="fixture")
    frame = frame_of(ex)
    # truncated: a proper prefix of a msgpack value is never a whole value
    cut = data.draw(st.integers(0, len(frame) - 1), label="cut")
    for res in feed(frame[:cut]).values():
        assert isinstance(res, p.Invalid) and "msgpack" in res.reason
    # trailing bytes
    tail = data.draw(st.binary(min_size=1, max_size=8), label="tail")
    for res in feed(frame + tail).values():
        assert isinstance(res, p.Invalid) and "msgpack" in res.reason
    # random bit flips and byte overwrites
    buf = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 6), label="flips")):
        pos = data.draw(st.integers(0, len(buf) - 1))
        if data.draw(st.booleans()):
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        else:
            buf[pos] = data.draw(st.integers(0, 255))
    feed(bytes(buf))
    # over a (small) cap: refused before decoding
    cap = data.draw(st.integers(0, len(frame) - 1), label="cap")
    STATS.frames += 1
    small = p.Decoder(UNIONS[ex.direction], max_bytes=cap)
    res = decode(ex.direction, frame, small)
    assert isinstance(res, p.Invalid) and res.code == p.ErrorCode.TOO_LARGE and "cap" in res.reason
    assert decode(ex.direction, frame, p.Decoder(UNIONS[ex.direction], max_bytes=len(frame))) == ex.msg


# ---- bulk: a hypothesis-drawn seed drives many cheap frames per example ---------------------------

BULK = 40  # frames per example
# A plain Random from a drawn seed: hypothesis's own randoms() records every call and is 10x slower here.
seeds = st.integers(0, 2**64 - 1).map(random.Random)


@fuzz_settings(500)
@given(seeds)
def test_bulk_message_shaped_maps(rng: random.Random) -> None:
    for _ in range(BULK):
        feed(pack(random_message_map(rng)))


@fuzz_settings(500)
@given(seeds)
def test_bulk_mutated_fixtures(rng: random.Random) -> None:
    for _ in range(BULK):
        i = rng.randrange(len(EXAMPLES))
        doc = copy.deepcopy(SEEDS[i])
        touched = [mutate(rng, doc) for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        got = feed(pack(doc))
        if len(touched) == 1 and touched[0] is not None:  # one mutation: a refusal must name where
            check_names(got, EXAMPLES[i].direction, touched[0])


@fuzz_settings(300)
@given(seeds)
def test_bulk_byte_mutations(rng: random.Random) -> None:
    for _ in range(BULK):
        ex = rng.choice(EXAMPLES)
        buf = bytearray(frame_of(ex))
        for _ in range(rng.randrange(1, 8)):
            op = rng.randrange(4)
            pos = rng.randrange(len(buf))
            if op == 0:
                buf[pos] ^= 1 << rng.randrange(8)
            elif op == 1:
                buf[pos] = rng.randrange(256)
            elif op == 2:
                buf[pos:pos] = rng.randbytes(rng.randrange(1, 5))
            elif len(buf) > 1:  # (never to empty: the next mutation needs a byte)
                del buf[pos : pos + min(rng.randrange(1, 5), len(buf) - 1)]
        feed(bytes(buf))


# ---- exhaustive sweeps over the golden fixtures -------------------------------------------------


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda ex: ex.name)
def test_every_truncation_and_bit_flip(ex: Any) -> None:
    frame = frame_of(ex)
    for cut in range(len(frame)):
        for res in feed(frame[:cut]).values():
            assert isinstance(res, p.Invalid) and "msgpack" in res.reason
    for pos in range(len(frame)):
        for bit in range(8):
            buf = bytearray(frame)
            buf[pos] ^= 1 << bit
            feed(bytes(buf))


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda ex: ex.name)
def test_every_field_dropped_or_nulled(ex: Any) -> None:
    seed = msgpack.unpackb(frame_of(ex), raw=False)
    for path in paths(seed):
        for op in ("drop", "nil", "wrong"):
            doc = copy.deepcopy(seed)
            holder = parent(doc, path)
            if op == "drop":
                if isinstance(holder, list):
                    holder.pop(path[-1])
                else:
                    del holder[path[-1]]
            else:
                old = holder[path[-1]]
                holder[path[-1]] = None if op == "nil" else ([] if isinstance(old, str) else "x")
            check_names(feed(pack(doc)), ex.direction, path)


def test_frames_over_the_default_cap() -> None:
    """The 8 MiB default cap: one byte over is `too_large` for every decoder a client's frames reach; exactly at the cap
    is decoded. Between router and workers a frame may carry a saved state copied between workers too."""
    base = pack({"type": "submit", "v": 1, "id": "big", "prompt": ""})
    prompt = "a" * (p.MAX_FRAME_BYTES - len(base) - 4)  # str32 header is 4 bytes longer than fixstr
    at_cap = pack({"type": "submit", "v": 1, "id": "big", "prompt": prompt})
    assert len(at_cap) == p.MAX_FRAME_BYTES
    got = feed(at_cap)
    assert isinstance(got["client_request"], p.Submit) and got["client_request"].prompt == prompt
    for name, res in feed(at_cap + b"\x00").items():
        if name in ("worker_to_router", "router_to_worker"):
            assert DECODERS[name].max_bytes == p.MAX_FRAME_BYTES + p.MAX_STATE_BYTES
            assert isinstance(res, p.Invalid) and res.code == p.ErrorCode.BAD_REQUEST  # (read whole: trailing bytes)
        else:
            assert isinstance(res, p.Invalid) and res.code == p.ErrorCode.TOO_LARGE and "cap" in res.reason


def test_deep_nesting_is_refused_not_crashed() -> None:
    for depth in (1000, 100_000):
        for frame in (b"\x91" * depth + b"\x00", b"\x82\xa4type\xa6submit\xa1v" + b"\x81\xa1a" * depth + b"\x01"):
            for res in feed(frame).values():
                assert isinstance(res, p.Invalid)


def test_memoryview_frames_decode() -> None:
    """pyzmq hands out memoryview frames with copy=False."""
    for ex in EXAMPLES:
        STATS.frames += 1
        assert decode(ex.direction, memoryview(frame_of(ex))) == ex.msg


def test_zz_fuzz_totals() -> None:
    """Runs last in this file: the count of frames tried so far, and that no decoder raised."""
    print(f"protocol fuzz: {STATS.frames} frames, {STATS.decodes} decodes, {STATS.escaped} escaped")
    assert STATS.escaped == 0
