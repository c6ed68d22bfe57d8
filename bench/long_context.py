"""Long context (issue 17): one agent session grown to 30k tokens on kvroute's default settings, each turn timed on
kvroute and then on llama.cpp alone with the same history.

    .venv/bin/python -m bench.long_context [--target-tokens 30000] [--step-tokens 1500] [--floor-repeat 2]

kvroute: `kvroute serve` with its defaults (1 worker, 4 slots, `--ctx-per-slot 0`: the model's trained length,
32768 tokens for the default Gemma 3 270M, within the memory budget, all cores); only the HTTP and ZMQ ports are
chosen. It is warmed with one short request. The session: a system preamble (`--preamble-tokens`) and a task, then
turns that each append a tool-output-like user message of `--step-tokens` tokens after the model's short reply
(`--max-tokens`), as an agent resends its history, until the next prompt would pass `--target-tokens`. One
streamed /v1/chat/completions per turn, greedy; recorded: TTFT (the first streamed chunk, which carries the first
token), prompt and cached tokens (usage). No request may fail: a context_overflow, or any other error, is a failure.

llama.cpp alone, in this process, right after each turn (the two never run at once, and a slow minute on the shared
machine lands on both): the model loaded with the worker's own context settings (`worker.llama.Llama`: threads,
slots, the slot length the worker chose, n_batch); the prefill of the turn's new tokens (prompt - cached) after a
history as long as the one kvroute reused (cached), in chunks of n_batch as the worker computes them, logits for the
last token, the median of `--floor-repeat`: bench/floor.py's measurement, chunked, its history kept from turn to
turn (arbitrary token ids: attention costs the same whatever they are). No server can answer a turn faster.

Reported: each turn's TTFT, prompt and cached tokens, llama.cpp alone's time and TTFT / alone; the median of those
ratios over every turn, over the last 5, and the largest. Goal: the median over every turn <= 1.15, no failed
request. Writes bench/reports/<date>/<time>-long-context.json and .md (--out to change the directory), the
server's log in <time>-logs/ beside them. About 6 minutes on 2 cores at the defaults; `--target-tokens 6000` checks
the harness in about a minute.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.agent_loop import make_texts, stream_step
from bench.floor import _decode
from bench.systems import Server, Setup
from bench.warm_restart import endpoint_of
from bench.workloads import model_tokenizer
from common.model import resolve_model
from kvroute.client import Client
from worker.config import WorkerConfig

DEFAULT_N_BATCH = WorkerConfig.n_batch
GOAL = 1.15  # kvroute's TTFT over llama.cpp alone's prefill of the same new tokens after the same history, at most
LAST = 5  # the last turns whose median is shown beside the whole session's
PAUSE_S = 0.2  # between a kvroute turn and llama.cpp alone's, so that neither's threads are still spinning


@dataclass
class Turn:
    turn: int  # 1-based
    ttft: float | None
    total: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    alone: float | None = None  # llama.cpp alone: seconds for the same new tokens after the same history
    error: str | None = None


class Floor:
    """llama.cpp alone: one context (`llama`, a worker.llama.Llama) whose slot 0 holds a history of arbitrary tokens,
    grown or trimmed to each turn's; new tokens are computed `chunk` at a time (llama_decode takes at most n_batch
    rows; the worker's prefill steps are n_batch tokens)."""

    def __init__(self, llama: Any, chunk: int) -> None:
        self.llama = llama
        self.chunk = chunk
        rng = random.Random(0)
        self.tokens = [rng.randrange(1000, llama.vocab.n_vocab) for _ in range(llama.ctx_per_slot)]
        self.held = 0

    @classmethod
    def load(cls, model: str, *, slots: int, ctx_per_slot: int, n_batch: int, threads: int) -> Floor:
        from worker.llama import Llama

        return cls(Llama(model, slots=slots, ctx_per_slot=ctx_per_slot, n_batch=n_batch, threads=threads), n_batch)

    def close(self) -> None:
        self.llama.close()

    def _to(self, history: int) -> None:
        if self.held > history:
            self.llama.seq_rm(0, history, -1)
            self.held = history
        while self.held < history:  # untimed, in full chunks as a prefill would
            n = min(self.chunk, history - self.held)
            _decode(self.llama, self.tokens[self.held : self.held + n], self.held, logits=False)
            self.held += n

    def prefill(self, history: int, new: int, repeat: int) -> float:
        """Seconds to compute `new` tokens (logits for the last) after `history` held tokens, the median of `repeat`.
        The last run's tokens stay: the next turn's history starts with them."""
        if history + new > len(self.tokens):
            raise ValueError(f"{history} + {new} tokens do not fit a slot of {len(self.tokens)}")
        times = []
        for _ in range(repeat):
            self._to(history)
            t0 = time.perf_counter()
            for start in range(history, history + new, self.chunk):
                end = min(start + self.chunk, history + new)
                _decode(self.llama, self.tokens[start:end], start, logits=end == history + new)
            times.append(time.perf_counter() - t0)
            self.held = history + new
        return statistics.median(times)


def run_session(
    url: str, texts: dict[str, Any], target: int, max_tokens: int, tokenize: Any, after: Callable[[Turn], None] | None = None
) -> list[Turn]:
    """The agent session: each turn appends the next tool output as a user message, until the next prompt would pass
    `target` tokens; `after(turn)` is called after each successful turn. Stops at the first failed request."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": texts["preamble"]},
        {"role": "user", "content": texts["task"]},
    ]
    turns: list[Turn] = []
    with httpx.Client(base_url=url, timeout=900) as http:
        for k, result in enumerate(texts["results"]):
            if turns and turns[-1].prompt_tokens + turns[-1].completion_tokens + len(tokenize(result)) + 32 > target:
                break
            sent = time.perf_counter()
            try:
                step, reply = stream_step(http, messages, False, max_tokens)
            except (RuntimeError, httpx.HTTPError, ValueError) as exc:
                turns.append(Turn(k + 1, None, time.perf_counter() - sent, 0, 0, 0, error=f"{type(exc).__name__}: {exc}"[:500]))
                break
            turn = Turn(
                k + 1,
                step.ttft or None,
                time.perf_counter() - sent,
                step.prompt_tokens,
                step.cached_tokens,
                step.completion_tokens,
            )
            turns.append(turn)
            if after is not None:
                after(turn)
            alone = "" if turn.alone is None else f", llama.cpp alone {turn.alone:.3f} s"
            print(
                f"  turn {turn.turn}: prompt {turn.prompt_tokens} cached {turn.cached_tokens} ttft {turn.ttft or 0:.3f} s{alone}",
                file=sys.stderr,
                flush=True,
            )
            messages.append({"role": "assistant", "content": reply.get("content") or ""})
            messages.append({"role": "user", "content": result})
    return turns


def overflowed(error: str) -> bool:
    """Whether an error is a context overflow (OpenAI's words and code; this repository's code in a test's fake)."""
    return any(w in error for w in ("maximum context length", "context_length_exceeded", "context_overflow"))


def summarize(turns: list[dict[str, Any]], goal: float = GOAL) -> dict[str, Any]:
    """The figures: failures, the longest prompt, each compared turn's TTFT / alone, their median over every turn and
    over the last LAST, the largest, and the goal (the median over every turn, no failure)."""
    failed = [t for t in turns if t["error"]]
    ratios = {t["turn"]: t["ttft"] / t["alone"] for t in turns if not t["error"] and t["ttft"] and t["alone"]}
    values = list(ratios.values())
    median = statistics.median(values) if values else None
    return {
        "turns": len(turns),
        "failed_requests": len(failed),
        "errors": [t["error"] for t in failed],
        "context_overflow": any(overflowed(t["error"] or "") for t in failed),
        "max_prompt_tokens": max((t["prompt_tokens"] for t in turns), default=0),
        "ratios": ratios,
        "median_ratio": median,
        "median_ratio_last": statistics.median(values[-LAST:]) if values else None,
        "max_ratio": max(values) if values else None,
        "turns_over_goal": sum(1 for x in values if x > goal),
        "goal": goal,
        "met": bool(values) and not failed and median is not None and median <= goal,
    }


def markdown(turns: list[dict[str, Any]], s: dict[str, Any]) -> str:
    lines = [
        "| turn | prompt tokens | cached | new | TTFT | llama.cpp alone | TTFT / alone |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for t in turns:
        if t["error"]:
            lines.append(f"| {t['turn']} | - | - | - | failed: {t['error'][:80]} | - | - |")
            continue
        ratio = s["ratios"].get(t["turn"])
        alone = "" if t["alone"] is None else f"{t['alone'] * 1000:.0f} ms"
        lines.append(
            f"| {t['turn']} | {t['prompt_tokens']} | {t['cached_tokens']} | {t['prompt_tokens'] - t['cached_tokens']}"
            f" | {t['ttft'] * 1000:.0f} ms | {alone} | {'' if ratio is None else f'{ratio:.3f}'} |"
        )
    return "\n".join(lines)


def goal_line(s: dict[str, Any]) -> str:
    if s["median_ratio"] is None:
        return f"long context: TTFT / llama.cpp alone: n/a (goal <= {s['goal']}): NOT EVALUATED"
    extra = f"; {s['failed_requests']} failed requests" if s["failed_requests"] else "; no failed request"
    return (
        f"long context: {s['max_prompt_tokens']}-token session, TTFT / llama.cpp alone: median {s['median_ratio']:.3f}"
        f" over {len(s['ratios'])} turns, {s['median_ratio_last']:.3f} over the last {min(LAST, len(s['ratios']))},"
        f" max {s['max_ratio']:.3f} ({s['turns_over_goal']} turns over {s['goal']}; goal: median <= {s['goal']}){extra}:"
        f" {'MET' if s['met'] else 'MISSED'}"
    )


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's docstring as written, and each flag's default."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.long_context", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--target-tokens", type=int, default=30000, help="grow the session until the next prompt would pass this")
    p.add_argument("--preamble-tokens", type=int, default=1500, help="tokens of the system preamble")
    p.add_argument("--step-tokens", type=int, default=1500, help="tokens of each turn's tool output")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each reply")
    p.add_argument("--slots", type=int, default=4, help="kvroute's slots (4: its default)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads (kvroute's default: all cores)")
    p.add_argument("--n-batch", type=int, default=DEFAULT_N_BATCH, help="prompt tokens per engine step (kvroute's default)")
    p.add_argument("--floor-repeat", type=int, default=2, help="llama.cpp alone: timed prefills per turn (the median is kept)")
    p.add_argument("--no-floor", action="store_true", help="kvroute alone: skip llama.cpp alone")
    p.add_argument("--seed", default="long-context", help="seed of the texts")
    p.add_argument("--out", default=None, help="report directory (default: bench/reports/<today>)")
    a = p.parse_args(argv)
    if a.target_tokens < a.preamble_tokens + 2 * a.step_tokens:
        p.error("--target-tokens must leave room for at least two turns after the preamble")
    if a.floor_repeat < 1:
        p.error("--floor-repeat must be at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    model = str(resolve_model(None))
    tokenize = model_tokenizer(model)
    texts = make_texts(a.seed, a.target_tokens // a.step_tokens + 2, a.preamble_tokens, a.step_tokens, tokenize)
    out = Path(a.out or f"bench/reports/{time.strftime('%Y-%m-%d')}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    flags = () if a.n_batch == DEFAULT_N_BATCH else ("--n-batch", str(a.n_batch))
    setup = Setup(model=model, threads=a.threads, workers=1, slots=a.slots, ctx_per_slot=0, kvroute_flags=flags)
    started = time.time()
    load = {"start": round(os.getloadavg()[0], 2)}
    server = Server("kvroute", setup, out / f"{stamp}-logs" / "kvroute.log")
    floor: Floor | None = None
    with server:
        with Client(endpoint_of(server.argvs, "--zmq"), timeout_s=10) as client:
            worker = client.status().workers[0]
        ctx_per_slot = worker.ctx_per_slot
        with httpx.Client(base_url=server.url, timeout=300) as http:  # warm-up, as bench.run warms every system
            stream_step(http, [{"role": "user", "content": "Say hello."}], False, 4)
        if not a.no_floor:
            floor = Floor.load(model, slots=a.slots, ctx_per_slot=ctx_per_slot, n_batch=a.n_batch, threads=a.threads)

        def alone(turn: Turn) -> None:
            if floor is not None:
                time.sleep(PAUSE_S)
                turn.alone = floor.prefill(turn.cached_tokens, turn.prompt_tokens - turn.cached_tokens, a.floor_repeat)
                time.sleep(PAUSE_S)

        print(f"kvroute: {len(worker.slots)} slots of {ctx_per_slot} tokens; the session ...", file=sys.stderr, flush=True)
        try:
            session = run_session(server.url, texts, a.target_tokens, a.max_tokens, tokenize, alone)
        finally:
            if floor is not None:
                floor.close()
    turns = [asdict(t) for t in session]
    load["end"] = round(os.getloadavg()[0], 2)
    summary = summarize(turns)
    result: dict[str, Any] = {
        "bench": "long-context",
        "command": " ".join(["python -m bench.long_context", *(argv if argv is not None else sys.argv[1:])]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "load_average": load,
        "cores": os.cpu_count(),
        "args": vars(a),
        "kvroute_command": server.command_line,
        "ctx_per_slot": ctx_per_slot,
        "slots": len(worker.slots),
        "summary": summary,
        "turns": turns,
    }
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stamp}-long-context.json"
    path.write_text(json.dumps(result, indent=1))
    table = markdown(turns, summary)
    head = (
        f"# Long context, {result['started']} ({result['duration_s']:.0f} s; load average {load['start']} at the start,"
        f" {load['end']} at the end; {result['cores']} cores)\n\n"
        f"`{result['command']}`: kvroute serve with its defaults ({result['slots']} slots of {ctx_per_slot} tokens),"
        f" one agent session: a {a.preamble_tokens}-token preamble, then {a.step_tokens}-token tool outputs, replies of"
        f" at most {a.max_tokens} tokens, up to {a.target_tokens} tokens. After each turn, llama.cpp alone: the prefill"
        " of the turn's new tokens after the history kvroute reused, the worker's context settings, median of"
        f" {a.floor_repeat}.\n\n"
    )
    (out / f"{stamp}-long-context.md").write_text(head + table + "\n\n" + goal_line(summary) + "\n")
    print(table)
    print()
    print(goal_line(summary))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
