"""One real `kvroute serve` shared by the front-door tests: 1 CPU worker x 2 slots, an API key, a small queue."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from served import Served

API_KEY = "test-key"
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here runs against a real `kvroute serve`: all are in the model tier (`-m "not model"` skips them)."""
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = Path(tmp_path_factory.mktemp("serve")) / "serve.log"
    s = Served(
        "--workers",
        "1",
        "--slots",
        "2",
        "--ctx-per-slot",
        "1024",
        "--threads",
        "2",
        "--queue-size",
        "2",
        "--hold-ms",
        "0",
        api_key=API_KEY,
        log=log,
    )
    yield s
    s.stop()
