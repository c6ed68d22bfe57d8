"""The hostile-input suite (issue 46): requests and peers that try to freeze, fill or leak the server, each against
the part it attacks, on loopback only. Each test holds one item of the issue; the fast tier uses the real router with
scripted fake workers and the gateway with a stand-in router, the model tier (test_served.py) a real `kvroute serve`
in this process beside a real stream (hostile_helpers.py has the loop watch)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hostile_helpers import Routed

from common.model import resolve_model
from common.vocab import Vocab


@pytest.fixture(scope="session")
def vocab() -> Vocab:
    return Vocab.load(resolve_model(None))


@pytest.fixture
def routed(vocab: Vocab) -> Iterator[Routed]:
    r = Routed(vocab)
    yield r
    r.close()
