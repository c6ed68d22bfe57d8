"""A real `kvroute serve` (router + local worker + HTTP API) in a subprocess, on free loopback ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.systems import free_port


class Served:
    """`kvroute serve ...` started with free ports; `stop()` sends SIGTERM and waits."""

    def __init__(
        self,
        *flags: str,
        api_key: str | None = None,
        wait_ready: bool = True,
        log: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.http_port = free_port()
        self.zmq = f"tcp://127.0.0.1:{free_port()}"
        self.worker_ep = f"tcp://127.0.0.1:{free_port()}"
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.api_key = api_key
        cmd = [
            sys.executable,
            "-m",
            "commands.cli",
            "serve",
            "--zmq",
            self.zmq,
            "--worker-endpoint",
            self.worker_ep,
            "--http",
            f"127.0.0.1:{self.http_port}",
            *flags,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = log
        out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        self._out = out
        self.proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "KVROUTE_LOG_FORMAT": "json", **(env or {})},
            start_new_session=True,
        )
        if wait_ready:
            self.wait_health(200)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_health(self, want: int, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvroute serve exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                last = httpx.get(f"{self.url}/health", timeout=5, verify=False).status_code  # (plain HTTP: no CA bundle to load)
                if last == want:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # (a start is ~3 s: polled finely, a test waits no longer than it must)
        raise TimeoutError(f"/health never answered {want} (last {last})")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._out is not subprocess.DEVNULL:
            self._out.close()
        return self.proc.returncode
