"""Mooncake's conversation trace replayed on any OpenAI-compatible server, and the offline oracle beside it.

The trace (`../shared/data/mooncake_conversation_trace.jsonl`, kvcache-ai/Mooncake FAST'25, Apache-2.0; its README
says the format): each row is a request with `input_length`, `output_length` (tokens) and `hash_ids`, the ids of
its prompt's 512-token blocks, equal ids meaning an equal prefix block. Scaled to this machine: each block becomes
`--block` units drawn from a generator seeded by its id (so equal blocks are equal text), in one of two modes:

- `text`: words, sent as a text prompt on /v1/completions (each system tokenizes them itself);
- `tokens`: token ids in the model's ordinary range, sent as a token-id prompt.

The output is `output_length` scaled alike (at least one token), generated whatever the model's end token
(`ignore_eos`). `--clients` clients replay the rows in order in a closed loop (each takes the next row when its last
one is answered). A reply's `usage.prompt_tokens_details.cached_tokens` (or llama-server's `timings.prompt_n`) says
how many of its prompt tokens were computed.

    python -m bench.trace_replay --url http://127.0.0.1:8000 [--rows 600] [--mode text] [--clients 4]
    python -m bench.trace_replay --systems kvroute,smg-cache-aware,smg-round-robin [--workers 2 --slots 2 --threads 2]
    python -m bench.trace_replay --oracle-only [--rows 600] [--budget-blocks N] [--token-oracle]

`--systems` starts each system in turn (bench/systems.py: kvroute, llama-server, SGLang's model gateway over one
llama-server per worker, ...) with the same model, workers, slots, context per slot and threads in all, replays the
rows on it, stops it, and does that `--repeats` times, the systems interleaved; one row of the table per replay.

`--audit-cuts` runs the `llama-server` system (not those behind SMG) with its trace log and counts the prompt tokens
it reused by cutting a state restored from `--cache-ram` where that state cannot be cut exactly
(bench/restored_cuts.py): on a sliding-window model those are tokens kvroute computes and llama-server reuses with
holes in its window.

The oracle computes, from the rows alone, the share of prompt blocks an infinite cache keyed by blocks computes (a
block is computed unless the request's whole chain up to it was seen before), and the same with a least recently
used cache of `--budget-blocks` blocks. What a server computes is measured in tokens, the oracle in blocks: equal
blocks tokenize alike, so the ratios compare. `--token-oracle` adds the same at token granularity (the prompts as
the default model tokenizes them): a prompt sharing part of a trace block reuses that part.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import resource
import statistics
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.restored_cuts import TRACE_FLAGS, audit

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_conversation_trace.jsonl"
BLOCK_TOKENS = 512  # the trace's block
# (the words a block is drawn from: common English, so that a text block is about as many tokens in any vocabulary)
# fmt: off
WORDS = ("time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye",
         "woman", "place", "work", "week", "case", "point", "government", "company", "number", "group", "problem",
         "fact", "river", "stone", "light", "water", "field", "paper", "music", "garden", "window")
# fmt: on
TOKEN_RANGE = (1000, 20000)  # ordinary tokens of the default model's vocabulary (no special ones)


@dataclass(frozen=True)
class Row:
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load(path: Path, rows: int) -> list[Row]:
    out: list[Row] = []
    with path.open() as f:
        for line in f:
            if len(out) >= rows:
                break
            r = json.loads(line)
            out.append(Row(r["input_length"], r["output_length"], tuple(r["hash_ids"])))
    return out


def block_text(block_id: int, units: int) -> str:
    rng = random.Random(block_id)
    return " ".join(rng.choice(WORDS) for _ in range(units))


def block_tokens(block_id: int, units: int) -> list[int]:
    rng = random.Random(block_id)
    return [rng.randrange(*TOKEN_RANGE) for _ in range(units)]


def prompt_of(row: Row, mode: str, units: int) -> str | list[int]:
    if mode == "text":
        return " ".join(block_text(b, units) for b in row.hash_ids)
    return [t for b in row.hash_ids for t in block_tokens(b, units)]


def output_of(row: Row, units: int) -> int:
    return max(1, round(row.output_length * units / BLOCK_TOKENS))


# ---- the oracle ----


@dataclass(frozen=True)
class OracleFigures:
    sent: int  # prompt blocks (or tokens) sent
    computed: int  # of them computed

    @property
    def share(self) -> float:
        return self.computed / self.sent if self.sent else 0.0


def oracle(rows: Sequence[Row], budget_blocks: int | None = None) -> OracleFigures:
    """Blocks computed by a cache keyed by blocks (`budget_blocks`: least recently used out past it; None: never
    full). A request reuses its longest chain of blocks all in the cache (a chain is a prefix: the trace's ids name a
    block in its position), computes the rest, and leaves every block of its prompt in the cache."""
    cache: OrderedDict[int, None] = OrderedDict()
    sent = computed = 0
    for row in rows:
        kept = 0
        for b in row.hash_ids:
            if b not in cache:
                break
            kept += 1
        sent += len(row.hash_ids)
        computed += len(row.hash_ids) - kept
        for b in row.hash_ids:
            cache[b] = None
            cache.move_to_end(b)
        while budget_blocks is not None and len(cache) > budget_blocks:
            cache.popitem(last=False)
    return OracleFigures(sent, computed)


def token_oracle(prompts: Sequence[Sequence[int]]) -> OracleFigures:
    """Prompt tokens an infinite cache of token prefixes computes: each prompt reuses the longest prefix an earlier
    prompt shares with it, less its last token (its logits are not cached), and computes the rest. Finer than blocks: a
    prompt sharing part of a block reuses that part."""
    from router.index import Index

    index = Index()
    sent = computed = 0
    for i, prompt in enumerate(prompts):
        reuse = min(index.match(prompt).best, len(prompt) - 1)
        sent += len(prompt)
        computed += len(prompt) - max(0, reuse)
        index.insert(i, prompt)
    return OracleFigures(sent, computed)


def tokenized(rows: Sequence[Row], mode: str, units: int) -> list[list[int]]:
    """The rows' prompts as the default model tokenizes them (BOS first), or as sent in tokens mode."""
    if mode == "tokens":
        return [list(prompt_of(r, mode, units)) for r in rows]
    import llama_cpp

    from common.model import default_model_path

    vocab = llama_cpp.Llama(str(default_model_path()), vocab_only=True, verbose=False)
    return [vocab.tokenize(str(prompt_of(r, mode, units)).encode(), add_bos=True, special=False) for r in rows]


# ---- the replay ----


@dataclass
class Answer:
    prompt_tokens: int
    computed: int  # prompt tokens computed (not served from cache)
    seconds: float
    status: int


def computed_of(body: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, of them computed) from a completion's body: usage's cached_tokens, or llama-server's timings."""
    usage = body.get("usage") or {}
    prompt = int(usage.get("prompt_tokens", 0))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and "timings" in body:
        return prompt, int(body["timings"].get("prompt_n", prompt))
    return prompt, prompt - int(cached or 0)


def served_model(url: str) -> str:
    """The first model the server lists (kvroute: its alias; llama-server and SMG: the model file's path)."""
    data = httpx.get(f"{url}/v1/models", timeout=30).json().get("data") or [{}]
    return str(data[0].get("id", "default"))


async def replay(url: str, rows: Sequence[Row], mode: str, units: int, clients: int, model: str) -> list[Answer]:
    answers: list[Answer] = []
    todo: Iterator[Row] = iter(rows)

    async def client(http: httpx.AsyncClient) -> None:
        for row in todo:
            body = {
                "model": model,
                "prompt": prompt_of(row, mode, units),
                "max_tokens": output_of(row, units),
                "temperature": 0,
                "ignore_eos": True,
            }
            t0 = time.monotonic()
            r = await http.post(f"{url}/v1/completions", json=body, timeout=1800)
            took = time.monotonic() - t0
            got = r.json() if r.status_code == 200 else {}
            prompt, computed = computed_of(got)
            answers.append(Answer(prompt, computed, took, r.status_code))

    async with httpx.AsyncClient(headers={"Authorization": "Bearer -"}) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return answers


def summary(name: str, answers: Sequence[Answer], wall: float, cpu_s: float | None = None) -> str:
    """One row of the table; `cpu_s`: the CPU seconds the system's processes used (where it was started here)."""
    ok = [a for a in answers if a.status == 200]
    sent, computed = sum(a.prompt_tokens for a in ok), sum(a.computed for a in ok)
    p50 = statistics.median(a.seconds for a in ok) if ok else float("nan")
    cpu = f"{cpu_s:.0f} s" if cpu_s is not None else "-"
    return (
        f"| {name} | {computed / sent if sent else float('nan'):.3f} ({computed:,} of {sent:,}) | {wall:.1f} s | "
        f"{p50:.2f} s | {cpu} | {len(ok)} of {len(answers)} |"
    )


def children_cpu_s() -> float:
    """CPU seconds (user and system) of every process this one started and reaped, their own children included (a
    server reaps its workers): the difference across a system's run is what its processes used."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="the server's base URL (http://HOST:PORT)")
    ap.add_argument("--name", default="server", help="its name in the table")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--mode", choices=["text", "tokens"], default="text")
    ap.add_argument("--block", type=int, default=8, help="words or tokens a 512-token block becomes")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--model", default=None, help="the request's model field (default: the first the server lists)")
    ap.add_argument("--systems", help="comma-separated systems of bench/systems.py to start and replay on in turn")
    ap.add_argument("--workers", type=int, default=2, help="--systems: kvroute workers, llama-servers behind SMG")
    ap.add_argument("--slots", type=int, default=2, help="--systems: slots per worker")
    ap.add_argument("--threads", type=int, default=2, help="--systems: threads in all (shared among the workers)")
    ap.add_argument("--ctx", type=int, default=8192, help="--systems: context per slot")
    ap.add_argument("--repeats", type=int, default=1, help="--systems: replays per system, interleaved")
    ap.add_argument("--out", type=Path, help="--systems: write every replay's figures here (JSON)")
    ap.add_argument("--budget-blocks", type=int, default=None, help="the oracle's cache size in blocks (default: none)")
    ap.add_argument("--oracle-only", action="store_true")
    ap.add_argument("--token-oracle", action="store_true", help="also the oracle at token granularity (the default model's)")
    ap.add_argument(
        "--audit-cuts",
        action="store_true",
        help="--systems: run llama-server with its trace log and count the prompt tokens it reused by cutting a restored "
        "state where that is not exact (bench/restored_cuts.py; the log slows it a little)",
    )
    args = ap.parse_args()
    rows = load(args.trace, args.rows)
    infinite = oracle(rows)
    print(f"{len(rows)} rows, {infinite.sent:,} prompt blocks of {args.block} {args.mode}")
    print(f"oracle, an infinite cache of blocks: computes {infinite.share:.3f} ({infinite.computed:,} blocks)")
    if args.token_oracle:
        tokens = token_oracle(tokenized(rows, args.mode, args.block))
        print(f"oracle, an infinite cache of token prefixes: computes {tokens.share:.3f} ({tokens.computed:,} tokens)")
    if args.budget_blocks is not None:
        budget = oracle(rows, args.budget_blocks)
        print(f"oracle, a cache of {args.budget_blocks:,} blocks: computes {budget.share:.3f} ({budget.computed:,} blocks)")
    if args.oracle_only:
        return
    print("| system | prompt tokens computed / sent | wall | p50 latency | CPU | answered |")
    print("| --- | --- | --- | --- | --- | --- |", flush=True)
    if args.systems:
        compare(args, rows)
        return
    if not args.url:
        ap.error("--url or --systems is needed unless --oracle-only")
    url = args.url.rstrip("/")
    t0 = time.monotonic()
    answers = asyncio.run(replay(url, rows, args.mode, args.block, args.clients, args.model or served_model(url)))
    print(summary(args.name, answers, time.monotonic() - t0))


def compare(args: argparse.Namespace, rows: Sequence[Row]) -> None:
    """Each system started, replayed on and stopped in turn, `--repeats` times (bench/systems.py)."""
    import tempfile

    from bench.systems import Server, Setup
    from common.model import default_model_path

    names = args.systems.split(",")
    setup = Setup(str(default_model_path()), args.threads, args.workers, args.slots, args.ctx)
    # (the trace log on the one-box llama-server alone: the audit reads no other, and the log slows a server down)
    traced = dataclasses.replace(setup, llama_server_flags=(*setup.llama_server_flags, *TRACE_FLAGS))
    logs = Path(tempfile.mkdtemp(prefix="kvroute-trace-replay-"))
    results: list[dict[str, Any]] = []
    for rep in range(args.repeats):
        for name in names:
            cpu0 = children_cpu_s()
            log = logs / f"{name}-{rep}.log"
            audited = args.audit_cuts and name == "llama-server"
            with Server(name, traced if audited else setup, log) as server:
                t0 = time.monotonic()
                answers = asyncio.run(replay(server.url, rows, args.mode, args.block, args.clients, served_model(server.url)))
                wall = time.monotonic() - t0
            cpu_s = children_cpu_s() - cpu0  # (its start and stop included: seconds, beside the replay's minutes)
            print(summary(name, answers, wall, cpu_s), flush=True)
            ok = [a for a in answers if a.status == 200]
            cuts = audit(log.read_text(errors="replace")) if audited else None
            if cuts is not None:
                print(
                    f"({name}: {cuts.inexact:,} prompt tokens in {cuts.inexact_requests} requests reused by cutting a "
                    f"restored state below where it is exact; counted as computed: {cuts.computed + cuts.inexact:,})",
                    flush=True,
                )
            results.append({
                "system": name, "repeat": rep, "command": server.command_line, "wall_s": round(wall, 2), "cpu_s": round(cpu_s, 1),
                "prompt_tokens": sum(a.prompt_tokens for a in ok), "computed": sum(a.computed for a in ok),
                "p50_s": round(statistics.median(a.seconds for a in ok), 3) if ok else None,
                "answered": len(ok), "rows": len(answers),
                **({"inexact_reuse": cuts.inexact, "inexact_requests": cuts.inexact_requests} if cuts is not None else {}),
            })  # fmt: skip
    print(f"(logs in {logs})")
    if args.out:
        args.out.write_text(json.dumps({"rows": len(rows), "mode": args.mode, "results": results}, indent=1))


if __name__ == "__main__":
    main()
