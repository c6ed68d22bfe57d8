"""Servers a bench starts itself: start one with its log, wait until a request of its own is answered, stop them all."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import httpx


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


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
