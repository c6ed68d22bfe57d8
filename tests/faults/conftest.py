"""The fault tests run real `kvroute serve` processes with the real model; `Served` is shared with the front-door
tests, whose directory is put on the path here."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontdoor"))
