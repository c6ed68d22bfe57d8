"""bench.agent_sessions without a model: the traffic's shape against a stand-in server that counts words as tokens,
and the figures (new and recomputed tokens) from what each reply says it computed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from bench.agent_sessions import Conversation, Run, Sent, Traffic, figures, new_tokens, summarize, words


class StandIn:
    """A server whose tokens are words and which keeps each conversation's last prompt + reply (`forget`: none of
    those of these sessions); a conversation is a session and a system prompt (a sub-agent sends its parent's
    session)."""

    def __init__(self, forget: set[str] | None = None) -> None:
        self.kept: dict[tuple[str, str], int] = {}
        self.forget = forget or set()
        self.sessions: list[tuple[str, str | None]] = []  # (session, service_tier) of each request
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        session = request.headers["x-session-id"]
        self.sessions.append((session, body.get("service_tier")))
        self.bodies.append(body)
        conversation = (session, body["messages"][0]["content"])
        prompt = sum(len((m["content"] or "").split()) for m in body["messages"])
        forgotten = session in self.forget and body["messages"][0]["content"].startswith(PARENT_SYSTEM)
        cached = 0 if forgotten else min(self.kept.get(conversation, 0), prompt)
        self.kept[conversation] = prompt + 2
        usage = {"prompt_tokens": prompt, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": cached}}
        message: dict[str, Any] = {"content": "ok then"}
        if body.get("tool_choice"):  # (a forced call, as the server is asked)
            call = {"name": body["tool_choice"]["function"]["name"], "arguments": '{"command": "ls"}'}
            message = {"content": None, "tool_calls": [{"id": f"call_{len(self.bodies)}", "type": "function", "function": call}]}
        return httpx.Response(200, json={"choices": [{"message": message}], "usage": usage})


def run(server: StandIn, traffic: Traffic) -> dict[str, Any]:
    r = Run("http://stand-in", "m", traffic, transport=httpx.MockTransport(server))
    wall = asyncio.run(r.run())
    return summarize(r.conversations, wall)


PARENT_SYSTEM = words("parent/system", 300)
SMALL = Traffic(parent_words=300, sub_words=150, other_words=150, tool_wait_s=0.0, user_words=10, result_words=20)


def test_the_parent_starts_its_sub_agents_on_its_spawn_turns_beside_the_others() -> None:
    server = StandIn()
    f = run(server, SMALL)
    assert f["parent"]["requests"] == 5 and f["sub"]["requests"] == 2 * 3 * 3 and f["everyone"]["failed"] == 0
    # the parent and its sub-agents send the parent's session and the priority tier; the others neither
    assert server.sessions.count(("parent", "priority")) == 5 + 2 * 3 * 3
    assert all(tier is None for session, tier in server.sessions if session != "parent")
    assert f["other"]["requests"] >= 2  # each other user spoke at least once while the parent ran
    # a server that keeps every session's history computes exactly the new tokens: nothing recomputed
    assert f["parent"]["recomputed"] == 0 and f["parent"]["computed"] == f["parent"]["new"]


def test_a_server_that_forgets_the_parent_recomputes_its_history() -> None:
    f = run(StandIn(forget={"parent"}), SMALL)
    assert f["parent"]["computed"] == f["parent"]["sent"] and f["parent"]["recomputed"] > 0
    assert f["sub"]["recomputed"] == 0


def test_new_tokens_are_those_past_the_previous_prompt_and_reply() -> None:
    conv = Conversation("c", "parent")
    conv.sent = [Sent("c", "parent", 1, 100, 100, 5, 1.0, 200), Sent("c", "parent", 2, 130, 130, 5, 1.0, 200)]
    new_tokens([conv])
    assert [s.new for s in conv.sent] == [100, 25]
    assert figures(conv.sent)["recomputed"] == 105  # the second computed its whole prompt: 105 of it was history


def test_words_are_the_same_for_the_same_seed() -> None:
    assert words("parent/system", 50) == words("parent/system", 50) != words("other-1/system", 50)
    assert len(words("x", 50).split()) == 50


def test_with_calls_the_agents_replies_are_calls_and_their_results_tool_messages() -> None:
    server = StandIn()
    f = run(server, Traffic(**{**SMALL.__dict__, "calls": True}))
    assert f["calls"] == 5 + 2 * 3 * 3 and f["everyone"]["failed"] == 0
    agents = [b for b in server.bodies if b.get("tools")]
    assert len(agents) == 5 + 2 * 3 * 3 and all(b["tool_choice"]["function"]["name"] == "run" for b in agents)
    later = [b for b in agents if len(b["messages"]) > 2]  # (every request after a conversation's first)
    for b in later:  # the last reply was a call: its result comes back as the tool message answering it
        *_, call, result = b["messages"]
        assert call["role"] == "assistant" and result == {**result, "role": "tool", "tool_call_id": call["tool_calls"][0]["id"]}
    others = [b for b in server.bodies if not b.get("tools")]
    assert others and all(m["role"] != "tool" for b in others for m in b["messages"])  # (the other users only talk)
