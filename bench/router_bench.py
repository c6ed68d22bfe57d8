"""Router benchmarks, run by hand; figures are ratios measured side by side in one run.

    .venv/bin/python bench/router_bench.py decision   # no model: decision cost, 64 workers x 16 slots, 8k tokens
        [--saved 100000 --saved-tokens 2048]        # ... with host-RAM and disk entries indexed too
    .venv/bin/python bench/router_bench.py policies   # real model, 2 workers: prefix vs round-robin vs least-loaded

`decision` fills a simulated mirror (every slot holds an 8k-token history: shared system prompts plus
a per-session tail; half the slots busy) and times match + select for 8k-token prompts of three kinds
(a session's next turn, a new session on a shared system prompt, a cold prompt).

`policies` starts `kvroute serve` (router in this process, 2 CPU workers x 2 slots) once per policy
and runs the same multi-session workload (more sessions than slots, several turns each, every
session's prompt = its document + the conversation so far) against each: token reuse (sum reused /
sum prompt tokens, as the workers report it), mean and p90 time to first token seen by the client,
and whether every request's predicted reuse equalled the worker's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.mirror import Mirror, Saved
from router.select import Params, WorkerLoad, select

# ---- decision cost (no model) -------------------------------------------------------------------


def decision_bench(
    workers: int, slots: int, ctx: int, systems: int, decisions: int, seed: int, saved: int = 0, saved_tokens: int = 2048
) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    mirror = Mirror()
    sys_len = ctx // 4
    prompts_sys = [rng.integers(100, 262_000, sys_len).astype(np.int32) for _ in range(systems)]
    t_fill = time.perf_counter()
    histories = []
    loads = []
    for w in range(workers):
        ws = mirror.add_worker(f"w{w}", slots)
        for s in ws:
            h = np.concatenate([prompts_sys[rng.integers(systems)], rng.integers(100, 262_000, ctx - sys_len).astype(np.int32)])
            mirror.assign(s, "fill", h)
            mirror._idle(s, h, dirty=False)  # as if the job had finished
            s.last_used -= float(rng.uniform(0, 600))
            histories.append((s, h))
        loads.append(WorkerLoad(f"w{w}", ws, saved=mirror.saved[f"w{w}"]))
    # host-RAM and disk entries (half each), spread over the workers: a shared system prompt and a tail of their own,
    # indexed as a worker's cache report indexes them (router/mirror.py `cache_changed`)
    saved_tails = []
    for i in range(saved):
        worker = f"w{i % workers}"
        tokens = np.concatenate(
            [
                prompts_sys[i % systems][: saved_tokens // 2],
                rng.integers(100, 262_000, saved_tokens - saved_tokens // 2).astype(np.int32),
            ]
        )
        entry = Saved(worker, ("ram" if i % 2 else "disk", i), tokens, nbytes=len(tokens) * 18_432)
        mirror.saved[worker][entry.key] = entry
        mirror.index.insert(entry, tokens)
        saved_tails.append(tokens)
    fill_s = time.perf_counter() - t_fill
    # half the slots busy, spread unevenly
    for s, h in histories[::2]:
        mirror.assign(s, "busy", h[: ctx // 2])
    for wl in loads:
        wl.busy = sum(s.busy for s in wl.slots)
    kinds: dict[str, list[float]] = {"next_turn": [], "new_session": [], "cold": [], "saved": []}
    params = Params()
    now = time.monotonic()
    idle = [(s, h) for s, h in histories if not s.busy]
    for i in range(decisions):
        kind = ("next_turn", "new_session", "cold", "saved")[i % (4 if saved_tails else 3)]
        if kind == "saved":  # a conversation whose state only a tier holds
            prompt = np.concatenate(
                [saved_tails[rng.integers(len(saved_tails))], rng.integers(100, 262_000, 64).astype(np.int32)]
            )
        elif kind == "next_turn":
            _, h = idle[rng.integers(len(idle))]
            prompt = np.concatenate([h[: ctx - 64], rng.integers(100, 262_000, 64).astype(np.int32)])
        elif kind == "new_session":
            prompt = np.concatenate(
                [prompts_sys[rng.integers(systems)], rng.integers(100, 262_000, ctx - sys_len).astype(np.int32)]
            )
        else:
            prompt = rng.integers(100, 262_000, ctx).astype(np.int32)
        t0 = time.perf_counter()
        match = mirror.index.match(prompt)
        d = select(match, loads, params, now, i, 0.0)
        kinds[kind].append((time.perf_counter() - t0) * 1000)
        assert d is not None
    all_ms = sorted(x for v in kinds.values() for x in v)
    out = {
        "slots": workers * slots,
        "saved_entries": saved,
        "tokens_per_slot": ctx,
        "index_stored_tokens": mirror.index.stored_tokens(),
        "fill_s": fill_s,
        "p50_ms": all_ms[len(all_ms) // 2],
        "p99_ms": all_ms[int(len(all_ms) * 0.99)],
        "decisions_per_s": len(all_ms) / (sum(all_ms) / 1000),
    }
    for k, v in kinds.items():
        if v:
            v.sort()
            out[f"{k}_p99_ms"] = v[int(len(v) * 0.99)]
    # the index update that follows a decision (assign: remove the old sequence, insert the prompt)
    t0 = time.perf_counter()
    n = 200
    for i in range(n):
        s, h = idle[i % len(idle)]
        mirror.assign(s, "x", np.concatenate([h[: ctx - 64], rng.integers(100, 262_000, 64).astype(np.int32)]))
        mirror._idle(s, h, dirty=False)
    out["assign_plus_settle_ms"] = (time.perf_counter() - t0) * 1000 / n
    return out


# ---- policies with the real model ---------------------------------------------------------------

WORDS = [
    "river",
    "stone",
    "cloud",
    "paper",
    "lamp",
    "garden",
    "window",
    "bridge",
    "harbor",
    "meadow",
    "candle",
    "mirror",
    "forest",
    "valley",
    "engine",
    "silver",
]


def document(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def run_policy(policy: str, args: argparse.Namespace) -> dict[str, float]:
    from commands.serve import LocalWorkers, serve
    from kvroute.client import AsyncClient
    from router.config import RouterConfig
    from router.supervisor import SupervisorConfig

    base = 20000 + random.randrange(20000)
    cep, wep = f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"
    cfg = RouterConfig(
        client_endpoint=cep, worker_endpoint=wep, policy=policy, busy_wait_ms=args.busy_wait_ms, hold_ms=args.hold_ms
    )
    local = LocalWorkers(cpu_workers=2, slots=args.slots, ctx_per_slot=args.ctx, threads=args.threads)
    holder: dict = {}
    task = asyncio.ensure_future(
        serve(cfg, local, SupervisorConfig(), signals=False, started=lambda r, s: holder.update(router=r))
    )
    while "router" not in holder or len(holder["router"].workers) < 2:
        if task.done():
            task.result()
        await asyncio.sleep(0.1)
    router = holder["router"]
    rng = random.Random(args.seed)
    docs = [document(rng, args.doc_words) for _ in range(args.sessions)]
    ttft: list[float] = []
    client = AsyncClient(cep, timeout_s=600)

    async def session(i: int) -> None:
        srng = random.Random(args.seed * 1000 + i)
        history = [{"role": "system", "content": f"Document {i}: {docs[i]}"}]
        await asyncio.sleep(srng.uniform(0, 1.0))
        for t in range(args.turns):
            history.append({"role": "user", "content": f"Question {t}: what about the {srng.choice(WORDS)}?"})
            t0 = time.perf_counter()
            first = None
            result = None
            async for msg in client.stream(messages=history, max_tokens=args.max_tokens, temperature=0.0):
                if first is None:
                    first = time.perf_counter()
                result = msg
            ttft.append(((first or time.perf_counter()) - t0) * 1000)
            history.append({"role": "assistant", "content": result.text})  # type: ignore[union-attr]
            await asyncio.sleep(srng.uniform(0, args.think_s))

    t0 = time.perf_counter()
    await asyncio.gather(*(session(i) for i in range(args.sessions)))
    wall = time.perf_counter() - t0
    await client.close()
    m = router.metrics
    recs = list(m.recent)
    out = {
        "requests": len(recs),
        "reuse": m.reused_tokens / max(1, m.prompt_tokens),
        "mean_ttft_ms": statistics.mean(ttft),
        "p90_ttft_ms": sorted(ttft)[int(0.9 * len(ttft))],
        "wall_s": wall,
        "mispredicted": m.reuse_mispredictions,
        "mirror_mismatches": m.mirror_mismatches,
        "decision_p99_ms": m.decision_ms.quantile(0.99),
    }
    router.stop()
    await task
    return out


def policies_bench(args: argparse.Namespace) -> None:
    import os

    from common import logs
    from router.main import run_loop

    logs.setup(args.log_level, process="bench")
    policies = args.policies.split(",")
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in policies}
    load_before = os.getloadavg()[0]

    async def all_policies() -> None:
        for r in range(args.repeat):  # interleaved, so background load hits every policy alike
            for p in policies:
                print(f"round {r + 1}/{args.repeat}: policy {p} ...", file=sys.stderr)
                runs[p].append(await run_policy(p, args))

    run_loop(all_policies())
    results = {p: {k: statistics.mean(x[k] for x in rs) for k in rs[0]} for p, rs in runs.items()}
    print(
        f"\n{args.sessions} sessions x {args.turns} turns on 2 workers x {args.slots} slots "
        f"(threads {args.threads}, document {args.doc_words} words, max_tokens {args.max_tokens}, think 0..{args.think_s} s); "
        f"mean of {args.repeat} interleaved round(s); load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after\n"
    )
    cols = ["requests", "reuse", "mean_ttft_ms", "p90_ttft_ms", "wall_s", "mispredicted", "mirror_mismatches", "decision_p99_ms"]
    print("| policy | " + " | ".join(cols) + " |")
    print("| --- " * (len(cols) + 1) + "|")
    for p, r in results.items():
        print(f"| {p} | " + " | ".join(f"{r[c]:.3f}" for c in cols) + " |")
    if "prefix" in results:
        for p, r in results.items():
            if p != "prefix":
                print(
                    f"prefix vs {p}: reuse x{results['prefix']['reuse'] / max(1e-9, r['reuse']):.2f}, "
                    f"mean TTFT {r['mean_ttft_ms'] / results['prefix']['mean_ttft_ms']:.2f}x lower"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    d = sub.add_parser("decision")
    d.add_argument("--workers", type=int, default=64)
    d.add_argument("--slots", type=int, default=16)
    d.add_argument("--ctx", type=int, default=8192)
    d.add_argument("--systems", type=int, default=8, help="distinct shared system prompts")
    d.add_argument("--decisions", type=int, default=3000)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--saved", type=int, default=0, help="host-RAM and disk entries indexed beside the slots")
    d.add_argument("--saved-tokens", type=int, default=2048, help="tokens of each saved entry")
    p = sub.add_parser("policies")
    p.add_argument("--policies", default="prefix,round-robin,least-loaded")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--doc-words", type=int, default=150)
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--think-s", type=float, default=1.0, help="pause between turns: uniform 0..think-s")
    p.add_argument("--busy-wait-ms", type=int, default=1000)
    p.add_argument("--hold-ms", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--repeat", type=int, default=1, help="rounds, policies interleaved within each")
    args = ap.parse_args()
    if args.what == "decision":
        out = decision_bench(
            args.workers, args.slots, args.ctx, args.systems, args.decisions, args.seed, args.saved, args.saved_tokens
        )
        for k, v in out.items():
            print(f"{k:>24}: {v:.4f}" if isinstance(v, float) else f"{k:>24}: {v}")
    else:
        policies_bench(args)


if __name__ == "__main__":
    main()
