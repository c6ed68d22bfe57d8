"""An image by http(s) URL, fetched for a request where the operator turned fetching on (`--image-fetch`; off by
default: a request would have the server reach any host its network can). Each fetch is bounded:

- http and https only; the URL's host resolved once, every address it resolves to public (`refusal`: no loopback,
  private, link-local, multicast, reserved or unspecified address, nor one of these inside an IPv6 address), and the
  connection made to that address, the Host header and TLS (SNI, the certificate's name) naming the host: a name that
  resolves to an internal address the next time (DNS rebinding) is not asked again;
- at most MAX_REDIRECTS redirects, each one's URL checked as the first was;
- the whole fetch (resolving, redirects, the body) within `--image-fetch-timeout-s`, the body within
  `--max-image-bytes`, counted as it arrives (reading stops past it); a Content-Type, when given, must be `image/*`,
  and the body must come as it is (no Content-Encoding: a small gzip body can hold a huge one).

No proxy from the environment is used (a proxy would connect for us, to whatever address it resolves). Each failure
is a RequestError (400) naming the field and why; the bytes fetched then go through the checks of an image sent in
the request (gateway/images.py).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import ssl
from typing import Any, NoReturn

import httpx

from gateway.errors import RequestError

MAX_REDIRECTS = 3
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # (an IPv4 address reached through a NAT64 gateway)
_HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity", "User-Agent": "kvroute"}

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def refusal(address: Address) -> str | None:
    """Why the server does not connect to `address` (the kind of address it is: "loopback", "private", ...), or None
    for a public address. An IPv4 address inside an IPv6 one (mapped, NAT64, 6to4) is judged as itself."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.ipv4_mapped or address.sixtofour
        if inner is None and address in _NAT64:
            inner = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if inner is not None:
            why = refusal(inner)
            return None if why is None else f"{why} (IPv4 inside IPv6)"
    for kind in ("unspecified", "loopback", "link_local", "site_local", "multicast", "private", "reserved"):
        if getattr(address, f"is_{kind}", False):  # (site-local: IPv6's alone)
            return kind.replace("_", "-")
    if not address.is_global:  # (shared address space 100.64.0.0/10, and the like)
        return "non-public"
    return None


async def fetch(url: str, field: str, *, max_bytes: int, timeout_s: float) -> bytes:
    """The body at `url` (http or https), within the bounds above; a RequestError naming `field` when it cannot be had."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _follow(url, field, max_bytes, timeout_s)
    except TimeoutError:
        failed(field, f"no answer within {timeout_s:g} s (--image-fetch-timeout-s)")


def failed(field: str, why: str) -> NoReturn:
    raise RequestError(f"`{field}`: the image's URL was not fetched: {why}", param=field)


async def _follow(url: str, field: str, max_bytes: int, timeout_s: float) -> bytes:
    """The body at `url`, following at most MAX_REDIRECTS redirects, each to an address checked anew."""
    tls = await asyncio.to_thread(_tls)  # (the first time: the CA certificates read off the event loop)
    async with httpx.AsyncClient(verify=tls, trust_env=False, follow_redirects=False, timeout=timeout_s + 1) as client:
        for _ in range(MAX_REDIRECTS + 1):
            target, headers, extensions = await _pinned(url, field)
            try:
                async with client.stream("GET", target, headers=headers, extensions=extensions) as reply:
                    if reply.status_code not in _REDIRECTS:
                        return await _body(reply, field, max_bytes)
                    location = reply.headers.get("location")
                    if not location:
                        failed(field, f"a {reply.status_code} redirect with no Location")
                    url = str(httpx.URL(url).join(location))
            except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
                failed(field, f"unreachable ({type(exc).__name__}{': ' + str(exc)[:120] if str(exc) else ''})")
    failed(field, f"more than {MAX_REDIRECTS} redirects")


async def _pinned(url: str, field: str) -> tuple[httpx.URL, dict[str, str], dict[str, Any]]:
    """The request for `url` made to the one address its host was resolved to (every address it resolves to public):
    the URL with that address for its host, the headers (Host naming the host), the extensions (TLS's name)."""
    try:
        u = httpx.URL(url)
        host = u.raw_host.decode("ascii")
    except (httpx.InvalidURL, UnicodeError):
        failed(field, "not a valid URL")
    if u.scheme not in ("http", "https"):
        failed(field, f"{u.scheme or 'a'}: URL (only http and https are fetched)")
    if not host:
        failed(field, "the URL names no host")
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        found = await resolved(host, port)
    except (OSError, UnicodeError):
        failed(field, f"unreachable ({host[:100]} does not resolve)")
    addresses = []
    for text in found:
        try:
            address = ipaddress.ip_address(text)
        except ValueError:
            failed(field, f"{host[:100]} resolves to an address that is not IPv4 or IPv6")
        why = refusal(address)
        if why is not None:
            failed(field, f"forbidden address: {host[:100]} resolves to a {why} address; only public addresses are fetched")
        addresses.append(address)
    if not addresses:
        failed(field, f"unreachable ({host[:100]} does not resolve)")
    target = httpx.URL(scheme=u.scheme, host=str(addresses[0]), port=u.port, raw_path=u.raw_path)
    extensions = {"sni_hostname": host} if u.scheme == "https" else {}
    return target, {**_HEADERS, "Host": u.netloc.decode("ascii")}, extensions


async def resolved(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (an address itself: that one), looked up off the event loop."""
    found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(sockaddr[0]) for *_, sockaddr in found]


async def _body(reply: httpx.Response, field: str, max_bytes: int) -> bytes:
    """A reply's body, read while it stays within `max_bytes`, once its status and headers say it is an image."""
    if reply.status_code != 200:
        failed(field, f"the server answered {reply.status_code}")
    kind = reply.headers.get("content-type", "").strip()
    if kind and not kind.lower().startswith("image/"):
        failed(field, f"not an image (Content-Type: {kind[:64]})")
    coding = reply.headers.get("content-encoding", "").strip().lower()
    if coding not in ("", "identity"):
        failed(field, f"the body came encoded (Content-Encoding: {coding[:32]}); an image is fetched as it is")
    over = f"the image is over this server's {max_bytes} bytes per image (--max-image-bytes)"
    declared = reply.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > max_bytes:
        failed(field, over)
    chunks, size = [], 0
    async for chunk in reply.aiter_raw():
        size += len(chunk)
        if size > max_bytes:
            failed(field, over + "; reading stopped there")
        chunks.append(chunk)
    return b"".join(chunks)


@functools.cache
def _tls() -> ssl.SSLContext:
    """The TLS settings of every fetch (certificates checked against the CA bundle), made once."""
    return httpx.create_ssl_context()
