"""One `kvroute serve` shared by the real coding agents and the long tool call: a context long enough for their system
prompts, and room for that call (the capture proxy caps every other reply: `real_agents.capped`).

Every test that runs an agent gives it the same home (`agent_homes`, real_agents.fresh_home): an agent's prompt names
its working directory (Copilot's, its session folder too: its id is fixed, real_agents.COPILOT_SESSION), so with one
path a later test starts from the prefix an earlier one computed, as far as the two prompts agree (Copilot's Chat and
Responses runs: its system prompt and tools, ~11.6k tokens)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontdoor"))
from real_agents import API_KEY, SERVE_FLAGS
from served import Served


@pytest.fixture(scope="session")
def agent_homes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("agents-homes"))


@pytest.fixture(scope="session")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    log = Path(tmp_path_factory.mktemp("agents-serve")) / "serve.log"
    s = Served(*SERVE_FLAGS, api_key=API_KEY, log=log)
    yield s
    s.stop()
