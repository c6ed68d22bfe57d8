"""CurveZMQ on a socket that connects to a router (a client's DEALER, a worker's DEALER and its probes): the one
rule for which keys a peer gives, below every process and the Python client, so that a worker needs no client code."""

from __future__ import annotations

from typing import Any

import zmq

from common.keys import read_key


def secure_client_socket(sock: zmq.Socket[Any], curve_key: str | None, router_key: str | None) -> None:
    """CurveZMQ towards the router: this peer's key file (secret) and the router's public key file.
    Both None: plain TCP. Raises ValueError naming a missing or unreadable key (call before connect)."""
    if curve_key is None and router_key is None:
        return
    if curve_key is None or router_key is None:
        raise ValueError("CURVE needs both this peer's key file and the router's public key file")
    sock.setsockopt(zmq.CURVE_SECRETKEY, read_key(curve_key, secret=True))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, read_key(curve_key, secret=False))
    sock.setsockopt(zmq.CURVE_SERVERKEY, read_key(router_key, secret=False))
