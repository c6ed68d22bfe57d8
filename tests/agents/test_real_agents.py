"""The real coding agents, pinned in package.json (npm) and requirements.txt (PyPI) and installed by scripts/test, run two
turns each against a real `kvroute serve`: the first completes with no API error (every model request answered 200 and
its reply ended with its usage), the second resumes the session and is served from the first one's cached prefix (all of
it, or where the second request does not start with the first's whole prompt, all the two share). The one error a client
may report is its own for replies cut at the output cap (`Client.cut_at_cap`; REPLY_CAP tokens, set by the capture
proxy: `real_agents.capped`): the default model seldom ends a reply by itself. The default model answers an agent's
prompt with a tool call, often cut at the cap, and at temperature 0 writes the same call again whatever the agent sends
back: so once the agent sends a tool's result back, the capture proxy makes that request end the turn
(`real_agents.one_tool_round`). Each turn's figures (TTFT, prompt tokens, of them cached) are printed and written to
`$KVROUTE_AGENT_RESULTS` (JSON) when that is set."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from real_agents import API_KEY, CLIENTS, Turn, fresh_home, prompt_tokens, pypi_python, run_conversation
from served import Served

pytestmark = pytest.mark.model

MODEL = "gemma-3-270m-q4_k_m"


@pytest.mark.parametrize("name", list(CLIENTS))
def test_agent_runs_two_turns_the_second_from_cache(name: str, agent_server: Served, agent_homes: Path, tmp_path: Path) -> None:
    client = CLIENTS[name]
    why = client.installed()
    if why and client.pypi and pypi_python() is None:
        pytest.skip(f"{client.package} needs Python 3.10-3.12, and this machine has none: {why}")
    assert why is None, why
    _, turns, _ = run_conversation(client, agent_server.url, API_KEY, MODEL, tmp_path, fresh_home(agent_homes, client))
    first, second = (t.summary() for t in turns)
    report = {"client": f"{client.package}@{client.version}", "turn_1": first, "turn_2": second}
    print(json.dumps(report, indent=1))
    if os.environ.get("KVROUTE_AGENT_RESULTS"):
        with open(os.environ["KVROUTE_AGENT_RESULTS"], "a") as f:
            f.write(json.dumps(report) + "\n")
    for n, t in enumerate((first, second), 1):
        assert not t["errors"], f"turn {n} of {name}: {t['errors']}"
        assert t["rc"] == 0 or t["cut_at_cap"], f"turn {n} of {name} exited {t['rc']}"
        posts = [r for r in turns[n - 1].requests if r["method"] == "POST" and r["path"].startswith(client.api)]
        assert posts and all(r["response"]["status"] == 200 for r in posts), f"turn {n}: {t['statuses']}"
        # its usage, or for a stream that did not ask for it (aider's), llama-server's timings
        reported = all(r["response"]["usage"] or r["response"].get("timings") for r in posts)
        assert reported, f"turn {n}: a reply ended without its usage"
    if client.whole_history:
        # the first turn's long prefix (system prompt, tools, the first exchange) is reused by the second
        assert first["main"]["prompt_tokens"] > 1000, first
        assert second["main"]["cached_tokens"] >= 0.8 * first["main"]["prompt_tokens"], (first["main"], second["main"])
    else:
        # the second turn starts with what its main request shares with the first's, all of it from cache
        shared = shared_prefix_tokens(agent_server.url, *(main_request(t) for t in turns))
        assert shared > 0.3 * first["main"]["prompt_tokens"], (shared, first["main"])
        assert second["main"]["cached_tokens"] >= shared - 1, (shared, second["main"])


def main_request(turn: Turn) -> dict[str, Any]:
    """The turn's longest model request (the one `Turn.summary` calls main)."""
    return max((r for r in turn.requests if r.get("method") == "POST"), key=lambda r: prompt_tokens(r)[0])


def shared_prefix_tokens(url: str, a: dict[str, Any], b: dict[str, Any]) -> int:
    """How many tokens the prompts of two chat requests share from the start, rendered and tokenized by the server."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = []
    for r in (a, b):
        body = {k: r["body"][k] for k in ("messages", "tools") if k in r["body"]}
        prompt = httpx.post(f"{url}/apply-template", json=body, headers=headers, timeout=60).json()["prompt"]
        got = httpx.post(f"{url}/tokenize", json={"content": prompt, "add_special": False}, headers=headers, timeout=60)
        tokens.append(got.json()["tokens"])
    return next((i for i, (x, y) in enumerate(zip(*tokens, strict=False)) if x != y), min(map(len, tokens)))
