"""Servers a bench starts itself: start one with its log, wait until a request of its own is answered, stop them all;
and the interleaved timing of the same requests on each, with its report."""

from __future__ import annotations

import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def start(cmd: list[str], log: Path, cwd: str | Path | None = None) -> subprocess.Popen[bytes]:
    """`cmd` in its own session, its output appended to `log`; `cwd`: another checkout whose modules it runs."""
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd)


def wait_ready(
    url: str, proc: subprocess.Popen[bytes], log: Path, path: str, body: dict[str, Any], timeout_s: float = 300
) -> None:
    """Until POST `path` with `body` answers 200 (a server's /health says ok before its model can answer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: exited; log tail:\n{log.read_text()[-2000:]}")
        try:
            if httpx.post(f"{url}{path}", json=body, timeout=60).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url}: not ready in {timeout_s:.0f} s")


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def interleaved_rates(
    urls: dict[str, str], path: str, bodies: Callable[[], list[dict[str, Any]]], items: int, repeats: int
) -> dict[str, list[float]]:
    """Items per second of each system, per repeat: each repeat's requests (`bodies()`, each of `items` items) sent to
    every system in turn, one at a time, so the systems meet the same machine's moods."""
    rates: dict[str, list[float]] = {n: [] for n in urls}
    for _ in range(repeats):
        batch = bodies()
        for name, url in urls.items():
            t0 = time.monotonic()
            for body in batch:
                httpx.post(f"{url}{path}", json=body, timeout=600).raise_for_status()
            rates[name].append(len(batch) * items / (time.monotonic() - t0))
    return rates


def print_rates(rates: dict[str, list[float]], unit: str, digits: int) -> list[float]:
    """The table of rates per repeat and the kvroute / llama-server ratios (returned)."""
    ratios = [k / s for k, s in zip(rates["kvroute"], rates["llama-server"], strict=True)]
    print(f"| system | {unit}/s per repeat | median |")
    print("| --- | --- | --- |")
    for name, got in rates.items():
        print(f"| {name} | {', '.join(f'{x:.{digits}f}' for x in got)} | {statistics.median(got):.{digits}f} |")
    per = ", ".join(f"{r:.3f}" for r in ratios)
    print(f"kvroute / llama-server: median {statistics.median(ratios):.3f} (per repeat {per})")
    return ratios
