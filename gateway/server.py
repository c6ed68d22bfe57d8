"""The HTTP API's server: its settings (HttpConfig, the flags of `kvroute http` and of `serve`'s HTTP part), its
listening socket, and `serve_http`, which runs it in this process (gateway/main.py, commands/serve.py, and each child
of gateway/processes.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
from dataclasses import dataclass
from typing import Any

from common import logs
from common.config import opt
from gateway.images import ImageLimits
from kvroute.client import reply_endpoint_of
from protocol import MAX_FRAME_BYTES

MAX_PROCESSES = 256  # --processes


@dataclass(frozen=True)
class HttpConfig:
    http: str = opt(
        "127.0.0.1:8000", "HOST:PORT the HTTP API listens on (loopback by default; 'off' in serve: none)", metavar="HOST:PORT"
    )
    router: str = opt(
        "tcp://127.0.0.1:5555",
        "the router's client endpoint; several, comma-separated: when the connection to the one in use drops, the next "
        "(a request whose output had not begun is sent there again; one whose output had begun finishes from its worker, "
        "or fails with router_lost when that worker is gone too)",
        metavar="ENDPOINT",
    )
    model_name: str = opt("default", "model name listed by /v1/models (kvroute serve sets it from the GGUF)")
    alias: str = opt("", "more names /v1/models lists for the model (comma-separated)", metavar="NAMES")
    strict_model_name: bool = opt(
        False,
        "refuse (404) a request naming a model other than the served name or an alias; by default any name is served, "
        "as llama-server does (coding agents ask for a second, smaller model by another name for background work)",
    )
    strict_api: bool = opt(
        False,
        "refuse (400) a request field no API of kvroute knows; by default such a field is a hint: served, logged and "
        "counted in kvroute_request_fields_ignored_total (new clients add fields every month)",
    )
    api_key: str | None = opt(
        None,
        "require this key (Authorization: Bearer KEY) on every endpoint but /health; several: comma-separated; "
        "default: $KVROUTE_API_KEY",
        metavar="KEY",
    )
    shared_cache: bool = opt(
        False,
        "API keys share cached prefixes. By default each key is a tenant: its prefixes are reused only by requests made "
        "with the same key (and the same cache_salt, when a request gives one), and /slots hides other tenants' slots. "
        "Shared, one key can learn another's prompts piece by piece from cached_tokens and timing (docs/security.md)",
    )
    tenant_per_key: bool = opt(
        False, "changes nothing: each API key is a tenant by default now (--shared-cache to share); kept for old command lines"
    )
    priority_keys: str = opt(
        "",
        "the API keys (comma-separated) whose requests may ask a higher priority (x-priority: interactive, service_tier: "
        "priority): they go first in the queue and pause others' jobs on their worker; 'all': every key. Default: every "
        "key when at most one is set, none when several (one key could otherwise go before everyone else's, always). "
        "Another key's ask is served at priority 0 and counted as a hint",
        metavar="KEYS",
    )
    allowed_hosts: str = opt(
        "",
        "more names the Host header may give (comma-separated; .example.com: that domain and every name under it; *: "
        "any, behind a proxy that rewrites Host). Always served: IP addresses, localhost, this machine's names and "
        "--http's; any other name gets 403 (a web page could reach this server through DNS rebinding)",
        metavar="NAMES",
    )
    cors_origins: str = opt(
        "",
        "web origins whose pages may call this API (comma-separated, e.g. http://localhost:3000; *: any). Default: "
        "none, and no response carries CORS headers",
        metavar="ORIGINS",
    )
    curve_key: str | None = opt(
        None, "this client's CurveZMQ key file (when the router's client socket uses CURVE)", metavar="FILE"
    )
    router_key: str | None = opt(None, "the router's public key file (.pub), with --curve-key", metavar="FILE")
    max_body_bytes: int = opt(MAX_FRAME_BYTES, "largest request body; a larger one gets 413 before it is read")
    max_frame_bytes: int = opt(MAX_FRAME_BYTES, "the router's --max-frame-bytes: a request larger than that gets 413 here")
    stream_stall_s: float = opt(
        30.0, "a streamed reply whose reader takes nothing for this long is cut: its generation is cancelled"
    )
    header_timeout_s: float = opt(
        10.0, "a connection whose request headers have not all come this long after their first byte is closed"
    )
    body_timeout_s: float = opt(
        60.0, "a request body not all received this long after its headers gets 408 (agents send theirs at once)"
    )
    max_connections: int = opt(
        512,
        "open connections (streams and idle kept-alive ones together) per HTTP process; a request beyond it gets 503. "
        "A coding agent holds a few, one per stream it reads; each takes a file descriptor",
    )
    reply_endpoint: str = opt(
        "auto",
        "where workers send streamed output straight to this HTTP API, past the router (PROTOCOL.md 4.4): 'auto' (an ipc "
        "path or loopback port when the router is on this host), tcp://HOST:PORT with HOST one the workers reach (PORT "
        "* picks one; needed with --processes above 1), or 'off' (all output through the router)",
        metavar="ENDPOINT",
    )
    pooling: str = opt(
        "auto",
        "how /v1/embeddings pools an input's token vectors into one: auto (the model's own: the pooling its GGUF "
        "declares, else mean, as llama-server), mean, last (causal models' usual choice for retrieval) or cls",
        choices=["auto", "mean", "last", "cls"],
    )
    processes: int = opt(
        1,
        "HTTP processes serving --http together (SO_REUSEPORT: the kernel spreads connections over them); each has "
        "its own connection to the router, and one that dies is started again",
    )
    max_image_bytes: int = opt(
        ImageLimits.max_bytes,
        "largest image a request may carry, in bytes once its base64 is decoded (a 400 naming it beyond); the body "
        "holding it must be within --max-body-bytes too",
    )
    max_images: int = opt(ImageLimits.max_images, "images one request may carry; the one past them is a 400 naming it")
    max_image_side: int = opt(
        ImageLimits.max_side, "widest or tallest image a request may carry, in pixels (read from the image's header)"
    )
    max_image_pixels: int = opt(
        ImageLimits.max_pixels, "most pixels (width x height, read from the image's header) one image may have"
    )
    image_fetch: bool = opt(
        False,
        "fetch the images requests give by http(s) URL (by default such a request is a 400: a request would have this "
        "server reach any host its network can). Only public addresses are fetched, the host resolved once and that "
        "address connected to, at most 3 redirects, within --image-fetch-timeout-s and --max-image-bytes",
    )
    image_fetch_timeout_s: float = opt(
        ImageLimits.fetch_timeout_s, "time one image's fetch may take, redirects and body included (--image-fetch)"
    )

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024 or self.max_frame_bytes < 1024:
            raise ValueError("--max-body-bytes and --max-frame-bytes must be at least 1024")
        if not 1 <= self.processes <= MAX_PROCESSES:
            raise ValueError(f"--processes must be between 1 and {MAX_PROCESSES}, got {self.processes}")
        reply_endpoint_of(self.reply_endpoint, self.router.split(",")[0])  # (ValueError naming what is wrong)
        if self.processes > 1 and self.reply_endpoint not in ("auto", "off") and not self.reply_endpoint.endswith(":*"):
            raise ValueError(
                f"--reply-endpoint: with --processes {self.processes}, give the port as * (each process binds its own)"
            )
        if self.stream_stall_s <= 0:
            raise ValueError(f"--stream-stall-s must be positive, got {self.stream_stall_s}")
        if self.header_timeout_s <= 0 or self.body_timeout_s <= 0:
            raise ValueError("--header-timeout-s and --body-timeout-s must be positive")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if min(self.max_image_bytes, self.max_image_side, self.max_image_pixels) < 1 or self.max_images < 0:
            raise ValueError(
                "--max-image-bytes, --max-image-side and --max-image-pixels must be at least 1, --max-images at least 0"
            )
        if not self.image_fetch_timeout_s > 0:
            raise ValueError(f"--image-fetch-timeout-s must be positive, got {self.image_fetch_timeout_s}")
        if self.tenant_per_key and self.shared_cache:
            raise ValueError("--tenant-per-key and --shared-cache: keys are tenants, or they share; give one")
        if self.tenant_per_key and not (self.api_key or os.environ.get("KVROUTE_API_KEY")):
            raise ValueError("--tenant-per-key needs --api-key (or $KVROUTE_API_KEY): tenants are told apart by key")

    def image_limits(self) -> ImageLimits:
        return ImageLimits(
            self.max_image_bytes,
            self.max_images,
            self.max_image_side,
            self.max_image_pixels,
            fetch=self.image_fetch,
            fetch_timeout_s=self.image_fetch_timeout_s,
        )


# Each connection's kernel send buffer, fixed (Linux would grow it to 4 MB): what queues for a reader that stopped
# reading stays bounded, and such a reader is found (--stream-stall-s) after a few hundred KB, not megabytes.
SEND_BUFFER_BYTES = 256 * 1024


def listen_socket(host: str, port: int, *, shared: bool = False) -> socket.socket:
    """The HTTP listening socket; accepted connections inherit its send buffer size. `shared`: other processes bind
    the same port too (SO_REUSEPORT) and the kernel spreads new connections over them."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
    try:
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def uvicorn_config(app: Any, cfg: HttpConfig, host: str, port: int) -> Any:
    """uvicorn's settings for the HTTP API: HTTP/1.1 with a deadline on headers, a cap on connections."""
    import uvicorn

    from gateway.limits import guarded_protocol

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        lifespan="off",
        access_log=False,
        http=guarded_protocol(cfg.header_timeout_s),
        limit_concurrency=cfg.max_connections,
    )


def warn_open_router(cfg: HttpConfig) -> None:
    """With an API key on the HTTP API, a router client socket on TCP without CURVE is a way around the key for any
    process that reaches it (the router does not know the key): say so, and what closes it."""
    keyed = bool(cfg.api_key or os.environ.get("KVROUTE_API_KEY"))
    open_tcp = [e for e in cfg.router.split(",") if e.strip().startswith("tcp://")]
    if keyed and open_tcp and cfg.curve_key is None:
        logs.get(__name__).warning(
            "zmq_clients_open",
            endpoints=open_tcp,
            reason="the HTTP API has a key but anyone who reaches the router's client socket is served without one: "
            "bind the router's --zmq to ipc://PATH in a directory only its user enters, or give it CURVE client keys",
        )


def parse_host_port(value: str) -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); raises ValueError naming the problem."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--http: expected HOST:PORT with a port in 1..65535, got {value!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


async def serve_http(cfg: HttpConfig, *, ready: asyncio.Event | None = None, signals: bool = True) -> None:
    """Run the HTTP API until cancelled. `signals`: SIGTERM/SIGINT stop it (uvicorn's graceful stop); False where
    another part of the process owns them (`kvroute serve`: the router drains first, then the HTTP API stops)."""
    import uvicorn

    from gateway.app import Gateway, build_app
    from gateway.browsers import AllowedHosts, names_of
    from kvroute.client import AsyncClient

    host, port = parse_host_port(cfg.http)
    client = AsyncClient(
        cfg.router,
        curve_key=cfg.curve_key,
        router_key=cfg.router_key,
        max_frame_bytes=cfg.max_frame_bytes,
        reply_endpoint=cfg.reply_endpoint,
    )
    api_key = cfg.api_key or os.environ.get("KVROUTE_API_KEY") or None
    gateway = Gateway(
        client,
        cfg.model_name,
        api_key,
        shared_cache=cfg.shared_cache,
        allowed_hosts=AllowedHosts(names_of(cfg.allowed_hosts), bind_host=host),
        cors_origins=names_of(cfg.cors_origins),
        aliases=tuple(a.strip() for a in cfg.alias.split(",") if a.strip()),
        strict_model_name=cfg.strict_model_name,
        strict_api=cfg.strict_api,
        pooling=cfg.pooling,
        max_body_bytes=cfg.max_body_bytes,
        stall_s=cfg.stream_stall_s,
        body_timeout_s=cfg.body_timeout_s,
        image_limits=cfg.image_limits(),
        priority_keys=cfg.priority_keys,
    )
    server = uvicorn.Server(uvicorn_config(build_app(gateway), cfg, host, port))
    if not signals:  # (uvicorn would take SIGTERM, stop at once and raise it again: the router's drain was cut short)
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign, assignment]
    log = logs.get(__name__)
    task = asyncio.ensure_future(server.serve(sockets=[listen_socket(host, port, shared=cfg.processes > 1)]))
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if task.done():
        await task  # raises the bind error
        raise OSError(f"HTTP server on {cfg.http} stopped at start-up")
    log.info("http_listening", url=f"http://{host}:{port}", router=cfg.router, auth=bool(api_key))
    # what start-up made is left out of the collector's full passes, which stop every thread and this loop with them
    # (a 4 MB body's objects set one off: 100 ms with start-up's objects in, 10 ms without)
    gc.freeze()
    if ready:
        ready.set()
    try:
        await task
    finally:
        server.should_exit = True
        await client.close()
