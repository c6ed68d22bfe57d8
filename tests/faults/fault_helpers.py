"""What the fault tests share: requests that run in threads and record how they ended, waiting on the router's
status, and the worker processes of a `kvroute serve`."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from kvroute.client import Client, KvrouteError
from protocol import Result, StatusReply

# `Served` (a real `kvroute serve` on free ports) is the front-door tests'; no conftest.py here, as tests/chat
# imports its own conftest by name
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "frontdoor"))
from served import Served, free_port

__all__ = ["Served", "free_port"]

T = TypeVar("T")

BOUND_S = 60.0  # nothing a test starts may take longer than this to end


def wait_for(check: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 0.2) -> T:
    """Poll `check` until it returns something other than None (or False); fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)


class ZmqStream(threading.Thread):
    """One streamed request on its own client socket; afterwards `result` or `error` says how it ended."""

    def __init__(self, endpoint: str, rid: str, *, max_tokens: int = 48, content: str | None = None) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.rid, self.max_tokens = endpoint, rid, max_tokens
        self.content = content or f"Tell me a long story about {rid}."
        self.deltas = 0
        self.result: Result | None = None
        self.error: Exception | None = None
        self.started_at = time.monotonic()
        self.ended_at: float | None = None
        self.start()

    def run(self) -> None:
        try:
            with Client(self.endpoint, timeout_s=BOUND_S) as client:
                stream = client.stream(
                    request_id=self.rid,
                    messages=[{"role": "user", "content": self.content}],
                    max_tokens=self.max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                )
                for _ in stream:
                    self.deltas += 1
                self.result = stream.result
        except (KvrouteError, TimeoutError) as exc:
            self.error = exc
        finally:
            self.ended_at = time.monotonic()

    def ended(self, timeout_s: float = BOUND_S) -> ZmqStream:
        self.join(timeout_s)
        assert not self.is_alive(), f"request {self.rid} still running after {timeout_s:g} s"
        return self

    @property
    def completed(self) -> bool:
        r = self.result
        return r is not None and r.finish_reason == "length" and r.usage.completion_tokens == self.max_tokens

    @property
    def code(self) -> str | None:
        return self.error.code if isinstance(self.error, KvrouteError) else None


class HttpStream(threading.Thread):
    """One streamed chat completion over HTTP; afterwards `status`, `chunks` (content deltas) and `finish_reason`."""

    def __init__(self, url: str, *, max_tokens: int = 48, content: str = "Tell me a long story.") -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.content = url, max_tokens, content
        self.status: int | None = None
        self.chunks = 0
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.error: Exception | None = None  # an HTTP failure, or the error event that ended the stream
        self.start()

    def run(self) -> None:
        body = {
            "messages": [{"role": "user", "content": self.content}],
            "stream": True,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=BOUND_S) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = RuntimeError(f"error event: {event['error']}")
                    for choice in event.get("choices", []):
                        if choice.get("delta", {}).get("content"):
                            self.chunks += 1
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
                    if event.get("usage"):
                        self.completion_tokens = event["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            self.error = exc

    def ended(self, timeout_s: float = BOUND_S) -> HttpStream:
        self.join(timeout_s)
        assert not self.is_alive(), f"HTTP stream still running after {timeout_s:g} s"
        return self

    @property
    def completed(self) -> bool:
        return self.status == 200 and self.finish_reason == "length" and self.completion_tokens == self.max_tokens


def status(endpoint: str) -> StatusReply:
    with Client(endpoint, timeout_s=10) as client:
        return client.status()


def all_ready(endpoint: str, workers: int = 2) -> StatusReply | None:
    """The status once `workers` workers are connected and ready with every slot idle, else None."""
    st = status(endpoint)
    ready = [w for w in st.workers if w.state == "ready" and not any(s.busy for s in w.slots)]
    return st if len(ready) == workers and st.queued == 0 else None


def placement(endpoint: str, rids: list[str]) -> dict[str, str]:
    """Request id -> the worker whose slot runs it, for those of `rids` running now."""
    where = {}
    for w in status(endpoint).workers:
        for s in w.slots:
            for rid in rids:
                if s.request_id is not None and s.request_id.startswith(rid):
                    where[rid] = w.worker
    return where


def worker_pids(serve_pid: int) -> dict[str, int]:
    """Worker id -> pid, for the `kvroute worker` children of a `kvroute serve` process."""
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == serve_pid and b"--worker-id" in args:
            pids[args[args.index(b"--worker-id") + 1].decode()] = int(proc.name)
    return pids


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def restarts(endpoint: str) -> dict[str, int]:
    return {w.worker: w.restarts for w in status(endpoint).workers}
