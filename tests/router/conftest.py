"""Router test fixtures: the vocabulary (no weights) and a router in a thread for fake-worker tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from router_helpers import RouterThread, endpoints, start_router

from common.model import resolve_model
from common.vocab import Vocab
from router.config import RouterConfig


@pytest.fixture(scope="session")
def vocab() -> Vocab:
    return Vocab.load(resolve_model(None))


@pytest.fixture
def fake_router(vocab: Vocab) -> Iterator[tuple[RouterThread, str, str]]:
    yield from _fake_router(vocab, heartbeat_timeout_s=1.0)


@pytest.fixture
def patient_router(vocab: Vocab) -> Iterator[tuple[RouterThread, str, str]]:
    """A fake router whose workers may stay silent for long (a test's fake worker sends no heartbeat while the router
    works for seconds on a loaded machine)."""
    yield from _fake_router(vocab, heartbeat_timeout_s=60.0)


def _fake_router(vocab: Vocab, heartbeat_timeout_s: float) -> Iterator[tuple[RouterThread, str, str]]:
    client_ep, worker_ep = endpoints()
    cfg = RouterConfig(
        client_endpoint=client_ep,
        worker_endpoint=worker_ep,
        heartbeat_timeout_s=heartbeat_timeout_s,
        no_workers_grace_s=30.0,
        min_match=4,
        busy_wait_ms=0,
        queue_size=8,
    )
    rt = start_router(cfg, vocab)
    yield rt, client_ep, worker_ep
    rt.stop()
