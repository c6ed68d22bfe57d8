"""With an API key on the HTTP API, `kvroute serve`'s ZMQ client socket is not a way around it: the default TCP
endpoint becomes an IPC socket in a directory only this user can enter."""

from __future__ import annotations

import stat

from commands.serve import guard_zmq_clients
from gateway.server import HttpConfig
from router.config import RouterConfig


def test_a_keyed_api_moves_the_default_zmq_endpoint_to_a_private_ipc_socket(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("KVROUTE_API_KEY", raising=False)
    router, http = guard_zmq_clients(RouterConfig(), HttpConfig(http="127.0.0.1:8123", api_key="k"))
    assert http is not None and router.client_endpoint == http.router == f"ipc://{tmp_path}/kvroute/clients-8123.sock"
    assert stat.S_IMODE((tmp_path / "kvroute").stat().st_mode) == 0o700


def test_without_a_key_or_with_an_endpoint_of_the_users_choice_nothing_moves(monkeypatch):
    monkeypatch.delenv("KVROUTE_API_KEY", raising=False)
    cfg = RouterConfig()
    assert guard_zmq_clients(cfg, HttpConfig(api_key=None))[0] is cfg
    chosen = RouterConfig(client_endpoint="tcp://127.0.0.1:7777")
    assert guard_zmq_clients(chosen, HttpConfig(api_key="k"))[0] is chosen  # kept (and a warning is logged)
    assert guard_zmq_clients(cfg, None)[0] is cfg
