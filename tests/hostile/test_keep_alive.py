"""`keep_alive` from one request (issue item 6): it is for the time after that request, as Ollama reads it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from test_models import Fleet, model

from router.models import Models


def test_keep_alive_0_in_one_request_does_not_stick_to_the_model() -> None:
    """A request with `keep_alive: 0` unloads its model once idle; the next request, without one, gets the model's
    own keep-alive back (before: 0 stuck, and the model was unloaded after every later request too)."""
    a = model("a", keep_alive_s=300.0)
    ms = Models([a, model("b")], default=None)
    fleet = Fleet(ms)
    ms.used(a, 0.0)
    ms.tick(a.last_used + 0.01)
    assert fleet.log[-1] == ("unload", "a")
    fleet.exit("a")
    ms.used(a, None)  # loaded again, with its own keep-alive
    assert a.keep_alive_s == 300.0
    ms.tick(a.last_used + 60)
    assert fleet.log[-1] == ("load", "a"), fleet.log
