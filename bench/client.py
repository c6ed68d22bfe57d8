"""An asyncio streaming client of the OpenAI completions API (or chat completions, one user message) that times
each request the same way on every system.

TTFT is the time from sending the request to the first streamed chunk with non-empty text. Token counts come
from the final usage chunk (`stream_options.include_usage`) where the server sends one; otherwise the output
count is the number of non-empty text chunks (one per token on llama-cpp-python's server) and cached tokens
are unknown (None), never guessed.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from bench.workloads import Session, Workload


@dataclass
class Sample:
    """What one request measured. Times are seconds; `start` is relative to the start of the workload."""

    session: str
    turn: int
    start: float
    ttft: float | None
    total: float
    prompt_chars: int
    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int
    text: str
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class CompletionClient:
    """POSTs streamed completions to one server. One instance per system; `aclose()` when done."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 600.0,
        model: str | None = None,
        temperature: float = 0.0,
        seeds: bool = True,
        full_length: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.temperature = temperature
        self.seeds = seeds  # (with a temperature) a seed per request
        self.full_length = full_length  # every reply to its max_tokens (Workload.full_length)
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def metrics(self) -> Series | None:
        """The server's /metrics, parsed; None where it has none (not kvroute) or it did not answer."""
        try:
            resp = await self._http.get(f"{self.base_url}/metrics")
        except httpx.HTTPError:
            return None
        return parse_metrics(resp.text) if resp.status_code == 200 else None

    async def complete(self, prompt: str, max_tokens: int, *, session: str, turn: int, t0: float, chat: bool = False) -> Sample:
        """Stream one completion of `prompt` (with `chat`: the reply to it as one user message, in the server's
        chat template), greedy unless the client has a temperature; never raises for a server error (it goes in
        `error`)."""
        body: dict[str, Any] = {
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}),
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.temperature > 0:  # the whole distribution on every server, and the same seed
            body |= {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
            if self.seeds:
                body["seed"] = zlib.crc32(f"{session}/{turn}".encode()) % (2**32 - 1)
        if self.full_length:
            body["ignore_eos"] = True
        if self.model:
            body["model"] = self.model
        sent = time.perf_counter()
        ttft: float | None = None
        pieces: list[str] = []
        chunks = 0
        usage: dict[str, Any] | None = None
        error: str | None = None
        try:
            path = "/v1/chat/completions" if chat else "/v1/completions"
            async with self._http.stream("POST", f"{self.base_url}{path}", json=body) as resp:
                if resp.status_code != 200:
                    raw = (await resp.aread()).decode("utf-8", "replace")
                    error = f"HTTP {resp.status_code}: {raw[:300]}"
                else:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        event = json.loads(data)
                        if "error" in event:
                            error = f"stream error: {json.dumps(event['error'])[:300]}"
                            break
                        for choice in event.get("choices") or ():
                            text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                            text = text or ""
                            if text:
                                if ttft is None:
                                    ttft = time.perf_counter() - sent
                                pieces.append(text)
                                chunks += 1
                        if event.get("usage"):
                            usage = event["usage"]
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        total = time.perf_counter() - sent
        prompt_tokens = cached = None
        output = chunks
        if usage:
            prompt_tokens = usage.get("prompt_tokens")
            output = usage.get("completion_tokens", chunks)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return Sample(
            session=session,
            turn=turn,
            start=sent - t0,
            ttft=ttft,
            total=total,
            prompt_chars=len(prompt),
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            output_tokens=output,
            text="".join(pieces),
            error=error,
        )


async def run_session(client: CompletionClient, session: Session, t0: float, on_sample: Any = None) -> list[Sample]:
    """Run the turns of `session` one after the other, feeding each completion into the next prompt.
    Stops the session at its first failed request (later prompts would depend on the missing completion)."""
    completions: list[str] = []
    samples: list[Sample] = []
    for turn in range(len(session.messages)):
        if turn < len(session.think_s):
            await asyncio.sleep(session.think_s[turn])
        prompt = session.prompt(turn, completions)
        sample = await client.complete(prompt, session.max_tokens, session=session.name, turn=turn, t0=t0)
        samples.append(sample)
        if on_sample:
            on_sample(sample)
        if sample.error:
            break
        completions.append(sample.text)
    return samples


async def run_workload(client: CompletionClient, workload: Workload, on_sample: Any = None) -> tuple[list[Sample], float]:
    """Run every session, `workload.concurrency` at a time. Returns (samples in completion order, wall seconds)."""
    gate = asyncio.Semaphore(workload.concurrency)
    t0 = time.perf_counter()

    async def one(session: Session) -> list[Sample]:
        async with gate:
            return await run_session(client, session, t0, on_sample)

    results = await asyncio.gather(*(one(s) for s in workload.sessions))
    wall = time.perf_counter() - t0
    return [s for r in results for s in r], wall


# --- the server's own counters (kvroute's /metrics) ------------------------------------------------------------

Series = dict[str, dict[tuple[tuple[str, str], ...], float]]  # metric -> its labels (sorted pairs) -> value
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def sse_events(resp: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed OpenAI response (`httpx.stream`); an HTTP status other than 200 or an error
    event raises RuntimeError."""
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.read()[:300]!r}")
    for line in resp.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            raise RuntimeError(f"stream error: {event['error']}")
        yield event


def parse_metrics(text: str) -> Series:
    """Prometheus' text format -> {metric: {labels: value}}; comments and unreadable lines are skipped."""
    out: Series = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out.setdefault(m.group(1), {})[labels] = value
    return out


def metrics_delta(before: Series, after: Series) -> Series:
    """What each series of `after` grew by since `before` (a series new in `after` counts from 0)."""
    return {
        name: {labels: v - before.get(name, {}).get(labels, 0.0) for labels, v in series.items()}
        for name, series in after.items()
    }
