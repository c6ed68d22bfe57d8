"""Shared, expensive fixtures for the worker tests: loaded engines shared by the whole session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.vocab import Vocab
from worker.config import WorkerConfig
from worker.engine import Engine

CTX = 4096
SLOTS = 4
HERE = Path(__file__).resolve().parent
ENGINES = {"engine", "vocab", "fast_engine", "default4"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test here on one of these engines runs the real default model: it is in the model tier (`-m "not model"`
    skips it) whether or not its module says so."""
    for item in items:
        if HERE in Path(item.path).parents and ENGINES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def engine() -> Iterator[Engine]:
    """Deterministic engine shared by the worker tests: 4 slots x 4096 tokens, 2 threads."""
    eng = Engine(WorkerConfig(slots=SLOTS, ctx_per_slot=CTX, threads=2, deterministic=True)).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="session")
def vocab(engine: Engine) -> Vocab:
    return engine.vocab


@pytest.fixture(scope="session")
def fast_engine() -> Iterator[Engine]:
    """Default (fastest, not bit-reproducible) settings: 2 slots x 1024 tokens, for exact reuse accounting."""
    eng = Engine(WorkerConfig(slots=2, ctx_per_slot=1024, threads=2)).start()
    yield eng
    eng.stop()


@pytest.fixture(scope="session")
def default4() -> Iterator[Engine]:
    """Default mode (repacked weights, flash attention auto, speculation on) with four slots and no host-RAM tier (a
    prefix is found only in the slots)."""
    eng = Engine(WorkerConfig(slots=4, ctx_per_slot=1024, threads=2, host_cache_mb=0)).start()
    yield eng
    eng.stop()
