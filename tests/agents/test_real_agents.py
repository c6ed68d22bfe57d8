"""The real coding agents, pinned in package.json and installed by scripts/test, run two turns each against a real
`kvroute serve`: the first completes with no API error (every model request answered 200 and its reply ended with
its usage), the second resumes the session and is served from the first one's cached prefix. The one error a
client may report is its own for replies cut at the server's output cap (`Client.cut_at_cap`): the default model
seldom ends a reply by itself. Each turn's figures (TTFT, prompt tokens, of them cached) are printed and written to
`$KVROUTE_AGENT_RESULTS` (JSON) when that is set."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from real_agents import API_KEY, CLIENTS, run_conversation
from served import Served

pytestmark = pytest.mark.model

MODEL = "gemma-3-270m-q4_k_m"


@pytest.mark.parametrize("name", list(CLIENTS))
def test_agent_runs_two_turns_the_second_from_cache(name: str, agent_server: Served, tmp_path: Path) -> None:
    client = CLIENTS[name]
    why = client.installed()
    assert why is None, why
    _, turns, _ = run_conversation(client, agent_server.url, API_KEY, MODEL, tmp_path)
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
        assert all(r["response"]["usage"] for r in posts), f"turn {n}: a reply ended without its usage"
    # the first turn's long prefix (system prompt, tools, the first exchange) is reused by the second
    assert first["main"]["prompt_tokens"] > 1000, first
    assert second["main"]["cached_tokens"] >= 0.8 * first["main"]["prompt_tokens"], (first["main"], second["main"])
