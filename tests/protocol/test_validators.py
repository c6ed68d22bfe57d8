"""Token packing, the slot hash, and the semantic rules the structs check beyond field types."""

from __future__ import annotations

import hashlib
import struct
from array import array
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol as p
from protocol.common import MAX_STOP_LEN, MAX_STOP_STRINGS

int32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
DEC = p.client_request_decoder()


def submit_frame(**fields: Any) -> bytes:
    return msgpack.packb({"type": "submit", "v": 1, "id": "t", **fields}, use_bin_type=True)


def refused(frame: bytes, *words: str) -> p.Invalid:
    got = DEC.decode(frame)
    assert isinstance(got, p.Invalid), got
    assert got.code == p.ErrorCode.BAD_REQUEST
    for w in words:
        assert w in got.reason, (w, got.reason)
    return got


# ---- tokens -------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(int32, max_size=64))
def test_pack_unpack_round_trip(tokens: list[int]) -> None:
    packed = p.pack_tokens(tokens)
    assert len(packed) == 4 * len(tokens)
    assert packed == struct.pack(f"<{len(tokens)}i", *tokens)  # little-endian int32, back to back
    assert p.unpack_tokens(packed) == tokens
    assert p.pack_tokens(array("i", tokens)) == packed


@settings(max_examples=300, deadline=None)
@given(st.lists(int32, max_size=64))
def test_token_hash_definition(tokens: list[int]) -> None:
    h = p.token_hash(tokens)
    assert h == hashlib.blake2b(struct.pack(f"<{len(tokens)}i", *tokens), digest_size=8).hexdigest()
    assert len(h) == 16 and h == h.lower()
    assert p.token_hash(list(tokens)) == h


def test_token_hash_known_values() -> None:
    """Fixed values another language can check its implementation against (also in PROTOCOL.md)."""
    assert p.token_hash([]) == hashlib.blake2b(b"", digest_size=8).hexdigest()
    assert p.pack_tokens([2, 9259]).hex() == "020000002b240000"
    assert (
        p.token_hash([2, 9259, 1902, 563])
        == hashlib.blake2b(bytes.fromhex("020000002b2400006e07000033020000"), digest_size=8).hexdigest()
    )
    assert p.token_hash([1, 2]) != p.token_hash([2, 1])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_unpack_rejects_a_partial_int32(n: int) -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        p.unpack_tokens(b"\x00" * n)


def test_pack_rejects_out_of_range_ids() -> None:
    with pytest.raises(OverflowError):
        p.pack_tokens([2**31])


@pytest.mark.parametrize("length", [1, 2, 3, 5, 6, 7, 9])
@pytest.mark.parametrize("tag", ["submit", "delta", "result", "job_delta", "job_done", "job"])
def test_every_token_field_must_be_packed_int32(tag: str, length: int) -> None:
    from make_fixtures import DECODERS, EXAMPLES

    ex = next(e for e in EXAMPLES if e.msg.__struct_config__.tag == tag and e.raw is None and e.tokens)
    raw = msgpack.unpackb(p.encode(ex.msg), raw=False)
    raw["tokens"] = b"\x01" * length
    got = DECODERS[ex.direction]().decode(msgpack.packb(raw, use_bin_type=True))
    assert isinstance(got, p.Invalid) and "tokens" in got.reason and "multiple of 4" in got.reason


def test_token_fields_take_bin_not_str_or_list() -> None:
    refused(submit_frame(tokens="AAAAAA=="), "$.tokens")  # no base64 coercion
    refused(submit_frame(tokens=[2, 9259]), "$.tokens")


def test_prompt_tokens_must_not_be_empty() -> None:
    refused(submit_frame(tokens=b""), "tokens", "at least one")
    got = p.router_to_worker_decoder().decode(msgpack.packb({"type": "job", "v": 1, "id": "j", "tokens": b""}))
    assert isinstance(got, p.Invalid) and "at least one token" in got.reason


# ---- submit: exactly one of prompt / messages / tokens ------------------------------------------

PROMPTS: dict[str, Any] = {
    "prompt": "hi",
    "messages": [{"role": "user", "content": "hi"}],
    "tokens": p.pack_tokens([2]),
}


@pytest.mark.parametrize(
    "given_", [(), ("prompt", "messages"), ("prompt", "tokens"), ("messages", "tokens"), ("prompt", "messages", "tokens")]
)
def test_submit_needs_exactly_one_input(given_: tuple[str, ...]) -> None:
    refused(submit_frame(**{k: PROMPTS[k] for k in given_}), "exactly one of prompt, messages, tokens", f"got {len(given_)}")


@pytest.mark.parametrize("key", list(PROMPTS))
def test_submit_with_one_input_decodes(key: str) -> None:
    got = DEC.decode(submit_frame(**{key: PROMPTS[key]}))
    assert isinstance(got, p.Submit) and getattr(got, key) is not None


def test_nil_inputs_count_as_absent() -> None:
    got = DEC.decode(submit_frame(prompt="hi", messages=None, tokens=None))
    assert isinstance(got, p.Submit) and got.prompt == "hi"


def test_chat_messages() -> None:
    refused(submit_frame(messages=[]), "messages must not be empty")
    refused(submit_frame(messages=[{"role": "bot", "content": "x"}]), "$.messages[0].role")
    refused(submit_frame(messages=[{"role": "user"}]), "content", "$.messages[0]")
    roles = [{"role": r, "content": ""} for r in ("system", "developer", "user", "assistant")]
    assert isinstance(DEC.decode(submit_frame(messages=[*roles, {"role": "tool", "content": "", "tool_call_id": "c"}])), p.Submit)
    refused(submit_frame(messages=[{"role": "tool", "content": "x"}]), "`tool_call_id`", "$.messages[0]")
    call = {"id": "c1", "name": "f", "arguments": "{}"}
    refused(submit_frame(messages=[{"role": "user", "content": "x", "tool_calls": [call]}]), "`tool_calls`")
    refused(
        submit_frame(messages=[{"role": "assistant", "tool_calls": [{**call, "name": "a b"}]}]),
        "$.messages[0].tool_calls[0].name",
    )
    assert isinstance(DEC.decode(submit_frame(messages=[{"role": "assistant", "content": None, "tool_calls": [call]}])), p.Submit)
    parts = [{"type": "text", "text": "a"}, {"type": "image_url"}]
    refused(submit_frame(messages=[{"role": "user", "content": parts}]), "$.messages[0].content")


def test_tools_and_output_shapes() -> None:
    chat = [{"role": "user", "content": "x"}]
    tool = {"name": "get_weather", "parameters": {"type": "object"}}
    refused(submit_frame(prompt="x", tools=[tool]), "`tools`")
    refused(submit_frame(messages=chat, tool_choice="required"), "`tool_choice` requires `tools`")
    refused(submit_frame(messages=chat, tools=[tool], tool_choice="sometimes"), "$.tool_choice")
    named = {"name": "get_weather"}
    assert isinstance(DEC.decode(submit_frame(messages=chat, tools=[tool], tool_choice=named)), p.Submit)
    fmt = {"type": "json_object"}
    refused(submit_frame(messages=chat, tools=[tool], tool_choice="required", response_format=fmt), "at most one")
    refused(submit_frame(prompt="x", response_format=fmt, grammar='root ::= "a"'), "at most one")
    refused(submit_frame(prompt="x", response_format={"type": "json_schema"}), "`schema`")
    refused(submit_frame(prompt="x", n=0), "$.n")
    refused(submit_frame(prompt="x", n=17), "$.n")
    assert isinstance(DEC.decode(submit_frame(prompt="x", response_format=fmt, n=3)), p.Submit)


def test_constructing_a_bad_submit_raises() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        p.Submit(id="x")


# ---- sampling -----------------------------------------------------------------------------------


def sampling_frame(**sampling: Any) -> bytes:
    return submit_frame(prompt="hi", sampling=sampling)


@pytest.mark.parametrize("key", ["1", "0", "262143", "4294967295"])
def test_logit_bias_keys_are_decimal_token_ids(key: str) -> None:
    got = DEC.decode(sampling_frame(logit_bias={key: -100}))
    assert isinstance(got, p.Submit) and got.sampling.logit_bias_ids() == {int(key): -100.0}


@pytest.mark.parametrize("key", ["", "-1", "1.0", "0x10", " 1", "abc", "²", "١٢", "12345678901"])
def test_logit_bias_bad_keys(key: str) -> None:
    refused(sampling_frame(logit_bias={key: 1.0}), "logit_bias", "$.sampling")


def test_logit_bias_values() -> None:
    refused(sampling_frame(logit_bias={"1": 100.5}), "$.sampling.logit_bias")
    refused(sampling_frame(logit_bias={"1": "x"}), "$.sampling.logit_bias")
    refused(sampling_frame(logit_bias={1: 1.0}), "key")  # keys are strings on the wire


def test_stop_limits() -> None:
    ok = DEC.decode(sampling_frame(stop=["x" * MAX_STOP_LEN] * MAX_STOP_STRINGS))
    assert isinstance(ok, p.Submit) and len(ok.sampling.stop) == MAX_STOP_STRINGS
    refused(sampling_frame(stop=["x"] * (MAX_STOP_STRINGS + 1)), f"at most {MAX_STOP_STRINGS} stop strings", "$.sampling")
    refused(sampling_frame(stop=["x" * (MAX_STOP_LEN + 1)]), "$.sampling.stop[0]")
    refused(sampling_frame(stop=[""]), "$.sampling.stop[0]")
    refused(sampling_frame(stop="\n"), "$.sampling.stop")


RANGES = [
    ("max_tokens", [1, 100000, None], [0, -1, 1.5]),
    ("temperature", [0, 0.0, 2, 100], [-0.1, 100.1, float("nan"), None]),
    ("top_k", [0, 40], [-1, 1.0]),
    ("top_p", [1e-9, 0.5, 1, 1.0], [0, 0.0, 1.01]),
    ("min_p", [0, 0.0, 1.0], [-0.01, 1.5]),
    ("seed", [0, 2**32 - 2, None], [-1, 2**32 - 1, 1.0]),
    ("ignore_eos", [True, False], [0, None]),
]


@pytest.mark.parametrize(("field", "good", "bad"), RANGES, ids=[r[0] for r in RANGES])
def test_sampling_ranges(field: str, good: list[Any], bad: list[Any]) -> None:
    for value in good:
        got = DEC.decode(sampling_frame(**{field: value}))
        assert isinstance(got, p.Submit), (field, value, got)
        assert getattr(got.sampling, field) == value
    for value in bad:
        refused(sampling_frame(**{field: value}), f"$.sampling.{field}")


def test_ints_are_accepted_where_floats_are_expected() -> None:
    got = DEC.decode(sampling_frame(temperature=1, top_p=1, min_p=0, logit_bias={"5": 3}))
    assert isinstance(got, p.Submit)
    assert type(got.sampling.temperature) is float and type(got.sampling.logit_bias["5"]) is float


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "max_tokens": st.none() | st.integers(1, 2**31),
            "temperature": st.floats(0, 100),
            "top_k": st.integers(0, 2**31),
            "top_p": st.floats(0, 1, exclude_min=True),
            "min_p": st.floats(0, 1),
            "seed": st.none() | st.integers(0, 2**32 - 2),
            "logit_bias": st.dictionaries(st.integers(0, 9_999_999_999).map(str), st.floats(-100, 100), max_size=4),
            "stop": st.lists(st.text(min_size=1, max_size=MAX_STOP_LEN), max_size=MAX_STOP_STRINGS),
            "ignore_eos": st.booleans(),
        },
    ),
    st.none() | st.integers(1, p.MAX_DEADLINE_MS),
    st.booleans(),
)
def test_any_valid_submit_decodes_and_round_trips(sampling: dict[str, Any], deadline: int | None, stream: bool) -> None:
    got = DEC.decode(submit_frame(prompt="x", sampling=sampling, deadline_ms=deadline, stream=stream))
    assert isinstance(got, p.Submit), got
    for k, val in sampling.items():
        assert getattr(got.sampling, k) == val
    assert DEC.decode(p.encode(got)) == got


# ---- ids, versions, unknown fields --------------------------------------------------------------


def test_deadline_is_bounded() -> None:
    assert DEC.decode(submit_frame(prompt="x", deadline_ms=p.MAX_DEADLINE_MS)).deadline_ms == p.MAX_DEADLINE_MS
    for bad in (0, p.MAX_DEADLINE_MS + 1, 2**64 - 1):
        refused(submit_frame(prompt="x", deadline_ms=bad), "deadline_ms")


def test_request_id_limits_and_echo() -> None:
    assert isinstance(DEC.decode(submit_frame(prompt="x", id="r" * 128)), p.Submit)
    bad = refused(submit_frame(prompt="x", id="r" * 129), "$.id")
    assert bad.id is None  # an id the router cannot use is not echoed
    bad = refused(submit_frame(prompt="x", sampling={"top_k": -1}))
    assert bad.id == "t"  # a readable id comes back with the error


def test_version_rules() -> None:
    for v in (0, 2, -1, 2**40):
        got = DEC.decode(msgpack.packb({"type": "status", "v": v}))
        assert isinstance(got, p.Invalid) and got.code == p.ErrorCode.UNSUPPORTED_VERSION and str(v) in got.reason
    for v in (1.0, "1", True, None):
        got = DEC.decode(msgpack.packb({"type": "status", "v": v}))
        assert isinstance(got, p.Invalid) and got.code == p.ErrorCode.BAD_REQUEST and "`v`" in got.reason
    got = DEC.decode(msgpack.packb({"type": "nope", "v": 1}))
    assert isinstance(got, p.Invalid) and got.code == p.ErrorCode.BAD_REQUEST and "unknown message type 'nope'" in got.reason


def test_unknown_fields_are_ignored() -> None:
    got = DEC.decode(submit_frame(prompt="x", future_field={"a": [1, 2]}, sampling={"future_knob": 3}))
    assert isinstance(got, p.Submit) and got.prompt == "x"
