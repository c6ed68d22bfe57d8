"""No local process without the key joins `kvroute serve`'s router as a worker (issue item 3): the worker endpoint
(tcp://127.0.0.1:5556 by default) let any local user start `kvroute worker --connect` and receive every tenant's
prompts, and its hello could claim cached prefixes to draw them."""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgspec
import pytest
import zmq
from hostile_helpers import FakeWorker, endpoints, start_router

from commands.serve import worker_keys_for_this_run
from common.keys import generate
from common.socket_security import secure_client_socket
from common.vocab import Vocab
from protocol import Accept, Hello, encode
from router.config import RouterConfig


def worker(endpoint: str, worker_id: str, vocab: Vocab, keys: tuple[str, str] | None = None) -> FakeWorker:
    """A scripted worker whose socket speaks CURVE with `keys` (its key file, the router's public key file)."""
    w = FakeWorker(endpoint, worker_id, vocab)
    w.sock.close(0)
    w.sock = zmq.Context.instance().socket(zmq.DEALER)
    w.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
    w.sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        secure_client_socket(w.sock, *keys)
    w.sock.connect(endpoint)
    return w


def test_a_process_without_the_key_cannot_join_as_a_worker(vocab: Vocab, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    client_ep, worker_ep = endpoints()
    cfg, keys_dir = worker_keys_for_this_run(RouterConfig(client_endpoint=client_ep, worker_endpoint=worker_ep))
    assert keys_dir is not None and cfg.curve_key is not None and cfg.worker_keys is not None
    assert (Path(cfg.curve_key).stat().st_mode & 0o777) == 0o600
    rt = start_router(cfg, vocab)
    try:
        generate(tmp_path / "other", "intruder")
        intruders = [
            worker(worker_ep, "plain", vocab),  # no CURVE at all
            worker(worker_ep, "foreign", vocab, (str(tmp_path / "other" / "intruder.key"), cfg.curve_key)),  # a key not let in
        ]
        hello = Hello(worker_id="x", incarnation=1, slots=2, ctx_per_slot=4096, model_fingerprint=vocab.fingerprint, device="cpu")
        poller = zmq.Poller()
        for w in intruders:
            with contextlib.suppress(zmq.Again):  # (no handshake passed: no peer to send to)
                w.sock.send(encode(msgspec.structs.replace(hello, worker_id=w.id)), zmq.NOBLOCK)
            poller.register(w.sock, zmq.POLLIN)
        answered = dict(poller.poll(1500))  # (both waited for side by side)
        assert not answered, f"{[w.id for w in intruders if w.sock in answered]} got an answer"
        assert rt.router.workers == {}
        assert rt.router.gatekeeper is not None and rt.router.gatekeeper.refused >= 1
        local = worker(worker_ep, "cpu0", vocab, (cfg.curve_key, cfg.curve_key))  # as serve's own workers hold it
        assert isinstance(local.hello(), Accept)
        assert set(rt.router.workers) == {"cpu0"}
        for w in [*intruders, local]:
            w.close()
    finally:
        rt.stop()
