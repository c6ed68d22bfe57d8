"""Unit tests (no model) of a request's session and priority (gateway/normalise.py): each client's signal read into
`Submit.session`, `parent_session` and `priority` in the documented precedence, on every generating API; over-long
and malformed values served, never refused; the service tier a reply names; /slots showing each slot's session."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_router import FakeRouter, client_for
from prometheus_client import REGISTRY

from gateway import anthropic, normalise, responses
from gateway.fields import Policy
from gateway.llama_helpers import slots_body
from gateway.openai_chat import chat_submit, completion_submit
from protocol import SlotStatus, StatusReply, Submit, WorkerStatus
from protocol.codec import client_request_decoder, encode

USER = [{"role": "user", "content": "hi"}]
UUID = "c31ac7cf-56a7-4c0a-b363-2b726377687d"
DEVICE = "e56b97a3504ae3c04ad0332730777bf378fb75c9ecff9802c098717565372a90"
LEGACY = f"user_{DEVICE}_account_0f1e2d3c-aaaa-bbbb-cccc-000000000000_session_{UUID}"  # Claude Code before 2.1
LEGACY_NO_ACCOUNT = f"user_{DEVICE}_account__session_{UUID}"  # (an API key's user: no account)
JSON_ID = json.dumps({"device_id": DEVICE, "account_uuid": "", "session_id": UUID})  # Claude Code 2.1 and later


def counted(api: str, field: str) -> float:
    return REGISTRY.get_sample_value("kvroute_request_fields_ignored_total", {"api": api, "field": field}) or 0.0


# ---- the values ------------------------------------------------------------------------------------------------


def test_clip_keeps_an_id_that_fits_and_digests_one_that_does_not() -> None:
    assert normalise.session_id("  abc \n") == "abc"
    assert normalise.session_id("") is None and normalise.session_id("   ") is None
    for garbage in (None, 12, 1.5, True, ["a"], {"a": "b"}):
        assert normalise.session_id(garbage) is None
    fits = "x" * normalise.SESSION_CHARS
    assert normalise.session_id(fits) == fits
    long_a, long_b = "y" * 300 + "a", "y" * 300 + "b"  # (one head: a cut alone would make them one session)
    a, b = normalise.session_id(long_a), normalise.session_id(long_b)
    assert a is not None and b is not None and a != b
    assert len(a) == len(b) == normalise.SESSION_CHARS and a.startswith("y" * 200)
    assert normalise.session_id(long_a) == a  # (the same id, the same session)
    assert normalise.session_id("a\ud800") == "a\\ud800"  # (a lone surrogate, as JSON may carry: its escape)
    assert len(normalise.session_id("\ud800" * 400) or "") == normalise.SESSION_CHARS
    wide = normalise.session_id("é" * 400)  # (characters, not bytes, as the protocol counts them)
    sub = Submit(prompt="p", session=a, parent_session=wide, priority=-1)
    assert client_request_decoder().decode(encode(sub)) == sub  # (the protocol takes them)
    sub.session = normalise.session_id("\udfff" * 300)
    assert client_request_decoder().decode(encode(sub)) == sub


@pytest.mark.parametrize(
    ("user_id", "session"),
    [
        (LEGACY, UUID),
        (LEGACY_NO_ACCOUNT, UUID),
        (JSON_ID, UUID),
        (json.dumps({"session_id": UUID, "device_id": DEVICE}, indent=2), UUID),
        (json.dumps({"device_id": DEVICE}), json.dumps({"device_id": DEVICE})),  # no session_id: the whole id
        (json.dumps({"device_id": DEVICE, "session_id": 7}), json.dumps({"device_id": DEVICE, "session_id": 7})),
        (json.dumps({"session_id": "  "}), json.dumps({"session_id": "  "})),
        ("{not json", "{not json"),
        ("[1, 2]", "[1, 2]"),
        ("{" * 5000, "{" * 5000),  # (nested too deep for the parser: taken whole, then digested)
        ("user_abc_session_", "user_abc_session_"),  # (no session after the marker)
        ("alice@example.com", "alice@example.com"),  # any other user id: taken whole
        ("user_1234", "user_1234"),
    ],
)
def test_claude_code_user_ids_give_their_session(user_id: str, session: str) -> None:
    assert normalise.claude_user_id(user_id) == session


def test_openai_tiers_and_the_priority_header_map_onto_priority() -> None:
    policy = Policy("chat")
    tiers = {"priority": 1, "flex": -1, "auto": 0, "default": 0, "scale": 0, None: 0}
    assert {t: normalise.priority_of(t, normalise.OPENAI_TIERS, policy) for t in tiers} == tiers
    assert policy.ignored == []
    assert normalise.priority_of("turbo", normalise.OPENAI_TIERS, policy) == 0  # unknown: a hint, served at 0
    assert normalise.priority_of(3, normalise.OPENAI_TIERS, policy) == 0
    assert policy.ignored == ["service_tier"]
    anthropic_policy = Policy("messages")
    for tier in ("auto", "standard_only"):
        assert normalise.priority_of(tier, normalise.ANTHROPIC_TIERS, anthropic_policy) == 0
    assert anthropic_policy.ignored == []
    assert normalise.priority_of("priority", normalise.ANTHROPIC_TIERS, anthropic_policy) == 0  # (not Anthropic's name)
    assert anthropic_policy.ignored == ["service_tier"]
    for said, priority in (("interactive", 1), ("Normal", 0), (" background ", -1)):
        assert normalise.SessionHeaders.read({"x-priority": said}, Policy("chat")).priority == priority
    policy = Policy("chat")
    assert normalise.SessionHeaders.read({"x-priority": "urgent"}, policy).priority is None
    assert policy.ignored == ["header:x-priority"]
    assert [normalise.TIERS[p] for p in (1, 0, -1)] == ["priority", "default", "flex"]


# ---- each API's body -------------------------------------------------------------------------------------------


def test_openai_bodies_give_their_session_in_precedence() -> None:
    full = {"prompt_cache_key": "pck", "user": "u", "safety_identifier": "si"}
    for drop, want in (((), "pck"), (("prompt_cache_key",), "u"), (("prompt_cache_key", "user"), "si")):
        fields = {k: v for k, v in full.items() if k not in drop}
        chat, _, _ = chat_submit({"messages": USER, **fields}, "r")
        completion, _, _ = completion_submit({"prompt": "hi", **fields}, "r")
        response, _, _ = responses.responses_submit({"input": "hi", **fields}, "r")
        assert chat.session == completion.session == response.session == want, drop
    sub, _, _ = chat_submit({"messages": USER, "prompt_cache_key": "", "user": "  ", "safety_identifier": "si"}, "r")
    assert sub.session == "si"  # (empty values are not sessions)
    sub, _, _ = chat_submit({"messages": USER}, "r")
    assert (sub.session, sub.parent_session, sub.priority) == (None, None, 0)


def test_anthropic_metadata_gives_claude_code_s_session() -> None:
    body: dict[str, Any] = {"messages": USER, "max_tokens": 5}
    for user_id, want in ((LEGACY, UUID), (JSON_ID, UUID), ("alice", "alice"), ("", None)):
        sub, _ = anthropic.messages_submit({**body, "metadata": {"user_id": user_id}}, "r")
        assert sub.session == want, user_id
    sub, _ = anthropic.messages_submit({**body, "metadata": {}}, "r")
    assert sub.session is None
    sub, _ = anthropic.messages_submit({**body, "metadata": {"user_id": "x" * 5000}}, "r")
    assert sub.session is not None and len(sub.session) == normalise.SESSION_CHARS
    sub, _ = anthropic.messages_submit({**body, "service_tier": "standard_only"}, "r")
    assert sub.priority == 0


@pytest.mark.parametrize(
    ("api", "submit", "body", "garbage", "hinted"),
    [
        ("chat", chat_submit, {"messages": USER}, {"user": 12, "prompt_cache_key": ["x"], "service_tier": {}}, 3),
        ("completions", completion_submit, {"prompt": "hi"}, {"safety_identifier": 1.5, "service_tier": "turbo"}, 2),
        ("responses", responses.responses_submit, {"input": "hi"}, {"user": {"id": 1}, "prompt_cache_key": True}, 2),
        ("messages", anthropic.messages_submit, {"messages": USER, "max_tokens": 5}, {"metadata": "x", "service_tier": 1}, 2),
        ("messages", anthropic.messages_submit, {"messages": USER, "max_tokens": 5}, {"metadata": {"user_id": 5}}, 1),
    ],
)
def test_malformed_signals_are_hints_never_refusals(
    api: str, submit: Any, body: dict[str, Any], garbage: dict[str, Any], hinted: int
) -> None:
    for strict in (False, True):
        policy = Policy(api, strict=strict)
        sub = submit({**body, **garbage}, "r", policy)[0]
        assert sub.session is None and sub.priority == 0
        assert len(policy.ignored) == hinted and set(policy.ignored) <= {*garbage, "service_tier"}, policy.ignored
    before = counted(api, "service_tier")
    policy = Policy(api)
    submit({**body, "service_tier": 42}, "r", policy)
    policy.report("r")
    assert counted(api, "service_tier") == before + 1  # (a name of the metric's fixed set, not `other`)


def test_anthropic_metadata_keeps_its_user_id_beside_fields_it_does_not_know() -> None:
    policy = Policy("messages")
    body = {"messages": USER, "max_tokens": 5, "metadata": {"user_id": LEGACY, "trace": "t1"}}
    sub, _ = anthropic.messages_submit(body, "r", policy)
    assert sub.session == UUID and policy.ignored == ["metadata.trace"]
    tokens = anthropic.count_tokens_request({"messages": USER, "metadata": {"user_id": LEGACY}}, Policy("messages", strict=True))
    assert tokens.messages  # (count_tokens takes the same metadata, even with --strict-api)


# ---- over HTTP: the headers on top, and the tier a reply names ---------------------------------------------------

CLAUDE_HEADER = {"x-claude-code-session-id": "cc-session"}


@pytest.mark.anyio
async def test_headers_come_first_on_every_api() -> None:
    fake = FakeRouter()
    requests = [
        ("/v1/chat/completions", {"messages": USER, "prompt_cache_key": "pck", "user": "u"}),
        ("/v1/completions", {"prompt": "hi", "prompt_cache_key": "pck"}),
        ("/v1/responses", {"input": "hi", "prompt_cache_key": "pck"}),
        ("/v1/messages", {"messages": USER, "max_tokens": 5, "metadata": {"user_id": LEGACY}}),
    ]
    async with client_for(fake) as c:
        for path, body in requests:
            for headers, want in (
                ({}, "pck" if "prompt_cache_key" in body else UUID),
                (CLAUDE_HEADER, "cc-session"),
                ({**CLAUDE_HEADER, "x-session-id": "ours"}, "ours"),
                ({**CLAUDE_HEADER, "x-session-id": "  "}, "cc-session"),  # (an empty header says nothing)
                ({"x-session-id": "z" * 1000}, normalise.session_id("z" * 1000)),
            ):
                r = await c.post(path, json=body, headers=headers)
                assert r.status_code == 200, (path, r.text)
                assert fake.submits[-1].session == want, (path, headers)
            r = await c.post(path, json=body, headers={"x-parent-session-id": "lead", "x-priority": "background"})
            assert (fake.submits[-1].parent_session, fake.submits[-1].priority) == ("lead", -1)


@pytest.mark.anyio
async def test_the_priority_header_comes_before_service_tier() -> None:
    fake = FakeRouter()
    chat = {"messages": USER, "max_tokens": 2}
    async with client_for(fake) as c:
        for tier, header, want in (
            ("priority", None, 1),
            ("flex", None, -1),
            ("default", None, 0),
            ("auto", None, 0),
            ("flex", "interactive", 1),
            ("priority", "normal", 0),
            ("priority", "bogus", 1),  # (an unknown header: a hint, the body's tier stands)
            (None, "background", -1),
        ):
            headers = {"x-priority": header} if header else {}
            body = {**chat, "service_tier": tier} if tier else chat
            r = await c.post("/v1/chat/completions", json=body, headers=headers)
            assert r.status_code == 200 and fake.submits[-1].priority == want, (tier, header)
            if tier is not None:  # (OpenAI's reply names the tier applied when the request names one)
                assert r.json()["service_tier"] == normalise.TIERS[want]
            else:
                assert "service_tier" not in r.json()


@pytest.mark.anyio
async def test_replies_name_the_tier_applied_streamed_or_not() -> None:
    fake = FakeRouter()
    async with client_for(fake) as c:
        r = await c.post("/v1/chat/completions", json={"messages": USER, "service_tier": "flex", "stream": True})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert chunks and all(chunk["service_tier"] == "flex" for chunk in chunks)
        r = await c.post("/v1/chat/completions", json={"messages": USER, "stream": True})
        assert '"service_tier"' not in r.text
        r = await c.post("/v1/responses", json={"input": "hi", "service_tier": "priority"})
        assert r.json()["service_tier"] == "priority"
        r = await c.post("/v1/responses", json={"input": "hi", "service_tier": "auto"}, headers={"x-priority": "background"})
        assert r.json()["service_tier"] == "flex"
        r = await c.post("/v1/responses", json={"input": "hi", "service_tier": "flex", "stream": True})
        created = json.loads(r.text.split("data: ", 2)[1].split("\n")[0])
        assert created["type"] == "response.created" and created["response"]["service_tier"] == "flex"
        assert '"service_tier"' not in (await c.post("/v1/responses", json={"input": "hi"})).text
        r = await c.post("/v1/completions", json={"prompt": "hi", "service_tier": "flex"})
        assert r.status_code == 200 and fake.submits[-1].priority == -1  # (honoured; the Completion object has no tier)


@pytest.mark.anyio
async def test_an_unknown_priority_header_is_counted_as_a_hint() -> None:
    before = counted("messages", "header:x-priority")
    async with client_for(FakeRouter()) as c:
        r = await c.post("/v1/messages", json={"messages": USER, "max_tokens": 5}, headers={"x-priority": "now!"})
    assert r.status_code == 200 and counted("messages", "header:x-priority") == before + 1


@pytest.mark.anyio
async def test_with_several_keys_only_the_keys_named_may_go_first() -> None:
    """One key's requests would go before everyone else's, and pause their jobs on their worker: with several keys a
    higher priority is only for the keys --priority-keys names (all with one key, or with `all`); another key's ask
    is served at 0, counted as a hint; asking a lower one is every key's right."""

    async def priorities(keys: str, priority_keys: str, key: str) -> list[int]:
        fake = FakeRouter()
        async with client_for(fake, keys, priority_keys=priority_keys) as c:
            auth = {"authorization": f"Bearer {key}"}
            for headers in ({"x-priority": "interactive"}, {"x-priority": "background"}):
                r = await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, headers={**auth, **headers})
                assert r.status_code == 200
            r = await c.post("/v1/chat/completions", json={"messages": USER, "service_tier": "priority"}, headers=auth)
            assert r.json()["service_tier"] == normalise.TIERS[fake.submits[-1].priority]  # (the tier applied)
        return [s.priority for s in fake.submits]

    before = counted("chat", "priority")
    assert await priorities("only", "", "only") == [1, -1, 1]  # (one key: it is everyone)
    assert await priorities("a,b", "", "a") == [0, -1, 0]
    assert counted("chat", "priority") == before + 2
    assert await priorities("a,b", "b", "b") == [1, -1, 1] and await priorities("a,b", "b", "a") == [0, -1, 0]
    assert await priorities("a,b", "all", "a") == [1, -1, 1]
    with pytest.raises(ValueError, match="1 key"):
        client_for(FakeRouter(), "a,b", priority_keys="c")


# ---- /slots ----------------------------------------------------------------------------------------------------


def test_slots_show_each_slot_s_session_and_how_long_it_is_awaited() -> None:
    slots = [
        SlotStatus(slot=0, busy=False, n_tokens=900, session=UUID, awaited_s=42.5),
        SlotStatus(slot=1, busy=False, n_tokens=0),
    ]
    worker = WorkerStatus(worker="w0", incarnation=1, device="cpu", state="ready", queue=0, slots=slots)
    body = slots_body(StatusReply(model="m", policy="prefix", queued=0, workers=[worker]))
    first, second = body["workers"][0]["slots"]
    assert (first["session"], first["awaited_s"]) == (UUID, 42.5)
    assert (second["session"], second["awaited_s"]) == (None, 0.0)


@pytest.mark.anyio
async def test_a_session_the_protocol_could_not_carry_is_served() -> None:
    fake = FakeRouter()
    body = b'{"messages": [{"role": "user", "content": "hi"}], "user": "me\\ud800", "prompt_cache_key": "   "}'
    async with client_for(fake) as c:
        r = await c.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert fake.submits[-1].session == "me\\ud800"
    encode(fake.submits[-1])  # (what the router is sent: msgpack, which takes no lone surrogate)
