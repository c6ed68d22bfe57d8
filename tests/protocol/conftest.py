"""Prints how many frames the protocol fuzz tests tried and whether any exception escaped a decoder."""

from __future__ import annotations

from typing import Any

from fuzz_stats import STATS


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if STATS.frames:
        s = STATS
        terminalreporter.write_line(
            f"protocol fuzz: {s.frames} frames tried ({s.decodes} decodes: {s.valid} messages, {s.invalid} Invalid), "
            f"{s.escaped} exceptions escaped"
        )
