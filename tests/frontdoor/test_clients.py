"""The Node.js example client and the kvroute CLI against the same real server."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
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
    pieces = [c for d in deltas for c in d.tool_calls]  # streamed as written: the head first, then the arguments
    assert (pieces[0].name, pieces[0].id) == ("get_weather", result.tool_calls[0].id) and len(pieces) > 2
    assert "".join(c.arguments for c in pieces) == result.tool_calls[0].arguments
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


def test_direct_replies_give_what_the_router_gives(served: Served) -> None:
    """The async client takes its output straight from the worker (PROTOCOL.md 4.4; the router only places the request:
    kvroute_direct_jobs_total counts it): the same deltas, tool calls and result as through the router."""
    from kvroute.client import AsyncClient
    from protocol import Delta, Result

    tool = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    asks: list[dict[str, object]] = [
        {"prompt": "One, two, three,", "max_tokens": 12, "temperature": 0, "logprobs": 2},
        {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [tool], "tool_choice": {"name": "get_weather"},
         "max_tokens": 40, "temperature": 0},
    ]  # fmt: skip

    async def run(reply_endpoint: str) -> tuple[list[tuple[str, list[Delta], Result]], float]:
        async with AsyncClient(served.zmq, timeout_s=120, reply_endpoint=reply_endpoint) as ac:
            out = []
            for ask in asks:
                deltas, result = [], None
                async for msg in ac.stream(**ask):
                    if isinstance(msg, Result):
                        result = msg
                    else:
                        deltas.append(msg)
                assert result is not None
                out.append((reply_endpoint, deltas, result))
            metrics = await ac.metrics()
        (direct,) = [float(v) for v in re.findall(r"^kvroute_direct_jobs_total (\S+)$", metrics, re.M)]
        return out, direct

    routed, before = asyncio.run(run("off"))
    direct, after = asyncio.run(run("auto"))
    assert after - before == len(asks)  # only the direct ones
    for (_, d_deltas, d_result), (_, r_deltas, r_result) in zip(direct, routed, strict=True):
        assert d_result.text == r_result.text and d_result.tokens == r_result.tokens
        assert d_result.finish_reason == r_result.finish_reason
        assert [(c.name, c.arguments) for c in d_result.tool_calls] == [(c.name, c.arguments) for c in r_result.tool_calls]
        assert [(d.text, d.tokens, len(d.logprobs)) for d in d_deltas] == [(d.text, d.tokens, len(d.logprobs)) for d in r_deltas]
        assert d_deltas[0].usage is not None and d_deltas[0].usage.prompt_tokens == r_result.usage.prompt_tokens
        assert d_result.usage.completion_tokens == r_result.usage.completion_tokens and d_result.worker == r_result.worker
    assert direct[1][2].finish_reason == "tool_calls"


def test_a_reply_endpoint_the_workers_cannot_reach_costs_a_delay_not_a_request(served: Served, monkeypatch) -> None:
    """The address a client gives for direct replies is one the worker cannot connect to (as when `auto` picks a
    loopback port and the workers are on other hosts): after kvroute/direct.py START_S without the worker's
    `job_start`, the request is cancelled and sent again with its replies through the router, and it completes; the
    client's later requests go through the router at once."""
    from kvroute import direct
    from kvroute.client import AsyncClient, build_submit

    monkeypatch.setattr(direct, "START_S", 2.0)

    async def run() -> tuple[list[str], bool, float]:
        async with AsyncClient(served.zmq, timeout_s=120) as ac:
            ac._direct_for(build_submit(prompt="x"))  # bound now: then its address is made one no worker can reach
            assert ac._direct is not None
            ac._direct.endpoint = "ipc:///nonexistent-kvroute-dir/reply"
            t0 = time.monotonic()
            texts = [(await ac.submit(prompt="One, two, three,", max_tokens=5, temperature=0)).text]
            waited = time.monotonic() - t0
            texts.append((await ac.submit(prompt="One, two, three,", max_tokens=5, temperature=0)).text)
            return texts, ac._direct.broken, waited

    texts, broken, waited = asyncio.run(run())
    assert texts[0] == texts[1] and texts[0] and broken and waited >= 2.0
