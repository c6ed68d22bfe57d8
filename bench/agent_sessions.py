"""Agent traffic on any OpenAI-compatible server: a parent agent that starts sub-agents and waits on tools, beside
other users' sessions, on fewer slots than conversations (issue 65's benchmark).

The parent has a long system prompt (`--parent-words`); each of its `--parent-turns` turns is one chat request whose
user message carries the last turn's tool results and a new instruction, then a tool wait (`--tool-wait-s`). On the
turns in `--spawn-turns` it starts `--subagents` sub-agents at once and waits for them all: each has a system prompt of
its own (`--sub-words`) and makes `--sub-steps` requests, a tool wait after each, its tool's result appended to the
next. Beside them, `--others` users hold conversations of their own (`--other-words` of system prompt), a request
then a pause, until the parent is done. Every text is words drawn from a generator seeded by what it is, so every
system is sent the same conversations; replies are greedy (`temperature` 0, `--max-tokens`).

What each request computed comes from its reply (`usage.prompt_tokens_details.cached_tokens`, or llama-server's
`timings.prompt_n`). A request's *new* tokens are its prompt tokens past the previous request of its conversation
(prompt plus reply); what it computed beyond them is *recomputed*: history the server had and lost. The figures: the
parent's turn latency (all its turns, and those after its first: the turns it comes back to after a pause, its
first being a cold prompt no cache helps), its prompt tokens computed, recomputed and sent; the sub-agents' and
everyone's.

    python -m bench.agent_sessions --url http://127.0.0.1:8000
    python -m bench.agent_sessions --systems kvroute,llama-server [--workers 1 --slots 3 --threads 2] [--repeats 2]
    python -m bench.agent_sessions --systems kvroute,smg-cache-aware --workers 2 --slots 2

`--systems` starts each system of bench/systems.py in turn with the same model, workers, slots, context per slot
and threads, runs the traffic, stops it, `--repeats` times with the systems interleaved. Each conversation sends
its name as `x-session-id` (a hint; servers that do not read it ignore it), a sub-agent its parent's (as Claude Code's
sub-agents send their parent's session id); the parent and its sub-agents send `service_tier: "priority"`
(`--parent-tier`; "" sends none): the user waits on them, the other users' sessions are the team's other traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.trace_replay import WORDS, computed_of, served_model


def words(seed: str, n: int) -> str:
    """`n` words drawn by a generator seeded by `seed` (equal seeds, equal text, on every system)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


@dataclass
class Sent:
    """One request's figures."""

    conversation: str
    role: str  # parent, sub or other
    step: int
    prompt_tokens: int
    computed: int
    completion_tokens: int
    seconds: float
    status: int
    new: int = 0  # prompt tokens past the conversation's previous request (prompt + reply); set by `new_tokens`


# the tool a parent and its sub-agents call where replies are calls (`--calls`): each reply is one call to it, forced
# (`tool_choice`), so that a server reading calls sees a conversation wait on a tool, as an agent's do
TOOL = {
    "type": "function",
    "function": {
        "name": "run",
        "description": "Run a shell command and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "maxLength": 60}},
            "required": ["command"],
        },
    },
}


@dataclass
class Conversation:
    name: str
    role: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)
    calls: int = 0


@dataclass(frozen=True)
class Traffic:
    parent_words: int = 3000
    sub_words: int = 1500
    other_words: int = 1500
    parent_turns: int = 5
    spawn_turns: tuple[int, ...] = (2, 4)
    subagents: int = 3
    sub_steps: int = 3
    others: int = 2
    tool_wait_s: float = 2.0
    max_tokens: int = 32
    user_words: int = 40
    result_words: int = 150
    parent_tier: str = "priority"  # the parent's and its sub-agents' `service_tier` ("": none sent)
    calls: bool = False  # the parent's and sub-agents' replies are tool calls, their results tool messages (`TOOL`)


class Run:
    """The traffic against one server."""

    def __init__(self, url: str, model: str, traffic: Traffic, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url, self.model, self.t, self.transport = url, model, traffic, transport
        self.conversations: list[Conversation] = []
        self.parent_done = asyncio.Event()

    def conversation(self, name: str, role: str, system_words: int) -> Conversation:
        conv = Conversation(name, role, [{"role": "system", "content": words(f"{name}/system", system_words)}])
        self.conversations.append(conv)
        return conv

    def add(self, conv: Conversation, text: str) -> None:
        """What comes back to the conversation before its next request: a user message, or, where its last reply was a
        call (`--calls`), that call's result as a tool message."""
        last = conv.messages[-1]
        if last.get("tool_calls"):
            conv.messages.append({"role": "tool", "tool_call_id": last["tool_calls"][0]["id"], "content": text})
        else:
            conv.messages.append({"role": "user", "content": text})

    async def ask(self, http: httpx.AsyncClient, conv: Conversation, user: str) -> str:
        """One request: `user` appended (or a call's result: `add`), the reply appended after it; its figures
        recorded. A sub-agent sends its parent's session id (as Claude Code's Task tool does), the parent and its
        sub-agents `parent_tier`; with `calls`, they reply with a call (`TOOL`)."""
        self.add(conv, user)
        body: dict[str, Any] = {"model": self.model, "messages": conv.messages, "max_tokens": self.t.max_tokens}
        body["temperature"] = 0
        agent = conv.role in ("parent", "sub")
        if agent and self.t.parent_tier:
            body["service_tier"] = self.t.parent_tier
        if agent and self.t.calls:
            body["tools"], body["tool_choice"] = [TOOL], {"type": "function", "function": {"name": "run"}}
        session = "parent" if conv.role == "sub" else conv.name
        t0 = time.monotonic()
        r = await http.post(f"{self.url}/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=1800)
        took = time.monotonic() - t0
        got = r.json() if r.status_code == 200 else {}
        prompt, computed = computed_of(got)
        completion = int((got.get("usage") or {}).get("completion_tokens", 0))
        conv.sent.append(Sent(conv.name, conv.role, len(conv.sent) + 1, prompt, computed, completion, took, r.status_code))
        message = (got.get("choices") or [{}])[0].get("message") or {}
        text = str(message.get("content") or "")
        if message.get("tool_calls"):
            conv.calls += 1
            calls = [{k: c[k] for k in ("id", "type", "function")} for c in message["tool_calls"][:1]]
            conv.messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
            return calls[0]["function"]["arguments"]
        conv.messages.append({"role": "assistant", "content": text})
        return text

    async def sub_agent(self, http: httpx.AsyncClient, name: str) -> str:
        conv = self.conversation(name, "sub", self.t.sub_words)
        news = words(f"{name}/task", self.t.user_words)
        reply = ""
        for step in range(1, self.t.sub_steps + 1):
            reply = await self.ask(http, conv, news)
            await asyncio.sleep(self.t.tool_wait_s)
            news = "Tool result: " + words(f"{name}/result/{step}", self.t.result_words)
        return reply

    async def parent(self, http: httpx.AsyncClient) -> None:
        conv = self.conversation("parent", "parent", self.t.parent_words)
        results = ""
        try:
            for turn in range(1, self.t.parent_turns + 1):
                await self.ask(http, conv, results + words(f"parent/ask/{turn}", self.t.user_words))
                if turn in self.t.spawn_turns:
                    subs = [self.sub_agent(http, f"parent/sub-{turn}-{k}") for k in range(1, self.t.subagents + 1)]
                    replies = await asyncio.gather(*subs)
                    results = "Sub-agents answered: " + " | ".join(replies) + "\n"
                else:
                    await asyncio.sleep(self.t.tool_wait_s)
                    results = "Tool result: " + words(f"parent/result/{turn}", self.t.result_words) + "\n"
        finally:
            self.parent_done.set()

    async def other(self, http: httpx.AsyncClient, k: int) -> None:
        conv = self.conversation(f"other-{k}", "other", self.t.other_words)
        turn = 0
        while not self.parent_done.is_set():
            turn += 1
            await self.ask(http, conv, words(f"other-{k}/ask/{turn}", self.t.user_words))
            await asyncio.sleep(self.t.tool_wait_s)

    async def run(self) -> float:
        t0 = time.monotonic()
        async with httpx.AsyncClient(headers={"Authorization": "Bearer -"}, transport=self.transport) as http:
            await asyncio.gather(self.parent(http), *(self.other(http, k) for k in range(1, self.t.others + 1)))
        return time.monotonic() - t0


def new_tokens(conversations: Sequence[Conversation]) -> None:
    """Set each request's `new`: its prompt tokens past its conversation's previous request (prompt + reply)."""
    for conv in conversations:
        seen = 0
        for s in conv.sent:
            s.new = max(0, s.prompt_tokens - seen) if s.status == 200 else 0
            if s.status == 200:
                seen = s.prompt_tokens + s.completion_tokens


def figures(sent: Sequence[Sent]) -> dict[str, Any]:
    """Requests, their mean latency, and their prompt tokens sent, computed, new and recomputed (computed past new)."""
    ok = [s for s in sent if s.status == 200]
    total, computed = sum(s.prompt_tokens for s in ok), sum(s.computed for s in ok)
    return {
        "requests": len(sent),
        "failed": len(sent) - len(ok),
        "mean_s": round(statistics.fmean(s.seconds for s in ok), 3) if ok else None,
        "sent": total,
        "computed": computed,
        "computed_share": round(computed / total, 3) if total else None,
        "new": sum(s.new for s in ok),
        "recomputed": sum(max(0, s.computed - s.new) for s in ok),
    }


def summarize(conversations: Sequence[Conversation], wall: float) -> dict[str, Any]:
    new_tokens(conversations)
    sent = [s for c in conversations for s in c.sent]
    by_role = {role: figures([s for s in sent if s.role == role]) for role in ("parent", "sub", "other")}
    returning = figures([s for s in sent if s.role == "parent" and s.step > 1])  # (its turns after a pause)
    calls = sum(c.calls for c in conversations)
    return {"wall_s": round(wall, 1), "everyone": figures(sent), **by_role, "parent_returning": returning, "calls": calls}


def row(name: str, f: dict[str, Any]) -> str:
    p, e = f["parent"], f["everyone"]
    return (
        f"| {name} | {p['mean_s']} s | {f['parent_returning']['mean_s']} s | "
        f"{p['computed_share']} ({p['recomputed']:,} recomputed) | "
        f"{f['sub']['mean_s']} s | {e['computed_share']} ({e['recomputed']:,} recomputed) | {f['wall_s']} s | "
        f"{e['failed']} of {e['requests']} |"
    )


HEADER = (
    "| system | parent's mean turn | its turns after the first | parent's prompt computed / sent | sub-agent request "
    "| everyone's computed / sent | wall | failed |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def run_once(url: str, traffic: Traffic, model: str | None = None) -> dict[str, Any]:
    run = Run(url, model or served_model(url), traffic)
    wall = asyncio.run(run.run())
    return {**summarize(run.conversations, wall), "requests": [asdict(s) for c in run.conversations for s in c.sent]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="the server's base URL (http://HOST:PORT)")
    ap.add_argument("--name", default="server")
    ap.add_argument("--model", default=None, help="the request's model field (default: the first the server lists)")
    defaults = Traffic()
    for f in ("parent_words", "sub_words", "other_words", "parent_turns", "subagents", "sub_steps", "others", "max_tokens"):
        ap.add_argument(f"--{f.replace('_', '-')}", type=int, default=getattr(defaults, f))
    ap.add_argument("--spawn-turns", default=",".join(map(str, defaults.spawn_turns)))
    ap.add_argument("--tool-wait-s", type=float, default=defaults.tool_wait_s)
    ap.add_argument("--parent-tier", default=defaults.parent_tier, help='the parent\'s `service_tier` ("" sends none)')
    ap.add_argument("--calls", action="store_true", help="the parent's and sub-agents' replies are tool calls")
    ap.add_argument("--systems", help="comma-separated systems of bench/systems.py to start and run on in turn")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--slots", type=int, default=3, help="slots per worker")
    ap.add_argument("--threads", type=int, default=2, help="threads in all (shared among the workers)")
    ap.add_argument("--ctx", type=int, default=8192, help="context per slot")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    traffic = Traffic(
        args.parent_words, args.sub_words, args.other_words, args.parent_turns,
        tuple(int(t) for t in args.spawn_turns.split(",") if t), args.subagents, args.sub_steps, args.others,
        args.tool_wait_s, args.max_tokens, parent_tier=args.parent_tier, calls=args.calls,
    )  # fmt: skip
    print(HEADER, flush=True)
    results: list[dict[str, Any]] = []
    if not args.systems:
        if not args.url:
            ap.error("--url or --systems is needed")
        results.append({"system": args.name, **run_once(args.url.rstrip("/"), traffic, args.model)})
        print(row(args.name, results[-1]))
    else:
        from bench.systems import Setup, interleaved
        from common.model import default_model_path

        setup = Setup(str(default_model_path()), args.threads, args.workers, args.slots, args.ctx)
        results = interleaved(
            args.systems.split(","), setup, args.repeats, lambda url: run_once(url, traffic), row, "kvroute-agent-sessions-"
        )
    if args.out:
        args.out.write_text(json.dumps({"traffic": asdict(traffic), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
