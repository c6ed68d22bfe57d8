"""Images by http(s) URL (--image-fetch, gateway/image_fetch.py): off by default (a 400 naming the flag); the address
check, on many addresses; and the fetch itself against an HTTP server this test starts on 127.0.0.1: the image's bytes
in the request's part, each bound a 400 naming the part and why (no model)."""

from __future__ import annotations

import argparse
import gzip
import ipaddress
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from fake_router import ScriptedRouter, client_for, result
from test_images import RED, image_url, input_image, png

from common.config import add_args, from_args
from gateway import anthropic, image_fetch, responses
from gateway.errors import RequestError
from gateway.images import ImageLimits, Images
from gateway.openai_chat import chat_submit
from gateway.server import HttpConfig
from protocol import ImagePart

# ---- the address check ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),  # (the clouds' metadata service)
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("240.0.0.1", "private"),  # (reserved: Python counts it private too)
        ("255.255.255.255", "private"),
        ("100.64.0.1", "non-public"),  # (carrier-grade NAT's shared space)
        ("192.0.2.1", "private"),  # (documentation)
        ("::1", "loopback"),
        ("::", "unspecified"),
        ("fe80::1", "link-local"),
        ("fec0::1", "site-local"),
        ("fc00::1", "private"),
        ("fd12:3456::1", "private"),
        ("ff02::1", "multicast"),
        ("2001:db8::1", "private"),
        ("::127.0.0.1", "reserved"),  # (IPv4-compatible, long deprecated)
        ("::ffff:127.0.0.1", "loopback (IPv4 inside IPv6)"),
        ("::ffff:10.0.0.1", "private (IPv4 inside IPv6)"),
        ("64:ff9b::a9fe:a9fe", "link-local (IPv4 inside IPv6)"),  # (NAT64 to 169.254.169.254)
        ("2002:a00:1::", "private (IPv4 inside IPv6)"),  # (6to4 of 10.0.0.1)
    ],
)
def test_an_address_that_is_not_public_is_refused(address: str, why: str) -> None:
    assert image_fetch.refusal(ipaddress.ip_address(address)) == why


@pytest.mark.parametrize(
    "address",
    ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111", "2a00:1450:4001::1", "::ffff:8.8.8.8",
     "64:ff9b::808:808", "2002:808:808::1"],
)  # fmt: skip
def test_a_public_address_is_fetched(address: str) -> None:
    assert image_fetch.refusal(ipaddress.ip_address(address)) is None


# ---- off by default ---------------------------------------------------------------------------------------------


def test_fetching_is_off_by_default_and_the_refusal_names_the_flag() -> None:
    assert HttpConfig().image_limits().fetch is False
    with pytest.raises(RequestError) as info:
        chat_submit({"messages": [{"role": "user", "content": [image_url("https://example.com/cat.png")]}]}, "r")
    assert info.value.param == "messages[0].content[0].image_url.url" and "--image-fetch" in info.value.message
    with pytest.raises(RequestError) as info:
        responses.responses_submit({"input": [{"role": "user", "content": [input_image("http://example.com/a.png")]}]}, "r")
    assert info.value.param == "input[0].content[0].image_url" and "--image-fetch" in info.value.message
    block = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    with pytest.raises(RequestError) as info:
        anthropic.messages_request({"max_tokens": 8, "messages": [{"role": "user", "content": [block]}]}, "r")
    assert info.value.param == "messages[0].content[0].source.type" and "--image-fetch" in info.value.message


def test_the_flags() -> None:
    parser = argparse.ArgumentParser()
    add_args(parser, HttpConfig)
    limits = from_args(HttpConfig, parser.parse_args(["--image-fetch", "--image-fetch-timeout-s", "2.5"])).image_limits()
    assert (limits.fetch, limits.fetch_timeout_s) == (True, 2.5)
    with pytest.raises(ValueError, match="--image-fetch-timeout-s"):
        HttpConfig(image_fetch_timeout_s=0)


# ---- fetching, from a server on this machine --------------------------------------------------------------------

BIG = 256 * 1024  # (what /endless sends, in 16 KiB writes, before it gives up)


class ImageServer(BaseHTTPRequestHandler):
    """The image server. Its routes: /red.png, an image (/untyped.png with no Content-Type; /wide.png too wide;
    /fake.png no image); /endless, image bytes with no Content-Length that go on; /declared, a Content-Length over
    any bound; /page, HTML; /gzip, a compressed body; /missing, 404; /to-red, a relative redirect to /red.png;
    /to-metadata, /to-private and /to-ftp, redirects to what is not fetched; /loop, a redirect to itself; /stall, no
    answer until the test ends."""

    hosts: list[str]
    hits: dict[str, int]
    release: threading.Event

    def log_message(self, *args: Any) -> None:  # (quiet)
        pass

    def do_GET(self) -> None:
        self.hosts.append(self.headers.get("Host", ""))
        self.hits[self.path] = self.hits.get(self.path, 0) + 1
        routes = {
            "/red.png": lambda: self.reply(200, RED, {"Content-Type": "image/png", "Content-Length": str(len(RED))}),
            "/untyped.png": lambda: self.reply(200, RED, {}),
            "/wide.png": lambda: self.reply(200, png(9000, 10), {"Content-Type": "image/png"}),
            "/fake.png": lambda: self.reply(200, b"%PDF-1.7", {"Content-Type": "image/png"}),
            "/endless": self.endless,
            "/declared": lambda: self.reply(200, b"", {"Content-Type": "image/png", "Content-Length": str(1 << 40)}),
            "/page": lambda: self.reply(200, b"<html></html>", {"Content-Type": "text/html; charset=utf-8"}),
            "/gzip": lambda: self.reply(200, gzip.compress(RED), {"Content-Type": "image/png", "Content-Encoding": "gzip"}),
            "/missing": lambda: self.reply(404, b"no", {"Content-Type": "text/plain"}),
            "/to-red": lambda: self.reply(302, b"", {"Location": "/red.png"}),
            "/to-metadata": lambda: self.reply(302, b"", {"Location": "http://169.254.169.254/latest/meta-data/"}),
            "/to-private": lambda: self.reply(301, b"", {"Location": "https://[::ffff:10.0.0.1]/x.png"}),
            "/loop": lambda: self.reply(307, b"", {"Location": "/loop"}),
            "/to-ftp": lambda: self.reply(302, b"", {"Location": "ftp://127.0.0.1/x.png"}),
            "/stall": self.stall,
        }
        routes.get(self.path, lambda: self.reply(404, b"", {}))()

    def reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def endless(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.end_headers()
        try:
            for k in range(BIG // 16384):
                self.wfile.write((RED if k == 0 else b"") + bytes(16384))
        except OSError:  # (the client stopped reading and closed: as it should)
            pass

    def stall(self) -> None:
        self.release.wait(5)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, type[ImageServer]]]:
    """The image server's base URL (http://127.0.0.1:PORT), and its handler class (what it was asked).

    The address check is widened here to let 127.0.0.1 through: a test can only start a server on this machine, and
    every loopback address is refused otherwise (as it must be: that is the point of the check, which the tests above
    check on its own). Every other address stays refused, so a redirect to one is still caught."""
    real = image_fetch.refusal
    loopback = ipaddress.ip_address("127.0.0.1")
    monkeypatch.setattr(image_fetch, "refusal", lambda address: None if address == loopback else real(address))
    handler = type("Handler", (ImageServer,), {"hosts": [], "hits": {}, "release": threading.Event()})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    finally:
        handler.release.set()
        httpd.shutdown()
        httpd.server_close()


ON = ImageLimits(fetch=True, fetch_timeout_s=2.0)


async def fetched(url: str, limits: ImageLimits = ON) -> list[ImagePart]:
    """The images of a chat request whose user message gives `url`, as the gateway makes them: the body decoded
    (its image left to fetch), then the fetch."""
    images = Images(limits)
    sub = chat_submit({"messages": [{"role": "user", "content": [image_url(url, detail="low")]}]}, "r", None, images)[0]
    assert (sub.messages or [])[0].images() == [ImagePart(data=b"", detail="low")]  # (not yet fetched)
    await images.fetch()
    return (sub.messages or [])[0].images()


async def refused(url: str, limits: ImageLimits = ON) -> str:
    with pytest.raises(RequestError) as info:
        await fetched(url, limits)
    assert info.value.status == 400 and info.value.param == "messages[0].content[0].image_url.url"
    return info.value.message


@pytest.mark.anyio
async def test_an_image_by_url_is_fetched_into_its_part(server: tuple[str, type[ImageServer]]) -> None:
    base, handler = server
    assert await fetched(f"{base}/red.png") == [ImagePart(data=RED, detail="low")]
    assert await fetched(f"{base}/untyped.png") == [ImagePart(data=RED, detail="low")]  # (no Content-Type: its bytes say)
    assert await fetched(f"{base}/to-red") == [ImagePart(data=RED, detail="low")]  # (a redirect, relative)
    assert handler.hosts == [base.removeprefix("http://")] * 4


@pytest.mark.anyio
async def test_the_name_is_resolved_once_and_that_address_connected_to(
    server: tuple[str, type[ImageServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name is looked up once; the connection goes to the address found, the Host header naming the name (a
    second lookup could give an internal address: DNS rebinding)."""
    base, handler = server
    port = base.rsplit(":", 1)[1]
    looked_up: list[str] = []

    async def resolved(host: str, port: int) -> list[str]:
        looked_up.append(host)
        return {"images.example": ["127.0.0.1"], "mixed.example": ["8.8.8.8", "10.0.0.1"]}[host]

    monkeypatch.setattr(image_fetch, "resolved", resolved)
    assert await fetched(f"http://images.example:{port}/red.png") == [ImagePart(data=RED, detail="low")]
    assert looked_up == ["images.example"] and handler.hosts == [f"images.example:{port}"]
    why = await refused(f"http://mixed.example:{port}/red.png")  # (every address must be public)
    assert "forbidden address: mixed.example resolves to a private address" in why
    target, headers, extensions = await image_fetch._pinned("https://images.example/a.png?x=1", "f")
    assert (str(target), headers["Host"], extensions) == (
        "https://127.0.0.1/a.png?x=1",
        "images.example",
        {"sni_hostname": "images.example"},  # (TLS names the host: its certificate is checked against it)
    )


@pytest.mark.anyio
async def test_each_bound_is_a_400_naming_the_part_and_why(
    server: tuple[str, type[ImageServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    base, handler = server
    real = image_fetch.resolved

    async def resolved(host: str, port: int) -> list[str]:  # (no DNS asked: it may be slow, or absent, here)
        if host.endswith(".invalid"):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return await real(host, port)

    monkeypatch.setattr(image_fetch, "resolved", resolved)
    small = ImageLimits(max_bytes=32 * 1024, fetch=True, fetch_timeout_s=2.0)
    assert "over this server's 32768 bytes per image (--max-image-bytes); reading stopped" in await refused(
        f"{base}/endless", small
    )
    assert "--max-image-bytes" in await refused(f"{base}/declared")
    assert "not an image (Content-Type: text/html" in await refused(f"{base}/page")
    assert "Content-Encoding: gzip" in await refused(f"{base}/gzip")
    assert "the server answered 404" in await refused(f"{base}/missing")
    assert "resolves to a link-local address" in await refused(f"{base}/to-metadata")
    assert "resolves to a private (IPv4 inside IPv6) address" in await refused(f"{base}/to-private")
    assert "more than 3 redirects" in await refused(f"{base}/loop")
    assert handler.hits["/loop"] == 4  # (the first request and 3 redirects followed)
    assert "loopback address" in await refused("http://[::1]:9/x.png")  # (only 127.0.0.1 is let through here)
    assert "does not resolve" in await refused("http://no-such-host.invalid/x.png")
    assert "unreachable" in await refused(f"{base.rsplit(':', 1)[0]}:1/x.png")  # (nothing listens on port 1)
    assert "ftp: URL (only http and https are fetched)" in await refused(f"{base}/to-ftp")


@pytest.mark.anyio
async def test_a_fetched_image_meets_an_inline_image_s_checks(server: tuple[str, type[ImageServer]]) -> None:
    base, _ = server
    assert "at most 8192 on a side are served (--max-image-side)" in await refused(f"{base}/wide.png")
    assert "not a PNG, JPEG, GIF, BMP or WebP image" in await refused(f"{base}/fake.png")
    assert "--max-image-bytes" in await refused(f"{base}/red.png", ImageLimits(max_bytes=len(RED) - 1, fetch=True))
    images = Images(ImageLimits(max_images=1, fetch=True))  # (counted as the body is decoded, before any fetch)
    with pytest.raises(RequestError) as info:
        chat_submit({"messages": [{"role": "user", "content": [image_url(f"{base}/red.png")] * 2}]}, "r", None, images)
    assert info.value.param == "messages[0].content[1]" and "--max-images" in info.value.message


@pytest.mark.anyio
async def test_a_server_that_stalls_is_given_up_on(server: tuple[str, type[ImageServer]]) -> None:
    base, _ = server
    t0 = time.monotonic()
    why = await refused(f"{base}/stall", ImageLimits(fetch=True, fetch_timeout_s=0.3))
    assert "no answer within 0.3 s (--image-fetch-timeout-s)" in why and time.monotonic() - t0 < 1.5


@pytest.mark.anyio
async def test_each_api_fetches_its_images_over_http(server: tuple[str, type[ImageServer]]) -> None:
    base, _ = server
    url = f"{base}/red.png"
    fake = ScriptedRouter(result(text="A red pixel."))
    bodies = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": [image_url(url)]}]},
        "/v1/responses": {"input": [{"role": "user", "content": [input_image(url)]}]},
        "/v1/messages": {"max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": url}}]}]},
    }  # fmt: skip
    async with client_for(fake, image_limits=ON) as c:
        for path, body in bodies.items():
            r = await c.post(path, json=body)
            assert r.status_code == 200, r.text
        r = await c.post("/v1/messages/count_tokens", json={"messages": bodies["/v1/messages"]["messages"]})
        assert r.status_code == 200, r.text
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [image_url(f"{base}/page")]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url.url"
        assert "not an image" in r.json()["error"]["message"]
    assert [(s.messages or [])[-1].images() for s in fake.submits] == [[ImagePart(data=RED)]] * 3
    assert fake.tokenized[0].messages and fake.tokenized[0].messages[0].images() == [ImagePart(data=RED)]
