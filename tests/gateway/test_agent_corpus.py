"""Every request the real coding agents sent (captured by tests/agents/real_agents.py into tests/fixtures/agents/),
replayed against the gateway with a stand-in router (no model): each model request is served, every other request
gets what it got from the real server, and every field the gateway ignored is one the field table names as a hint,
so no field these clients send is unknown to it."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from fake_router import FakeRouter, client_for
from prometheus_client import REGISTRY

from gateway.fields import labels

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "agents"
MODEL_APIS = {
    "/v1/messages": "messages",
    "/v1/responses": "responses",
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
}
DROP_HEADERS = {"host", "content-length", "authorization", "x-api-key", "accept-encoding", "connection"}


def records() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(CORPUS.glob("*/[0-9][0-9][0-9].json")):
        out.append((f"{path.parent.name}/{path.stem}", json.loads(path.read_text())))
    return out


def ignored() -> dict[tuple[str, str], float]:
    counts: dict[tuple[str, str], float] = {}
    for metric in REGISTRY.collect():
        for s in metric.samples:
            if s.name == "kvroute_request_fields_ignored_total":
                counts[(s.labels["api"], s.labels["field"])] = s.value
    return counts


def test_the_corpus_has_every_agent_each_with_two_turns() -> None:
    clients = {json.loads(m.read_text())["client"]: json.loads(m.read_text()) for m in CORPUS.glob("*/manifest.json")}
    assert {"claude-code", "codex", "opencode", "qwen-code", "pi", "copilot", "copilot-responses", "aider", "cline"} <= set(
        clients
    )
    for name, manifest in clients.items():
        assert len(manifest["turns"]) == 2, name
        # (a client may give up on replies cut at the server's output cap, exiting 1: tests/agents/real_agents.py)
        assert all((t["rc"] == 0 or t.get("cut_at_cap")) and not t["errors"] for t in manifest["turns"]), (
            name,
            manifest["turns"],
        )


@pytest.mark.anyio
@pytest.mark.parametrize(("name", "record"), records(), ids=[n for n, _ in records()])
async def test_a_captured_request_is_served_and_its_ignored_fields_are_in_the_table(name: str, record: dict[str, Any]) -> None:
    path = record["path"].split("?")[0]
    api = MODEL_APIS.get(path)
    headers = {k: v for k, v in record["headers"].items() if k.lower() not in DROP_HEADERS}
    body = record["body"]
    before = ignored()
    async with client_for(FakeRouter()) as c:
        content = json.dumps(copy.deepcopy(body)).encode() if body is not None else None
        r = await c.request(record["method"], record["path"], headers=headers, content=content)
    if api is None or record["method"] != "POST":
        assert r.status_code == record["response"]["status"], (name, r.status_code, r.text[:300])
        return
    assert r.status_code == 200, (name, r.text[:500])
    fields = {field for (a, field), v in ignored().items() if v > before.get((a, field), 0.0) and a == api}
    unknown = fields - labels(api)  # (`other`: the request_fields_ignored log line names them)
    assert not unknown, f"{name}: fields the table does not name: {sorted(unknown)}"
