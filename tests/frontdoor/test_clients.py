"""The Node.js example client and the kvroute CLI against the same real server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from served import Served

NODE_DIR = Path(__file__).resolve().parents[2] / "examples" / "node"


def test_node_client_streams_text(served: Served) -> None:
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules" / "zeromq").exists():
        pytest.fail("node and examples/node/node_modules are required: ./scripts/test installs them (npm ci)")
    out = subprocess.run(
        [node, "client.mjs", "The quick brown fox", "--endpoint", served.zmq, "--max-tokens", "8"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stderr.strip().splitlines()[-1])
    assert summary["completion_tokens"] == 8 and summary["result_tokens"] == 8
    assert summary["streamed_tokens"] >= 7  # an end-of-generation token is not streamed
    assert out.stdout.strip()


def test_node_client_makes_a_tool_call(served: Served) -> None:
    node = shutil.which("node")
    if node is None or not (NODE_DIR / "node_modules" / "zeromq").exists():
        pytest.fail("node and examples/node/node_modules are required: ./scripts/test installs them (npm ci)")
    out = subprocess.run(
        [node, "client.mjs", "--tool", "What is the weather in Paris?", "--endpoint", served.zmq, "--max-tokens", "40"],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stderr.strip().splitlines()[-1])
    assert summary["finish_reason"] == "tool_calls", summary
    (call,) = summary["tool_calls"]
    assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"])["city"], str)
    assert summary["streamed_tool_calls"] == [{"index": 0, **call}]


def test_python_client_tool_call_over_zmq(served: Served) -> None:
    from kvroute.client import Client

    tool = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    with Client(served.zmq, timeout_s=60) as c:
        stream = c.stream(
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[tool],
            tool_choice={"name": "get_weather"},
            max_tokens=40,
            temperature=0,
        )
        deltas = list(stream)
    result = stream.result
    assert result is not None and result.finish_reason == "tool_calls"
    assert [c.name for c in result.tool_calls] == ["get_weather"]
    assert [c.arguments for d in deltas for c in d.tool_calls] == [result.tool_calls[0].arguments]
    assert result.text == "" and "".join(d.text for d in deltas) == ""


def kvroute(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "commands.cli", *args], capture_output=True, text=True, timeout=120)


def test_cli_complete_then_status_shows_the_slot(served: Served) -> None:
    out = kvroute("complete", "--connect", served.zmq, "--max-tokens", "5", "--usage", "A list of fruits: apple,")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "completion=5" in out.stderr
    status = kvroute("status", "--connect", served.zmq)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert lines[0].startswith("model ")
    rows = [line.split() for line in lines[4:] if line.strip() and not line.startswith("per slot:")]
    assert rows and all(len(r) >= 8 for r in rows)
    assert any(r[6].isdigit() and int(r[6]) > 0 for r in rows), status.stdout  # some slot holds tokens now
    assert lines[-1].startswith("per slot: cpu0 1024 tokens, ") and lines[-1].endswith(" MiB of KV")
    raw = json.loads(kvroute("status", "--connect", served.zmq, "--json").stdout)
    worker = raw["workers"][0]
    assert worker["slots"] and worker["ctx_per_slot"] == 1024 and worker["kv_bytes_per_slot"] > 0


def test_cli_cache_salt_keeps_a_tenants_prefix_its_own(served: Served) -> None:
    prompt = "Tenant notes: " + "the blue door opens at nine and the green one at ten. " * 8

    def cached(salt: str) -> int:
        out = kvroute("complete", "--connect", served.zmq, "--max-tokens", "2", "--usage", "--cache-salt", salt, prompt)
        assert out.returncode == 0, out.stderr
        return int(out.stderr.split("cached=")[1].split()[0])

    assert cached("team-a") == 0
    assert cached("team-a") > 50  # the same tenant: its prefix
    assert cached("team-b") == 0  # another tenant: nothing of it
    status = kvroute("status", "--connect", served.zmq, "--cache-salt", "team-c")
    assert "(another tenant)" in status.stdout  # the slot team-b's prompt took, seen by a third tenant


def test_cli_unreachable_router_is_one_line() -> None:
    out = kvroute("status", "--connect", "tcp://127.0.0.1:9", "--timeout", "1")
    assert out.returncode == 1
    assert out.stderr.strip() == "kvroute: error: cannot reach the router at tcp://127.0.0.1:9 (no reply in 1 s)"


@pytest.mark.parametrize(
    "args",
    [
        ["serve", "--slots", "lots"],
        ["serve", "--http", "nowhere"],
        ["serve", "--spec-max", "0"],
        ["worker", "--spec-ngram", "0"],
        ["serve", "--cache-type-v", "q8_0", "--flash-attn", "off"],
        ["worker", "--cache-type-k", "q5_1"],
        ["complete"],
        ["worker", "--threads", "-"],
    ],
)
def test_cli_bad_flags_are_one_clear_line(args: list[str]) -> None:
    out = kvroute(*args)
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert "error" in out.stderr


def test_python_client_sync_and_async(served: Served) -> None:
    import asyncio

    from kvroute.client import AsyncClient, Client, ContextOverflow

    with Client(served.zmq, timeout_s=120) as c:
        stream = c.stream(prompt="One, two, three,", max_tokens=5, temperature=0)
        text = "".join(d.text for d in stream)
        assert stream.result is not None and stream.result.text == text
        assert stream.result.usage.completion_tokens == 5
        with pytest.raises(ContextOverflow, match="1024"):
            c.submit(prompt="hi", max_tokens=5000)
        same = c.submit(prompt="One, two, three,", max_tokens=5, temperature=0)
        assert same.usage.cached_tokens > 0  # the prompt is in a slot now

    async def two_at_once() -> list[str]:
        async with AsyncClient(served.zmq, timeout_s=120) as ac:
            results = await asyncio.gather(*(ac.submit(prompt=p, max_tokens=4, temperature=0) for p in ("Red,", "Blue,")))
            return [r.text for r in results]

    texts = asyncio.run(two_at_once())
    assert len(texts) == 2 and all(texts)
