"""What a web page the user has open may make the gateway do (gateway/browsers.py; issue 61, item 8): a Host it does not
answer to is a 403 (DNS rebinding), a POST that is not JSON a 415 (a form, text/plain, or no type: what a page sends
without a CORS preflight), and no response carries CORS headers unless origins are configured."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
from fake_router import FakeRouter, client_for

from gateway.app import Gateway, build_app
from gateway.browsers import AllowedHosts, host_name, is_json

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_host_names_are_read_without_port_case_or_final_dot() -> None:
    assert host_name("Example.COM:8000") == "example.com"
    assert host_name("[::1]:8000") == "::1" and host_name("[::1]") == "::1"
    assert host_name("localhost.") == "localhost" and host_name("127.0.0.1:80") == "127.0.0.1"


@pytest.mark.parametrize(
    "host",
    ["localhost", "localhost:8000", "LOCALHOST.", "app.localhost:8000", "127.0.0.1:8000", "[::1]:8000", "10.1.2.3",
     "[fe80::1]", socket.gethostname(), f"{socket.gethostname()}:8000", socket.getfqdn()],
)  # fmt: skip
def test_ip_literals_localhost_and_this_machine_s_names_are_served(host: str) -> None:
    assert AllowedHosts().allows(host)


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io", "0x7f.1"])
def test_other_names_are_not(host: str) -> None:
    assert not AllowedHosts().allows(host)


def test_allowed_hosts_add_names_domains_or_any() -> None:
    allowed = AllowedHosts(["kvroute.internal:8000", ".example.com"], bind_host="box.lan")
    assert allowed.allows("kvroute.internal") and allowed.allows("box.lan:8000")  # (and the name --http binds)
    assert allowed.allows("example.com") and allowed.allows("api.example.com")
    assert not allowed.allows("notexample.com") and not allowed.allows("evil.example")
    assert AllowedHosts(["*"]).allows("anything.example")
    assert AllowedHosts(bind_host="0.0.0.0").names == AllowedHosts().names  # (an address adds no name)
    assert AllowedHosts().allows(None) and AllowedHosts().allows("")  # no Host (HTTP/1.0): nothing was rebound


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/health", "/metrics", "/slots", CHAT, "/v1/messages"])
async def test_a_foreign_host_gets_403_naming_the_host_and_the_flag(path: str) -> None:
    fake = FakeRouter()
    async with client_for(fake) as c:
        headers = {"Host": "evil.example:8000"}
        get = path in ("/health", "/metrics", "/slots")
        r = await (c.get(path, headers=headers) if get else c.post(path, json=BODY, headers=headers))
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert "'evil.example'" in error["message"] and "--allowed-hosts" in error["message"]
    if path == "/v1/messages":  # (in each API's error shape)
        assert (r.json()["type"], error["type"]) == ("error", "permission_error")
    else:
        assert error["code"] == "host_not_allowed"
    assert not fake.submits and not fake.status_salts  # (refused before anything was asked of the router)


@pytest.mark.anyio
async def test_names_the_server_answers_to_are_served() -> None:
    async with client_for(FakeRouter(), allowed_hosts=AllowedHosts(["kvroute.internal"])) as c:
        for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", socket.gethostname(), "kvroute.internal"):
            r = await c.post(CHAT, json=BODY, headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
        assert (await c.post(CHAT, json=BODY, headers={"Host": "other.internal"})).status_code == 403


async def asgi_call(app: Any, method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> int:
    """One request straight to the ASGI app, with exactly these headers (httpx always adds a Host)."""
    sent: list[dict[str, Any]] = []
    events = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return events.pop(0) if events else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "http_version": "1.0", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "headers": headers, "scheme": "http", "server": ("127.0.0.1", 8000),
             "client": ("127.0.0.1", 1)}  # fmt: skip
    await app(scope, receive, send)
    return int(next(m for m in sent if m["type"] == "http.response.start")["status"])


@pytest.mark.anyio
async def test_a_request_without_host_is_served() -> None:
    app = build_app(Gateway(FakeRouter(), "m"))  # type: ignore[arg-type]
    assert await asgi_call(app, "POST", CHAT, [(b"content-type", b"application/json")], json.dumps(BODY).encode()) == 200


@pytest.mark.parametrize(
    ("content_type", "json_"),
    [("application/json", True), ("application/json; charset=utf-8", True), ("Application/JSON;charset=UTF-8", True),
     ("application/vnd.api+json", True), ("text/plain", False), ("text/plain;charset=UTF-8", False),
     ("application/x-www-form-urlencoded", False), ("multipart/form-data; boundary=x", False), ("text/json", False),
     ("application/jsonp", False), (None, False), ("", False)],
)  # fmt: skip
def test_json_content_types(content_type: str | None, json_: bool) -> None:
    assert is_json(content_type) is json_


@pytest.mark.anyio
@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
@pytest.mark.parametrize("path", [CHAT, "/v1/messages", "/v1/embeddings", "/tokenize", "/apply-template"])
async def test_a_post_that_is_not_json_gets_415_naming_its_type(path: str, content_type: str | None) -> None:
    fake = FakeRouter()
    headers = {"content-type": content_type} if content_type else {}
    async with client_for(fake) as c:
        r = await c.post(path, content=json.dumps(BODY).encode(), headers=headers)
    assert r.status_code == 415, r.text
    message = r.json()["error"]["message"]
    assert (repr(content_type) if content_type else "no Content-Type") in message
    assert "-H 'Content-Type: application/json'" in message  # (what curl -d needs)
    assert not fake.submits


@pytest.mark.anyio
@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8"])
async def test_json_posts_are_served(content_type: str) -> None:
    fake = FakeRouter()
    async with client_for(fake) as c:
        r = await c.post(CHAT, content=json.dumps(BODY).encode(), headers={"content-type": content_type})
    assert r.status_code == 200, r.text
    assert len(fake.submits) == 1


PREFLIGHT = {
    "Origin": "https://evil.example",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "content-type",
}


@pytest.mark.anyio
async def test_no_response_carries_cors_headers() -> None:
    origin = {"Origin": "https://evil.example"}
    async with client_for(FakeRouter()) as c:
        replies = [
            await c.options(CHAT, headers=PREFLIGHT),
            await c.options("/health", headers=PREFLIGHT),
            await c.get("/health", headers=origin),
            await c.get("/v1/models", headers=origin),
            await c.post(CHAT, json=BODY, headers=origin),
            await c.post(CHAT, content=b"{}", headers={**origin, "content-type": "text/plain"}),
        ]
    assert [r.status_code for r in replies] == [405, 405, 200, 200, 200, 415]
    for r in replies:
        assert not [h for h in r.headers if h.lower().startswith("access-control-")], (r.request.url, r.headers)


@pytest.mark.anyio
async def test_cors_origins_allow_those_origins_only() -> None:
    async with client_for(FakeRouter(), "k", cors_origins=("http://localhost:3000",)) as c:
        asks = {"Origin": "http://localhost:3000", "Access-Control-Request-Headers": "authorization, content-type"}
        ok = await c.options(CHAT, headers={**PREFLIGHT, **asks})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        r = await c.post(CHAT, json=BODY, headers={"Origin": "http://localhost:3000", "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = await c.options(CHAT, headers=PREFLIGHT)
        assert "access-control-allow-origin" not in other.headers
