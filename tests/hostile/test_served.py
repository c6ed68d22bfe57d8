"""Hostile requests against a real `kvroute serve` (router, one real worker, HTTP API, all on one event loop in this
process, as `serve` runs them) while a normal stream is being read beside them: for each, the loop's longest stall,
that the stream kept getting tokens, and that the router's queue and requests, the HTTP API's client records and the
process's memory are back to their idle size after it (asked three times: the first of a kind may set up what it
keeps; a leak grows with each of the others, so the smaller of their two growths must be allocator noise).

The stall bound holds for the best of the tries: the largest bodies (4-7 MB) are decoded by single C calls
that hold the GIL 50-100 ms on this project's shared 2-core machine (msgspec's JSON parse of 100,000 messages: 75
ms), and one try in a few also has that thread preempted by the machine's other work (its run-queue wait cannot be
told apart from the loop's own); every try's figures are in the message."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hostile_helpers import STALL_S, LoopWatch, RouterThread, endpoints, wait_until
from router_helpers import free_port

from commands.serve import LocalWorkers, serve, serve_http_processes
from gateway.server import HttpConfig
from router.config import RouterConfig
from router.supervisor import SupervisorConfig

pytestmark = pytest.mark.model

KEY = "hostile-suite-key"
CHAT = "/v1/chat/completions"
# what one of two equal requests after the first may leave above the one before (allocator noise: which preparing
# thread's arena, and which of pymalloc's, a 1M-id request lands in, 5 or 23 MB at random); a leak grows every time
MEMORY_SLACK_MB = 24.0


def rss_mb() -> float:
    """This process's resident memory, after collecting garbage and handing free heap back to the system."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Serve:
    rt: RouterThread
    url: str
    watch: LoopWatch

    @property
    def router(self) -> Any:
        return self.rt.extra["router"]

    @property
    def gateway_client(self) -> Any:
        return self.rt.extra["client"]

    def held(self) -> int:
        """What the router and the HTTP API's client hold for requests in flight (requests, queue places, records)."""
        router, client = self.router, self.gateway_client

        def count() -> int:
            held = sum(len(c.requests) + len(c.queue) for c in router.cores)
            held += len(client._queues) + len(client._submits) + len(client._unanswered)
            return held + (len(client._direct.sent_at) if client._direct is not None else 0)

        return int(self.rt.call(count))


@pytest.fixture(scope="module")
def served() -> Iterator[Serve]:
    import kvroute.client

    clients: list[kvroute.client.AsyncClient] = []
    original = kvroute.client.AsyncClient

    class Kept(original):  # type: ignore[valid-type, misc]  # (the HTTP API's own client, kept to be looked into)
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            clients.append(self)

    cep, wep = endpoints()
    port = free_port()
    cfg = RouterConfig(client_endpoint=cep, worker_endpoint=wep, busy_wait_ms=0, prepare_timeout_s=5.0)
    local = LocalWorkers(cpu_workers=1, slots=4, ctx_per_slot=2048, threads=1)
    http = HttpConfig(http=f"127.0.0.1:{port}", router=cep, api_key=KEY, model_name="m", processes=1)

    async def main(rt: RouterThread) -> None:
        kvroute.client.AsyncClient = Kept  # type: ignore[misc]  # (serve_http imports it when it starts)
        try:
            http_task = asyncio.ensure_future(serve_http_processes(http))
            await serve(cfg, local, SupervisorConfig(), signals=False, started=lambda r, s: rt.extra.update(router=r))
            http_task.cancel()
        finally:
            kvroute.client.AsyncClient = original  # type: ignore[misc]

    rt = RouterThread(main)
    rt.thread.start()
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {KEY}"}
    wait_until(lambda: _ok(f"{url}/health", headers), 180, "serve's worker ready")
    rt.extra["client"] = clients[0]
    assert rt.loop is not None
    s = Serve(rt, url, LoopWatch(rt.loop))
    yield s
    s.watch.stop()
    rt.loop.call_soon_threadsafe(s.router.stop)
    rt.thread.join(60)


def _ok(url: str, headers: dict[str, str]) -> bool:
    try:
        return httpx.get(url, headers=headers, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


class Stream:
    """A normal streamed completion read in a thread; `times` are its tokens' arrival times."""

    def __init__(self, url: str) -> None:
        self.times: list[float] = []
        self.done = threading.Event()
        body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True, "temperature": 0}
        self.thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self.thread.start()
        wait_until(lambda: len(self.times) > 3, 60, "the normal stream began")

    def _read(self, url: str, body: dict[str, Any]) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=300) as r:
            for line in r.iter_lines():
                if self.done.is_set():
                    return
                if line.startswith("data: {"):
                    self.times.append(time.monotonic())

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(t0 <= t < t1 for t in self.times)


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def js(value: Any) -> bytes:
    return json.dumps(value).encode()


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


TOOL = {"type": "object", "properties": {"x": {"type": "string"}, "y": {"type": "integer"}}}
HOSTILE: dict[str, tuple[str, bytes, set[int]]] = {  # name -> (path, body, the statuses it may get)
    "schema-depth-20": (CHAT, js(chat(response_format=schema_format(nested_schema(20)))), {200}),
    "x-guidance": (CHAT, js(chat(response_format=schema_format({"type": "object", "x-guidance": 1}))), {400}),
    "messages-100k-empty": (CHAT, js({"messages": [{"role": "user", "content": ""}] * 100_000, "max_tokens": 1}), {400}),
    "angles-1MB": (CHAT, js(chat(messages=[{"role": "user", "content": "<" * 1_000_000}])), {400}),
    "tools-256": (
        CHAT,
        js(
            chat(
                tools=[{"type": "function", "function": {"name": f"t{i}", "parameters": TOOL}} for i in range(256)],
                tool_choice="required",
            )
        ),  # (a call required: the default model is shown them, as bench/hostile.py's)
        {400},  # (their descriptions do not fit a 2,048-token slot: context_overflow, after one compile of them all)
    ),
    "detokenize-1M": ("/detokenize", js({"tokens": [107] * 1_000_000}), {200}),
    "unknown-fields-256": (CHAT, js({**chat(), **{f"unknown_{i}": "y" * 1000 for i in range(256)}}), {200}),
    "json-depth-10k": (CHAT, b'{"messages": [], "metadata": ' + b"[" * 10_000 + b"]" * 10_000 + b"}", {400}),
    "n16-logprobs20": (CHAT, js(chat(n=16, logprobs=True, top_logprobs=20, max_tokens=2000)), {400}),
    "lone-surrogate": (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}', {400}),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_request_beside_a_stream(served: Serve, name: str) -> None:
    path, body, statuses = HOSTILE[name]
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    stream = Stream(served.url)
    try:
        memory, stalls = [], []
        idle = served.held()  # (the stream's records)
        for _ in range(3):
            served.watch.reset()
            t0 = time.monotonic()
            r = httpx.post(f"{served.url}{path}", content=body, headers=headers, timeout=120)
            t1 = time.monotonic()
            assert r.status_code in statuses, (r.status_code, r.text[:300])
            assert r.status_code != 500
            stalls.append((served.watch.longest, str(served.watch)))
            if t1 - t0 > 0.5:  # (long enough for a token: the stream beside it went on)
                assert stream.tokens_between(t0, t1) > 0, f"{name}: the stream got no token in {t1 - t0:.1f} s"
            wait_until(lambda: served.held() <= idle, 10, f"{name}: the router and the HTTP API back to idle")
            memory.append(rss_mb())
        assert min(stalls)[0] < STALL_S, f"{name}: {[text for _, text in stalls]}"
        grew = min(memory[1] - memory[0], memory[2] - memory[1])
        assert grew < MEMORY_SLACK_MB, f"{name}: memory grew {grew:.1f} MB with each request ({memory} MB)"
        print(f"{name}: {[text for _, text in stalls]}, memory {' -> '.join(f'{m:.0f}' for m in memory)} MB")
    finally:
        stream.done.set()


def test_a_client_gone_before_its_first_token_leaves_nothing(served: Serve) -> None:
    """The request is cancelled in the router, not computed for nobody."""
    import socket

    host, port = served.url.removeprefix("http://").split(":")
    stream = Stream(served.url)  # (a slot busy: what comes next waits for its prefill)
    idle = served.held()
    try:
        body = js(chat(messages=[{"role": "user", "content": "word " * 1500}], max_tokens=200, stream=True))
        head = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
        conn = socket.create_connection((host, int(port)))
        conn.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.3)
        conn.close()
        wait_until(lambda: served.held() <= idle, 15, "the request cancelled everywhere")
    finally:
        stream.done.set()


def test_without_the_key_no_process_joins_serve_as_a_worker(served: Serve) -> None:
    import zmq

    from protocol import Hello, encode

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"intruder")
    sock.connect(served.router.cfg.worker_endpoint)
    hello = Hello(worker_id="intruder", incarnation=1, slots=4, ctx_per_slot=2048, model_fingerprint="x", device="cpu")
    with contextlib.suppress(zmq.Again):
        sock.send(encode(hello), zmq.NOBLOCK)
    assert not sock.poll(1500)
    assert "intruder" not in served.router.workers
    sock.close(0)


def series_count(url: str) -> int:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


# Issue 61's table: each request that hurt everyone, sent beside a normal stream (smaller where its size only made it
# take longer: the embed's inputs are as long, fewer; the flood's texts are what --prepare-timeout-s 5 lets through)
EMBED_2X1200 = {"input": [[100 + (i * 7 + j) % 5000 for j in range(1200)] for i in range(2)]}
MADE_UP_TOOLS = {"input": "hi", "max_output_tokens": 4, "tools": [{"type": f"t{i}"} for i in range(2000)]}
SECOND_ROUND: dict[str, tuple[str, bytes, int, dict[str, str]]] = {  # name -> (path, body, times at once, headers)
    "embed-2x1200": ("/v1/embeddings", js(EMBED_2X1200), 1, {}),
    "unknown-keys-30k": ("/v1/embeddings", js({"input": "hello", **{f"k{i}": i for i in range(30_000)}}), 1, {}),
    "tokenize-flood": ("/tokenize", js({"content": "<" * 10_000}), 16, {}),
    "made-up-tools": ("/v1/responses", js(MADE_UP_TOOLS), 3, {}),
    "foreign-host": (CHAT, js(chat()), 1, {"host": "evil.example", "content-type": "text/plain"}),
}  # fmt: skip
OUTSIDE = Path(__file__).with_name("outside.py")
GAP_MAX_S = 2.0  # longest wait for a token of the stream beside a hostile request
SERIES_BOUND = 600  # metric series of this server (one worker): the HTTP API's, the router's, each field label once


@pytest.mark.parametrize("name", list(SECOND_ROUND))
def test_a_second_round_request_harms_no_one(served: Serve, name: str, tmp_path: Path) -> None:
    """Issue 61: beside a normal stream, the stream's longest gap stays under GAP_MAX_S and its worker is not restarted,
    `/health` answers within 100 ms (99 polls of 100; 500 ms every one), a one-token chat during the tokenize flood
    (the same key's: the flood's texts are not small work) is not queued behind it (under twice its time without it
    plus 0.5 s), the metric series stay under a bound, and a foreign Host is refused. The hostile client is a process
    of its own (tests/hostile/outside.py)."""
    path, body, times, headers = SECOND_ROUND[name]
    (tmp_path / "body").write_bytes(body)
    restarts = dict(served.router.restarts)
    stream = Stream(served.url)
    try:
        served.watch.reset()
        t0 = time.monotonic()
        chats = 3 if name == "tokenize-flood" else 0
        args = [served.url, path, str(tmp_path / "body"), str(times), json.dumps(headers), KEY, str(chats)]
        out = subprocess.run([sys.executable, str(OUTSIDE), *args], capture_output=True, text=True, timeout=300, check=True)
        t1 = time.monotonic()
        gaps = [b - a for a, b in itertools.pairwise(t for t in stream.times if t0 <= t <= t1)]
    finally:
        stream.done.set()
    seen = json.loads(out.stdout)
    statuses, longest_health, p99_health = seen["statuses"], seen["health_max_s"], seen["health_p99_s"]
    print(f"{name}: {served.watch}, /health at most {longest_health * 1000:.0f} ms of {seen['health_polls']}")
    # (the flood's later tokenizes wait their turn behind the same key's, and may run out of time: 429, come back)
    expected = {"foreign-host": {403}, "tokenize-flood": {200, 429}}.get(name, {200})
    assert set(statuses) <= expected and (name == "foreign-host" or 200 in statuses), statuses
    # (2 s: on a loaded 2-core CI machine a step was once descheduled 1.3 s beside this case, which alone gives gaps of
    # 0.05 s; a request that stalls the others holds them for seconds)
    assert max(gaps, default=0.0) < GAP_MAX_S, f"{name}: the stream waited {max(gaps):.2f} s for a token"
    assert served.router.restarts == restarts, f"{name}: the worker was restarted"
    # (99 polls of 100 within 100 ms, every one within 500 ms: on 2 shared cores the OS alone can hold one poll longer;
    # a server that made /health wait for the flood would fail both)
    assert p99_health < 0.1, f"{name}: /health took {p99_health * 1000:.0f} ms in 1 poll of 100"
    assert longest_health < 0.5, f"{name}: /health took {longest_health * 1000:.0f} ms"
    if chats:
        during, before = seen["chat_during_s"], seen["chat_before_s"]
        assert seen["outlasted_chats"], "the flood was over before the chats"
        # queued behind the flood it would wait seconds (its tokenizes expire after 3-5 s); the 0.5 s allows for the
        # flood's tokenizing taking CPU from the worker on 2 cores, which slowed a step from 60 to 190 ms in one CI run
        assert during < 2 * before + 0.5, f"{name}: a one-token chat took {during:.2f} s, {before:.2f} s without it"
    assert series_count(served.url) < SERIES_BOUND


def test_an_embed_whose_client_goes_away_stops_on_its_worker(served: Serve) -> None:
    """Issue 61 item 1: an HTTP client gone mid-embed left its worker computing every input. Now the gateway cancels
    it, the router tells the worker, and the worker ends the job before its next chunk (a job of 7,200 tokens would
    take it 40-60 s)."""
    import socket

    host, port = served.url.removeprefix("http://").split(":")
    body = js({"input": EMBED_2X1200["input"] * 3})  # (6 x 1,200 tokens: 40-60 s of work here)
    head = f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    conn = socket.create_connection((host, int(port)))
    conn.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    router = served.router
    wait_until(lambda: any(c.embeds.running for c in router.cores), 30, "the embed job on its worker")
    t0 = time.monotonic()
    conn.close()
    wait_until(lambda: not any(c.embeds.running for c in router.cores), 15, "the worker ended the job")
    assert time.monotonic() - t0 < 15  # (the chunk under way ends first: a whole ubatch, seconds, with no stream beside)
