"""Counts of the frames the fuzz tests fed to the decoders (printed at the end of the run by conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FuzzStats:
    frames: int = 0  # distinct frames built and fed
    decodes: int = 0  # decoder calls (most frames go to all four decoders)
    valid: int = 0  # decodes that gave a message
    invalid: int = 0  # decodes that gave an Invalid
    escaped: int = 0  # decodes that raised: must stay 0


STATS = FuzzStats()
