"""Property-based HTTP test: requests generated from the served OpenAPI schema never get a 500."""

from __future__ import annotations

import copy

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from served import Served

from gateway.openapi import OPENAPI


def bounded_schema() -> dict:
    """The served schema with generation kept short (max_tokens <= 4, prompts short) so the run takes seconds."""
    schema = copy.deepcopy(OPENAPI)
    short = {"type": "integer", "minimum": 1, "maximum": 4}
    for name, field in (
        ("CompletionRequest", "max_tokens"),
        ("ChatRequest", "max_tokens"),
        ("ResponsesRequest", "max_output_tokens"),
        ("MessagesRequest", "max_tokens"),
    ):
        body = schema["components"]["schemas"][name]
        body["properties"][field] = short
        body["properties"].pop("max_completion_tokens", None)
        body["required"] = sorted({*body.get("required", []), field})
    return schema


schema = schemathesis.openapi.from_dict(bounded_schema())


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory):
    """A server of its own that caps every reply at 16 tokens (`--max-tokens`): schemathesis also sends requests without
    a max_tokens (or with null), which are valid and would otherwise write up to the slot's 1024 tokens (33 s each on
    2 cores). Statuses are what this test checks, not lengths."""
    log = tmp_path_factory.mktemp("schemathesis") / "serve.log"
    s = Served("--workers", "1", "--slots", "2", "--ctx-per-slot", "1024", "--threads", "2", "--queue-size", "2",
               "--hold-ms", "0", "--max-tokens", "16", api_key="schemathesis-key", log=log)  # fmt: skip
    try:
        with httpx.Client(base_url=s.url, headers=s.headers, timeout=120) as client:
            assert client.get("/openapi.json").json() == OPENAPI  # what we fuzz from is what is served
        yield s
    finally:
        s.stop()


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_500_for_generated_requests(case, session: Served) -> None:
    response = case.call(base_url=session.url, headers=session.headers, timeout=120)
    # 503 and 529 (no worker; 529 is Anthropic's) and 504 (a generated deadline_ms of 1 ms) are answers; a 500 is a bug.
    assert response.status_code < 500 or response.status_code in (503, 504, 529), (
        case.method,
        case.path,
        case.body,
        response.text[:500],
    )
