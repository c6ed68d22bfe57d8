"""Claude Code and Codex CLI against a reasoning family: the reasoning a model writes passes through them unharmed
(issue 47). One `kvroute serve` holds a tiny random-weight GGUF with Qwen 3's template (hermes calls, `<think>` that
the model opens itself), whose weights are made to write `<think>the weather</think>paris<|im_end|>` after any prompt
(bench/tiny_chat.py's `says`: noise would never close its thinking nor end its turn), and whose vocabulary has a token
for each word of the agents' recorded requests (Claude Code's prompt, 44k tokens byte by byte, is 14k so).

Each agent runs two turns through the capture proxy. From the traffic: turn 1's reply carried the reasoning as the API's
reasoning object (Anthropic `thinking` block, Responses reasoning item; Claude Code asks `thinking.display: "omitted"`,
so its blocks carry the reasoning in their signature, their text empty) and only the answer as reply text; the agent
showed the answer as its result and exited cleanly; turn 2 sent the reasoning back where the client does (both do: a
`thinking` block, a reasoning item) and reused all of turn 1's prompt from the cache (not its reply: Qwen 3's template
drops a past turn's thinking, so turn 2 differs from turn 1's from the reply's `<think>` on)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from real_agents import API_KEY, CLIENTS, FIXTURES, Turn, prompt_tokens, run_conversation
from served import Served

from bench.tiny_chat import chat_model
from gateway.anthropic import signed_thinking

pytestmark = pytest.mark.model

MODEL = "qwen3-thinking"
TEMPLATE = "Qwen-Qwen3-0.6B"
REASONING, ANSWER = "the weather", "paris"
# after the generation prompt's last token (a newline), whatever the prompt
SAYS = ["Ċ", "<think>", "the", "Ġweather", "</think>", "paris", "<|im_end|>"]
# Qwen 3.5 (its prompt opens the thinking itself): Codex's requests do not render with its template
QWEN35, QWEN35_SAYS = "qwen3.5-thinking", ["Ċ", "the", "Ġweather", "</think>", "paris", "<|im_end|>"]
AGENTS = ["claude-code", "codex"]
SERVE_FLAGS = ("--workers", "1", "--slots", "2", "--ctx-per-slot", "32768", "--max-tokens", "64", "--threads", "2")


def agent_words() -> list[str]:
    """Each word of the agents' recorded requests (tests/fixtures/agents), once."""
    words: dict[str, None] = {}
    for name in AGENTS:
        recorded = sorted((FIXTURES / f"{name}-{CLIENTS[name].version}").glob("*.json"))
        assert recorded, f"no recorded requests of {name} {CLIENTS[name].version} (tests/agents/real_agents.py records them)"
        for path in recorded:
            words |= dict.fromkeys(re.findall(r"[A-Za-z]+", path.read_text()))
    return list(words)


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = Path(tmp_path_factory.mktemp("reasoning-family"))
    words = agent_words()
    model = chat_model(tmp / "qwen3-thinking.gguf", TEMPLATE, n_ctx=32768, says=SAYS, words=words)
    qwen35 = chat_model(tmp / "qwen35-thinking.gguf", "Qwen3.5-4B", n_ctx=32768, says=QWEN35_SAYS, words=words)
    models = ("--model", f"{MODEL}={model}", "--model", f"{QWEN35}={qwen35}")
    s = Served(*models, *SERVE_FLAGS, api_key=API_KEY, log=tmp / "serve.log")
    yield s
    s.stop()


def model_requests(turn: Turn, api: str) -> list[dict[str, Any]]:
    return [r for r in turn.requests if r["method"] == "POST" and r["path"].startswith(api)]


def sent_back(name: str, body: dict[str, Any]) -> list[str]:
    """The reasoning a request carries from earlier replies, as that client's API writes it."""
    if name == "claude-code":
        replies = [m["content"] for m in body["messages"] if m["role"] == "assistant" and isinstance(m["content"], list)]
        blocks = [b for content in replies for b in content]
        return [b["thinking"] or signed_thinking(b.get("signature", "")) or "" for b in blocks if b.get("type") == "thinking"]
    items = [i for i in body["input"] if isinstance(i, dict) and i.get("type") == "reasoning"]
    return ["".join(p.get("text", "") for p in (i.get("content") or []) + (i.get("summary") or [])) for i in items]


def shown(name: str, turn: Turn) -> str:
    """What the agent itself reported as the turn's answer."""
    events = [json.loads(line) for line in turn.stdout.splitlines() if line.strip().startswith("{")]
    if name == "claude-code":
        return next(e["result"] for e in events if e.get("type") == "result")
    items = [e["item"] for e in events if e.get("type") == "item.completed"]
    return "".join(i.get("text", "") for i in items if i.get("type") == "agent_message")


@pytest.mark.parametrize("name", AGENTS)
def test_reasoning_passes_through_the_agent_and_turn_2_reuses_turn_1(name: str, thinking_server: Served, tmp_path: Path) -> None:
    client = CLIENTS[name]
    why = client.installed()
    assert why is None, why
    _, turns, _ = run_conversation(client, thinking_server.url, API_KEY, MODEL, tmp_path)
    report = {"client": f"{client.package}@{client.version}", "turns": [t.summary() for t in turns]}
    print(json.dumps(report, indent=1))
    for n, t in enumerate(turns, 1):
        assert not t.errors and not t.cut and t.rc == 0, (n, t.rc, t.errors, t.cut, t.stderr[-600:])
        posts = model_requests(t, client.api)
        assert posts and all(r["response"]["status"] == 200 for r in posts), [r["response"] for r in posts]
        for r in posts:  # the reasoning came as the API's reasoning object (unless omitted), the answer alone as text
            said = (r["response"]["reasoning"], r["response"]["text"])
            omitted = (r["body"].get("thinking") or {}).get("display") == "omitted"
            assert said == ("" if omitted else REASONING, ANSWER), (r["n"], said)
        assert shown(name, t).strip() == ANSWER, (n, t.stdout[-2000:])

    main = [max(model_requests(t, client.api), key=lambda r: prompt_tokens(r)[0]) for t in turns]
    assert REASONING in sent_back(name, main[1]["body"]), json.dumps(main[1]["body"])[-3000:]
    first, reused = prompt_tokens(main[0])[0], prompt_tokens(main[1])[1]
    assert first > 5000, main[0]["response"]  # the agent's own system prompt and tools, not a stub
    assert reused >= first, (reused, first, main[1]["response"])


def test_codex_requests_render_with_qwen35(thinking_server: Served) -> None:
    """Codex sends its instructions as two developer messages (two system messages); Qwen 3.5's template raises "System
    message must be at the beginning." at the second, so they are merged into one (chat/template.py)."""
    body = json.loads((FIXTURES / f"codex-{CLIENTS['codex'].version}" / "001.json").read_text())["body"]
    body |= {"model": QWEN35, "stream": False}
    r = httpx.post(f"{thinking_server.url}/v1/responses", json=body, headers=thinking_server.headers, timeout=300)
    assert r.status_code == 200, r.text[:400]
    said = [i for i in r.json()["output"] if i["type"] == "reasoning"]
    assert said and said[0]["content"][0]["text"] == REASONING, r.json()["output"]
    usage = r.json()["usage"]  # the thinking's tokens (its tags too) counted apart from the answer's
    assert 0 < usage["output_tokens_details"]["reasoning_tokens"] < usage["output_tokens"], usage
