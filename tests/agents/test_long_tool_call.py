"""Claude Code and Codex CLI complete a turn whose answer is a long tool call, without a reconnect (issue 47: Codex gave
up on a stream after 300 s of silence and sent the request again; a call is now streamed while it is written, and a
held stream sends each API's keep-alive).

The default model (270M) does not write a file of a few thousand tokens when asked, so the capture proxy makes the
turn's first model request force one: its tool_choice names the client's write tool (Claude Code's `Write`, Codex's
`exec_command`) and the text parameter gets a `minLength` of LONG_CHARS, which the grammar holds the model to. Codex
is told to give up on a stream silent for IDLE_S (its `stream_idle_timeout_ms`, 300 s by default) and never to retry:
a silent call that long fails the turn. The test checks the forced request was answered once, with a call, and that the
longest silence in its stream (the proxy's reads) stayed under IDLE_S.

It runs on the agents' server, from the agents' home (tests/agents/conftest.py): the agent's system prompt and tools,
up to the forced tool's schema, are computed once for this test and the two-turn one (Claude Code's `Write` is its last
tool). The server's cap leaves room for the long call; the client's other requests are capped as the two-turn test's
are (`real_agents.capped`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from capture import CaptureProxy
from real_agents import API_KEY, CLIENTS, SERVER_CAP, Conversation, capped, ending, fresh_home
from served import Served

pytestmark = pytest.mark.model

MODEL = "gemma-3-270m-q4_k_m"
LONG_CHARS = 1100  # 1.4-2 characters a token of the default model's (JSON-escaped): 7-10 s of writing on 2 cores
assert SERVER_CAP >= LONG_CHARS + 500  # (room for the longest call the schema allows, at least a character a token)
IDLE_S = 6
FORCED = {"claude-code": ("Write", "content"), "codex": ("exec_command", "cmd")}
PROMPT = "Write a long essay (a few thousand words) about rivers into the file essay.md."


def forcing(name: str) -> Any:
    """The proxy's rewrite: the first model request (the one with the tools) is made to call the write tool with a long
    text; the others pass unchanged but for that tool's schema, which stays as the forced request had it (the prompt
    renders the schema, so the next request reuses the whole of the one before)."""
    tool, param = FORCED[name]
    done: list[bool] = []

    def rewrite(path: str, body: dict[str, Any]) -> dict[str, Any]:
        tools = body.get("tools") or []
        if not any((t.get("name") or t.get("function", {}).get("name")) == tool for t in tools):
            return capped(path, body)
        body = json.loads(json.dumps(body))
        for t in body["tools"]:
            if (t.get("name") or t.get("function", {}).get("name")) != tool:
                continue
            schema = t.get("input_schema") or t.get("parameters") or t["function"]["parameters"]
            schema["properties"][param]["minLength"] = LONG_CHARS
            schema["properties"][param]["maxLength"] = LONG_CHARS + 500  # (then it ends, within the server's cap)
        if done:  # the long call was answered: the rest of the turn is the default model's noise, so it is ended
            return ending(path, capped(path, body))
        done.append(True)
        if name == "claude-code":
            body["tool_choice"] = {"type": "tool", "name": tool}
        else:
            body["tool_choice"] = {"type": "function", "name": tool}
        body["forced_by_test"] = True  # (a hint: counted, and marks the record)
        return body

    return rewrite


@pytest.mark.parametrize("name", list(FORCED))
def test_a_long_tool_call_completes_without_a_reconnect(
    name: str, agent_server: Served, agent_homes: Path, tmp_path: Path
) -> None:
    client = CLIENTS[name]
    why = client.installed()
    assert why is None, why
    proxy = CaptureProxy(agent_server.url, tmp_path / f"capture-{name}", rewrite=forcing(name)).start()
    try:
        conv = Conversation(client, proxy.url, API_KEY, MODEL, tmp_path, fresh_home(agent_homes, client))
        if name == "codex":  # give up on a silent stream after IDLE_S, and never send the request again
            path = conv.home / ".codex" / "config.toml"
            idle = f"stream_max_retries = 0\nstream_idle_timeout_ms = {IDLE_S * 1000}\n"
            path.write_text(path.read_text().replace("stream_max_retries = 0\n", idle))
        turn = conv.turn(1, PROMPT, proxy)
    finally:
        proxy.stop()
    forced = [r for r in turn.requests if isinstance(r["body"], dict) and r["body"].get("forced_by_test")]
    assert len(forced) == 1, [r["path"] for r in turn.requests]  # answered once: no reconnect, no retry
    reply = forced[0]["response"]
    print(json.dumps({"client": name, "rc": turn.rc, "errors": turn.errors, "forced": reply}, indent=1))
    assert reply["status"] == 200 and reply.get("longest_silence_s", 0) < IDLE_S, reply
    # the call came in pieces while it was written (held until whole, its first piece would come at the end)
    assert reply["total_s"] - reply["ttft_s"] > max(2 * reply["longest_silence_s"], 1.0), reply
    assert (reply.get("usage") or {}).get("output_tokens", 0) >= LONG_CHARS // 8, reply  # the long call, whole
    same = [r for r in turn.requests if r["body"] == forced[0]["body"]]
    assert len(same) == 1
    assert not turn.errors and (turn.rc == 0 or turn.cut), (turn.rc, turn.errors, turn.stderr[-400:])
    assert any(isinstance(r["body"], dict) and r["body"].get("ended_by_test") for r in turn.requests)  # the call ran
