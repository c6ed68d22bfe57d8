"""Hostile HTTP clients against the gateway (a stand-in router, no model): bodies that nest, strings that are not text,
fields by the hundred, clients that leave or dawdle, and too many of them; over ASGI, or a real loopback socket where
the attack is the connection itself."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from hostile_helpers import STALL_S, LoopWatch, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))
from fake_router import FakeRouter, client_for

from gateway.app import Gateway, build_app
from gateway.limits import MAX_HEADER_BYTES
from gateway.openai_bodies import ChatRequest
from gateway.server import HttpConfig, uvicorn_config
from kvroute.client import encode_checked
from protocol import MAX_FRAME_BYTES, Delta, Embed, Embeddings, Result, Submit

CHAT = "/v1/chat/completions"


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


class EncodingRouter(FakeRouter):
    """Encodes each submit as the real client does before it sends it (and refuses what it would refuse)."""

    async def stream_submit(self, sub: Submit) -> AsyncIterator[Delta | Result]:
        encode_checked(sub, MAX_FRAME_BYTES)
        async for m in super().stream_submit(sub):
            yield m


class SlowRouter(FakeRouter):
    """Answers nothing until its request is cancelled (a long queue, or a long prompt being computed)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.ended = threading.Event()

    async def stream_submit(self, sub: Submit) -> AsyncIterator[Delta | Result]:
        self.started.set()
        try:
            await asyncio.sleep(3600)
            yield Delta(id=sub.id or "", text="late", tokens=b"")
        finally:
            self.ended.set()  # (the generator closed: the real client sends its cancel here)


@pytest.mark.anyio
async def test_json_nested_10k_deep_is_a_400_not_a_500() -> None:
    """Issue item 6: the parser's RecursionError was a 500."""
    body = b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    async with client_for(FakeRouter()) as c:
        r = await c.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "10001 levels" in r.json()["error"]["message"]


@pytest.mark.anyio
async def test_a_lone_surrogate_is_a_400_naming_it() -> None:
    """Issue item 2: `\\ud800` in a JSON string is not a character; msgpack cannot carry it (a 500 before)."""
    body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}'
    async with client_for(EncodingRouter()) as c:
        r = await c.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]


@pytest.mark.anyio
async def test_an_integer_msgpack_cannot_carry_is_a_400_naming_it() -> None:
    """Found by schemathesis: JSON integers have no bound, msgpack's do (a 500, OverflowError, on count_tokens)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "chat_template_kwargs": {"k": -(2**70)}}
    async with client_for(EncodingRouter()) as c:
        r = await c.post(CHAT, json=body)
    assert r.status_code == 400, r.text
    assert "outside -2^63 .. 2^64 - 1" in r.json()["error"]["message"]


@pytest.mark.anyio
async def test_unknown_fields_are_found_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue item 4: each unknown field cost a conversion of the whole body (256 of them: 257 conversions of 2 MB)."""
    conversions = 0
    convert = msgspec.convert

    def counted(value: Any, kind: Any, **kw: Any) -> Any:
        nonlocal conversions
        conversions += kind is ChatRequest
        return convert(value, kind, **kw)

    monkeypatch.setattr(msgspec, "convert", counted)
    fake = FakeRouter()
    body = {**chat(), **{f"unknown_{i}": i for i in range(256)}}
    body["messages"] = [{"role": "user", "content": "x" * 100_000, "extra": 1}]
    async with client_for(fake) as c:
        r = await c.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    assert conversions <= 2, f"{conversions} conversions of the body"
    assert fake.submits[-1].messages and fake.submits[-1].messages[0].content


class LiveGateway:
    """The gateway on a real loopback socket, served by uvicorn as `kvroute http` serves it, in a thread."""

    def __init__(self, router: FakeRouter, **cfg: Any) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.cfg = HttpConfig(http=f"127.0.0.1:{self.port}", **cfg)
        gateway = Gateway(router, "m", body_timeout_s=self.cfg.body_timeout_s)  # type: ignore[arg-type, unused-ignore]
        import uvicorn

        self.server = uvicorn.Server(uvicorn_config(build_app(gateway), self.cfg, "127.0.0.1", self.port))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.server.serve(),), daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "uvicorn started")
        gc.freeze()  # (as serve_http does once it listens: start-up's objects, here the test run's, stay out of full GCs)
        self.url = f"http://127.0.0.1:{self.port}"

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        gc.unfreeze()


@pytest.fixture
def slow() -> Iterator[tuple[LiveGateway, SlowRouter]]:
    router = SlowRouter()
    live = LiveGateway(router, header_timeout_s=0.5, body_timeout_s=0.5, max_connections=8)
    yield live, router
    live.close()


def request_bytes(body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    head = f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_before_its_first_token_cancels_its_request(slow: Any, stream: bool) -> None:
    """Issue item 5: a client gone before the first token still had its prompt computed (streamed or not)."""
    live, router = slow
    conn = live.connect()
    conn.sendall(request_bytes(chat(stream=stream)))
    assert router.started.wait(5)
    conn.close()
    assert router.ended.wait(5), "the request was not cancelled when its client left"


def test_headers_that_dawdle_are_cut(slow: Any) -> None:
    """Issue item 5: no header timeout: a client sending a byte now and then held its socket for good."""
    live, _ = slow
    conn = live.connect()
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # ... and the rest never comes
    t0 = time.monotonic()
    conn.settimeout(5)
    assert conn.recv(1024) == b"", "the server closed the connection"
    assert time.monotonic() - t0 < 3
    conn.close()


def test_headers_past_the_cap_get_431_and_the_connection_is_closed(slow: Any) -> None:
    """httptools parses headers without a bound of its own: a client sending header lines forever held memory."""
    live, _ = slow
    conn = live.connect()
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    line = b"X-Filler: " + b"a" * 1000 + b"\r\n"
    with contextlib.suppress(OSError):  # (the server may close while lines are still being sent)
        for _ in range(MAX_HEADER_BYTES // len(line) + 8):
            conn.sendall(line)
    conn.settimeout(5)
    answer = b""
    with contextlib.suppress(OSError):
        while chunk := conn.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
    conn.close()
    assert httpx.get(f"{live.url}/health", timeout=5).status_code == 200  # (and everyone else is served)


def test_a_body_that_dawdles_gets_408(slow: Any) -> None:
    live, _ = slow
    conn = live.connect()
    full = request_bytes(chat())
    conn.sendall(full[:-10])  # the headers, and a body 10 bytes short
    conn.settimeout(5)
    answer = b""
    while b"}" not in answer and (chunk := conn.recv(4096)):
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"body-timeout-s" in answer
    conn.close()


def test_connections_past_the_cap_get_503(slow: Any) -> None:
    """Issue item 5: no connection cap: slow clients held sockets without bound."""
    live, _ = slow
    held = [live.connect() for _ in range(8)]
    for c in held:
        c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # (headers still coming: each holds its connection)
    time.sleep(0.2)
    r = httpx.get(f"{live.url}/openapi.json", timeout=5)
    assert r.status_code == 503, r.status_code
    for c in held:
        c.close()
    wait_until(lambda: httpx.get(f"{live.url}/openapi.json", timeout=5).status_code == 200, 5, "served again")


def posts_leave_the_loop_free(live: LiveGateway, path: str, data: bytes, watch: LoopWatch, tries: int) -> None:
    """POST `data` `tries` times: each is served (200) and the gateway's loop never stalls past STALL_S meanwhile."""
    for _ in range(tries):
        watch.reset()
        r = httpx.post(f"{live.url}{path}", content=data, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text
        assert watch.longest < STALL_S, str(watch)
    watch.stop()


def test_a_large_body_of_unknown_fields_does_not_stall_the_http_loop() -> None:
    """Issue item 4, measured: 4 MB bodies with 256 unknown fields, parsed and decoded while the loop keeps serving
    (after one small body of the same shape: what a first request sets up once is not what this measures)."""
    live = LiveGateway(FakeRouter())
    try:
        watch = LoopWatch(live.loop)

        def body(n: int) -> bytes:
            fields = {**chat(), **{f"unknown_{i}": "y" * 100 for i in range(256)}}
            fields["messages"] = [{"role": "user", "content": "x" * 100, "extra": i} for i in range(n)]
            return json.dumps(fields).encode()  # (before the watch: this process's own JSON work holds the GIL too)

        headers = {"content-type": "application/json"}
        assert httpx.post(f"{live.url}{CHAT}", content=body(10), headers=headers, timeout=60).status_code == 200
        posts_leave_the_loop_free(live, CHAT, body(20_000), watch, tries=3)
    finally:
        live.close()


class EmbeddingRouter(FakeRouter):
    async def embed(self, msg: Embed) -> Embeddings:
        return Embeddings(id=msg.id, vectors=[b"\0" * 16], dims=4, prompt_tokens=1)


@pytest.mark.parametrize("path", ["/v1/embeddings", CHAT])
def test_30000_unknown_fields_do_not_stall_the_http_loop(path: str) -> None:
    """Issue 61 item 2, measured: 370 kB of 30,000 unknown keys to /v1/embeddings froze the loop (and /health with it)
    for 9.9 s; 12,000 of them to chat, for 1.6 s. Decoded in linear time on a thread now, on every route."""
    live = LiveGateway(EmbeddingRouter())
    try:
        watch = LoopWatch(live.loop)
        first = {"input": "hi"} if path != CHAT else chat()
        assert httpx.post(f"{live.url}{path}", json=first, timeout=60).status_code == 200  # (what a first request sets up)
        data = json.dumps({**first, **{f"k{i:05d}": 0 for i in range(30_000)}}).encode()
        posts_leave_the_loop_free(live, path, data, watch, tries=2)
    finally:
        live.close()


def test_a_web_page_cannot_reach_the_server_by_a_name_of_its_own() -> None:
    """Issue 61 item 8: DNS rebinding (a page's own name, pointed at 127.0.0.1) and a form POST were served; a
    client without Host (HTTP/1.0) still is."""
    live = LiveGateway(FakeRouter())
    try:
        body = json.dumps(chat()).encode()
        rebound = httpx.post(
            f"{live.url}{CHAT}", content=body, headers={"Host": "evil.example", "content-type": "application/json"}
        )
        assert rebound.status_code == 403 and "evil.example" in rebound.json()["error"]["message"]
        assert httpx.get(f"{live.url}/slots", headers={"Host": "evil.example"}).status_code == 403
        form = httpx.post(f"{live.url}{CHAT}", content=body, headers={"content-type": "text/plain"})
        assert form.status_code == 415
        assert httpx.post(f"{live.url}{CHAT}", json=chat()).status_code == 200
        conn = live.connect()
        conn.sendall(
            f"POST {CHAT} HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
        )
        conn.settimeout(5)
        assert conn.recv(12) == b"HTTP/1.1 200"
        conn.close()
    finally:
        live.close()


@pytest.mark.anyio
async def test_each_api_key_is_an_owner_of_its_share_of_the_queue() -> None:
    fake = FakeRouter()
    async with client_for(fake, "key-one,key-two") as c:
        for key in ("key-one", "key-two", "key-one"):
            r = await c.post(CHAT, json=chat(), headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
    one, two, one_again = (s.owner for s in fake.submits)
    assert one and two and one != two and one == one_again and "key-one" not in one
    async with client_for(fake) as c:  # without keys: one user, the whole queue
        await c.post(CHAT, json=chat())
    assert fake.submits[-1].owner is None


def test_kvroute_http_with_a_key_in_front_of_an_open_router_socket_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue item 3: `kvroute router` with `kvroute http --api-key` left the client socket open, silently."""
    from structlog.testing import capture_logs

    from gateway.server import warn_open_router

    monkeypatch.delenv("KVROUTE_API_KEY", raising=False)
    with capture_logs() as logged:
        warn_open_router(HttpConfig(router="tcp://127.0.0.1:5555", api_key="k"))
        warn_open_router(HttpConfig(router="ipc:///run/kvroute/clients.sock", api_key="k"))
        warn_open_router(HttpConfig(router="tcp://127.0.0.1:5555"))
    assert [e["event"] for e in logged] == ["zmq_clients_open"]
