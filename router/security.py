"""CurveZMQ on the router's two sockets, and the loopback rule for sockets without it.

A socket is secured when its allowed-keys directory is given (`--client-keys` for the client socket,
`--worker-keys` for the worker socket): it becomes a CURVE server with the router's key pair
(`--curve-key`), and only peers whose public key is one of the `*.pub` files there get in. The
router's own public key is always allowed, so local processes holding the router's key file (the
workers and HTTP API of `kvroute serve`) get in too. A refused peer is logged (`peer_refused`, with its
address and key) by the ZAP handler in this module; a peer that does not speak CURVE at all fails the
handshake (`handshake_failed`, from the socket monitor).

A socket without CURVE may only bind a loopback (or ipc/inproc) endpoint unless `--insecure-bind` is
given, which logs a warning: anyone who can reach that address could submit work or pose as a worker. A worker
socket on loopback TCP without CURVE is let bind with a warning too (`unauthenticated`): any process on the host
could join as a worker and receive every tenant's prompts. `kvroute serve` never leaves it so: it makes a key for its
local workers (commands/serve.py). An ipc:// socket is made its user's alone (mode 0600) once bound.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from common import logs
from common.keys import read_key, read_public_keys
from router.config import RouterConfig

log = logs.get(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP RFC: one handler per ZMQ context
HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


def is_loopback(endpoint: str) -> bool:
    """True for endpoints only this host can reach: ipc://, inproc://, tcp on 127.x, ::1 or localhost."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rpartition(":")[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass
class Security:
    """The router's key pair and, per ZAP domain ("clients", "workers"), the allowed public keys (Z85)."""

    public: bytes | None = None
    secret: bytes | None = None
    allowed: dict[str, set[bytes]] = field(default_factory=dict)
    insecure: list[str] = field(default_factory=list)  # endpoints bound without CURVE off loopback
    unauthenticated: list[str] = field(default_factory=list)  # a loopback TCP worker endpoint without CURVE

    @classmethod
    def from_config(cls, cfg: RouterConfig) -> Security:
        """Read the key files; raises ValueError naming the flag and the problem."""
        sec = cls()
        dirs = {"clients": cfg.client_keys, "workers": cfg.worker_keys}
        if cfg.curve_key is None and any(dirs.values()):
            raise ValueError("--client-keys/--worker-keys need --curve-key: the router's secret key file (kvroute keys generate)")
        if cfg.curve_key is not None:
            if not any(dirs.values()):
                raise ValueError("--curve-key needs --worker-keys and/or --client-keys: directories of the allowed peers' *.pub")
            sec.secret = read_key(cfg.curve_key, secret=True)
            sec.public = read_key(cfg.curve_key, secret=False)
            for domain, directory in dirs.items():
                if directory is not None:
                    sec.allowed[domain] = read_public_keys(directory) | {sec.public}
        for flag, endpoint, domain in (
            ("--zmq", cfg.client_endpoint, "clients"),
            ("--worker-endpoint", cfg.worker_endpoint, "workers"),
        ):
            if domain in sec.allowed or is_loopback(endpoint):
                continue
            if not cfg.insecure_bind:
                keys = "--client-keys" if domain == "clients" else "--worker-keys"
                raise ValueError(
                    f"{flag} {endpoint} is not a loopback address and has no CURVE keys:"
                    f" give --curve-key with {keys}, or --insecure-bind to let anyone who reaches it in"
                )
            sec.insecure.append(endpoint)
        if "workers" not in sec.allowed and cfg.worker_endpoint.startswith("tcp://"):
            sec.unauthenticated.append(cfg.worker_endpoint)
        return sec

    def secure(self, sock: zmq.Socket, domain: str) -> None:
        """Make `sock` a CURVE server for `domain` (before it binds), if that domain has allowed keys."""
        if domain not in self.allowed:
            return
        assert self.secret is not None and self.public is not None
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)


class Gatekeeper:
    """The ZAP handler (bound before any CURVE socket, so no handshake can pass unchecked) and the
    handshake-failure monitors. Runs as tasks on the router's loop."""

    def __init__(self, ctx: zmq.asyncio.Context, security: Security) -> None:
        self.security = security
        self.refused = 0
        self.zap: zmq.asyncio.Socket | None = None
        self.monitors: list[tuple[str, zmq.asyncio.Socket]] = []
        if security.allowed:
            self.zap = ctx.socket(zmq.REP)
            self.zap.setsockopt(zmq.LINGER, 0)
            self.zap.bind(ZAP_ENDPOINT)

    def watch(self, sock: zmq.asyncio.Socket, domain: str) -> None:
        if domain in self.security.allowed:
            self.monitors.append((domain, sock.get_monitor_socket(HANDSHAKE_EVENTS)))

    def tasks(self) -> list[asyncio.Future[None]]:
        out: list[asyncio.Future[None]] = [asyncio.ensure_future(self._monitor(d, m)) for d, m in self.monitors]
        if self.zap is not None:
            out.append(asyncio.ensure_future(self._serve_zap()))
        return out

    def close(self) -> None:
        for _, mon in self.monitors:
            mon.close(0)
        if self.zap is not None:
            self.zap.close(0)

    def check(self, domain: str, address: str, mechanism: bytes, credentials: list[bytes]) -> bool:
        allowed = self.security.allowed.get(domain)
        if mechanism != b"CURVE" or allowed is None or len(credentials) != 1:
            ok, key = False, ""
        else:
            key = z85.encode(credentials[0]).decode()
            ok = key.encode() in allowed
        if not ok:
            self.refused += 1
            log.warning("peer_refused", socket=domain, address=address, key=key, reason="public key not allowed")
        return ok

    async def _serve_zap(self) -> None:
        assert self.zap is not None
        while True:
            frames = await self.zap.recv_multipart()
            if len(frames) < 6:
                continue  # not a ZAP request; nothing sensible to answer
            version, request_id, domain, address, _identity, mechanism = frames[:6]
            ok = self.check(domain.decode(errors="replace"), address.decode(errors="replace"), mechanism, frames[6:])
            status, text = (b"200", b"OK") if ok else (b"400", b"public key not allowed")
            await self.zap.send_multipart([version, request_id, status, text, b"", b""])

    async def _monitor(self, domain: str, mon: zmq.asyncio.Socket) -> None:
        with contextlib.suppress(zmq.ZMQError):
            while True:
                event = parse_monitor_message(await mon.recv_multipart())
                what = str(zmq.Event(event["event"]).name).lower()  # e.g. handshake_failed_protocol: no CURVE at all
                log.warning("handshake_failed", socket=domain, what=what, endpoint=event["endpoint"].decode(errors="replace"))
