"""What one hostile HTTP request costs everyone else on a `kvroute serve`: while it is served beside a normal stream,
the longest wait of `/health` (answered from the serve process's one event loop, router and HTTP API together), the
longest gap between the stream's tokens and whether its worker was restarted, how long a normal one-token chat sent
meanwhile takes against the same chat beside the stream alone; then whether a normal request is still served, the
metric series `/metrics` shows, and the serve process's memory.

    python -m bench.hostile [--case NAME ...] [--repeats N] [--source DIR]

`--source` serves from another checkout (a commit before the fixes, for a baseline; this environment's packages):
`python -m commands.cli` runs in that directory, so its modules are the ones imported.

Each case is sent `repeats` times (a case with `times` sends that many requests at once each repeat). The figures
are wall-clock times on a shared machine: noisy, the spread over the repeats is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.procs import start, stop, wait_ready
from bench.systems import free_port

CHAT = "/v1/chat/completions"
HOSTILE_TIMEOUT_S = 600.0  # (40 inputs of 2,000 tokens take this machine minutes)


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def chat(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


def deep_json(depth: int) -> bytes:
    inner = "[" * depth + "]" * depth
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "metadata": ' + inner + "}").encode()


def tools(n: int) -> list[dict[str, Any]]:
    params = {"type": "object", "properties": {"x": {"type": "string"}, "y": {"type": "integer"}}}
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": params}} for i in range(n)]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Callable[[], bytes]
    times: int = 1  # requests sent at once
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)


def js(value: Any) -> Callable[[], bytes]:
    return lambda: json.dumps(value).encode()


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


CASES = [
    Case("schema-depth-20", CHAT, js(chat(response_format=schema_format(nested_schema(20))))),
    Case("messages-100k-empty", CHAT, js({"messages": [{"role": "user", "content": ""}] * 100_000, "max_tokens": 1})),
    Case("tools-256", CHAT, js(chat(tools=tools(256), tool_choice="required"))),
    Case("detokenize-1M", "/detokenize", js({"tokens": [5] * 1_000_000})),
    Case("unknown-fields-256", CHAT, js({**chat("x" * 2_000_000), **{f"unknown_{i}": i for i in range(256)}})),
    Case("json-depth-10k", CHAT, lambda: deep_json(10_000)),
    Case("n16-logprobs20", CHAT, js(chat(n=16, logprobs=True, top_logprobs=20, max_tokens=2000))),
    Case("lone-surrogate", CHAT, lambda: b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}'),
    Case("x-guidance-300", CHAT, js(chat(response_format=schema_format({"type": "object", "x-guidance": 1}))), times=300),
    # issue 61's table
    Case("embed-40x2000", "/v1/embeddings", js({"input": [[100 + (i * 7 + j) % 5000 for j in range(2000)] for i in range(40)]})),
    Case("unknown-keys-30k-embed", "/v1/embeddings", js({"input": "hello", **{f"k{i}": i for i in range(30_000)}})),
    Case("unknown-keys-12k-chat", CHAT, js({**chat(), **{f"k{i}": i for i in range(12_000)}})),
    Case("tokenize-flood-16", "/tokenize", js({"content": "<" * 60_000}), times=16),
    Case("responses-2000-tools", "/v1/responses",
         js({"input": "hi", "max_output_tokens": 4, "tools": [{"type": f"made_up_{i}"} for i in range(2000)]}), times=3),
    Case("foreign-host-text-plain", CHAT, js(chat()), headers=(("host", "evil.example"), ("content-type", "text/plain"))),
]  # fmt: skip


async def poll_health(client: httpx.AsyncClient, url: str, waits: list[float], stop_at: asyncio.Event) -> None:
    while not stop_at.is_set():
        t0 = time.monotonic()
        try:
            await client.get(f"{url}/health")
        except httpx.TransportError:  # (a kept-alive connection the server closed as the answer was sent)
            await client.get(f"{url}/health")
        waits.append(time.monotonic() - t0)
        await asyncio.sleep(0.01)


async def stream_gaps(client: httpx.AsyncClient, url: str, gaps: list[float], began: asyncio.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 3500, "ignore_eos": True, "stream": True, "temperature": 0}
    last = None
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if last is not None and began.is_set():
                gaps.append(now - last)
            last = now
            began.set()


async def send(
    client: httpx.AsyncClient, url: str, body: bytes, headers: tuple[tuple[str, str], ...] = Case.headers
) -> tuple[int | str, str]:
    """(status, body) of one POST; a request unanswered in HOSTILE_TIMEOUT_S is ("timeout", "")."""
    try:
        r = await client.post(url, content=body, headers=dict(headers), timeout=HOSTILE_TIMEOUT_S)
    except httpx.TimeoutException:
        return "timeout", ""
    return r.status_code, r.text


async def timed_chat(client: httpx.AsyncClient, url: str) -> float:
    """Seconds a one-token chat takes (NaN when it fails)."""
    t0 = time.monotonic()
    status, _ = await send(client, f"{url}{CHAT}", json.dumps(chat(max_tokens=1)).encode())
    return time.monotonic() - t0 if status == 200 else float("nan")


async def series(client: httpx.AsyncClient, url: str) -> tuple[int, float]:
    """(metric series `/metrics` shows, worker restarts so far)."""
    text = (await client.get(f"{url}/metrics")).text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    restarts = sum(float(line.split()[-1]) for line in samples if line.startswith("kvroute_worker_restarts_total"))
    return len(samples), restarts


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one(url: str, case: Case, pid: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        waits: list[float] = []
        gaps: list[float] = []
        series0, restarts0 = await series(client, url)
        began, done = asyncio.Event(), asyncio.Event()
        streaming = asyncio.ensure_future(stream_gaps(client, url, gaps, began))
        await asyncio.wait_for(began.wait(), 120)
        await asyncio.sleep(0.3)
        idle_chat = statistics.median([await timed_chat(client, url) for _ in range(3)])  # (beside the stream alone)
        polling = asyncio.ensure_future(poll_health(client, url, waits, done))
        await asyncio.sleep(0.3)
        rss0 = rss_mb(pid)
        body = case.body()
        t0 = time.monotonic()
        hostile = asyncio.gather(*(send(client, f"{url}{case.path}", body, case.headers) for _ in range(case.times)))
        await asyncio.sleep(0.5)
        during = await timed_chat(client, url) if not hostile.done() else float("nan")
        answers = await hostile
        took = time.monotonic() - t0
        await asyncio.sleep(0.3)
        done.set()
        await polling
        streaming.cancel()
        after = await send(client, f"{url}{CHAT}", json.dumps(chat()).encode())
        series1, restarts1 = await series(client, url)
        statuses: dict[int | str, int] = {}
        for a in answers:
            statuses[a[0]] = statuses.get(a[0], 0) + 1
        return {
            "statuses": statuses,
            "message": answers[0][1][:160],
            "took_s": took,
            "health_max_s": max(waits, default=float("nan")),
            "gap_max_s": max(gaps, default=float("nan")),
            "chat_during_vs_idle": (during, idle_chat),
            "restarts": restarts1 - restarts0,
            "series": (series0, series1),
            "normal_after": after[0],
            "rss_mb": (rss0, rss_mb(pid)),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", action="append", help="a case's name (default: all)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--log", default=None)
    ap.add_argument("--source", default=None, help="serve from this checkout instead (a baseline)")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.case or c.name in args.case]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(args.log or tempfile.mkdtemp(prefix="hostile-")) / "serve.log"
    zmq, workers = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "commands.cli", "serve", "--http", f"127.0.0.1:{port}", "--zmq", zmq,
           "--worker-endpoint", workers, "--workers", "1", "--slots", "4", "--ctx-per-slot", "4096",
           "--threads", "1"]  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # (the server is stopped on the way out)
    proc = start(cmd, log, cwd=args.source)
    try:
        wait_ready(url, proc, log, CHAT, chat())
        print(f"serve pid {proc.pid}, log {log}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
        for case in cases:
            runs = [asyncio.run(one(url, case, proc.pid)) for _ in range(args.repeats)]
            waits = [r["health_max_s"] for r in runs]
            gaps = [r["gap_max_s"] for r in runs]
            chats = ", ".join(f"{d:.2f}/{i:.2f}" for d, i in (r["chat_during_vs_idle"] for r in runs))
            print(
                f"{case.name:22} statuses {runs[-1]['statuses']} took {statistics.median(r['took_s'] for r in runs):6.2f} s  "
                f"/health max wait {statistics.median(waits):6.3f} s (spread {min(waits):.3f}-{max(waits):.3f})  "
                f"stream max gap {statistics.median(gaps):6.3f} s (spread {min(gaps):.3f}-{max(gaps):.3f})  "
                f"worker restarts {sum(r['restarts'] for r in runs):.0f}  "
                f"chat during/idle s [{chats}]  "
                f"metric series {runs[0]['series'][0]} -> {runs[-1]['series'][1]}  "
                f"normal after: {[r['normal_after'] for r in runs]}  "
                f"rss MB {runs[0]['rss_mb'][0]:.0f} -> {runs[-1]['rss_mb'][1]:.0f}"
            )
            print(f"{'':22} answer: {runs[-1]['message']!r}", flush=True)
    finally:
        stop(proc)


if __name__ == "__main__":
    main()
