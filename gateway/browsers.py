"""What a web page the user has open may make this server do: nothing it is not meant to. A page cannot read a reply
from another origin, but without these checks it could still send requests (spending the machine's compute) and,
through DNS rebinding, read them too (`/slots`, `/metrics`, replies).

- Host check: a request whose `Host` is a name this server does not answer to gets 403. DNS rebinding points a name
  the attacker owns at 127.0.0.1, so the browser sends that name; an IP literal cannot be rebound, so any passes, as
  do `localhost` and `*.localhost` (browsers resolve them to loopback themselves), this machine's own names, the name
  --http binds, and the names of --allowed-hosts (`*`: any, behind a proxy that rewrites Host). No Host (HTTP/1.0)
  passes. Ollama checks the same (its allowedHosts middleware).
- JSON only: a POST whose Content-Type is not JSON (`application/json`, `application/*+json`) gets 415, a missing one
  too. What a page sends without the preflight that CORS would refuse is a form or text/plain, or no type at all
  (fetch() of a Blob or an ArrayBuffer); every API client sends application/json.
- CORS is off: no response carries Access-Control-* headers (a preflight gets 405) unless --cors-origins names the
  origins allowed.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from collections.abc import Iterable

ANY = "*"


def names_of(value: str) -> tuple[str, ...]:
    """A comma-separated flag value (`--allowed-hosts`, `--cors-origins`) as its names."""
    return tuple(n.strip() for n in value.split(",") if n.strip())


def host_name(header: str) -> str:
    """The name or address of a Host header, without its port, lower case, without a final dot."""
    host = header.strip().lower()
    if host.startswith("["):  # [IPv6]:port
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


@functools.cache
def machine_names() -> frozenset[str]:
    """This machine's own names (asked once: getfqdn may ask a resolver)."""
    return frozenset(n.lower().rstrip(".") for n in (socket.gethostname(), socket.getfqdn()) if n)


class AllowedHosts:
    """The names a request's Host may give (the module docstring). A name given with a leading dot (`.example.com`)
    allows that domain and every name under it."""

    def __init__(self, given: Iterable[str] = (), bind_host: str | None = None) -> None:
        given = tuple(host_name(n) for n in given if n.strip())  # (a name given with its port is the name)
        self.any = ANY in given
        bound = (host_name(bind_host),) if bind_host and not is_ip_literal(bind_host) else ()
        self.names = frozenset((*machine_names(), *bound, *(n for n in given if not n.startswith("."))))
        self.domains = tuple(n for n in given if n.startswith("."))

    def allows(self, header: str | None) -> bool:
        if self.any or not header or not header.strip():
            return True
        host = host_name(header)
        if is_ip_literal(host) or host == "localhost" or host.endswith(".localhost") or host in self.names:
            return True
        return any(host.endswith(d) or host == d[1:] for d in self.domains)


def host_refused_message(header: str) -> str:
    return (
        f"Host {host_name(header)[:253]!r} is not a name this server answers to (a web page could reach it through DNS "
        "rebinding); connect by IP address or localhost, or start the server with --allowed-hosts NAME"
    )


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type is JSON: application/json or application/*+json, parameters (charset) allowed."""
    media = (content_type or "").partition(";")[0].strip().lower()
    kind, _, sub = media.partition("/")
    return kind == "application" and (sub == "json" or sub.endswith("+json"))


def not_json_message(content_type: str | None) -> str:
    given = f"Content-Type {content_type!r} is not JSON" if content_type else "the request has no Content-Type"
    return (
        f"{given}: this API reads JSON bodies sent with Content-Type: application/json "
        "(curl -d sends a form: add -H 'Content-Type: application/json', or use --json)"
    )
