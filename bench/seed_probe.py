"""What a seed costs (issue 30): the same sampled workloads unseeded and seeded on a default engine, and seeded on a
deterministic engine, interleaved rounds (the order rotates), no HTTP.

    KVROUTE_LOG_LEVEL=warning .venv/bin/python -m bench.seed_probe [--rounds 9]

Workloads (ignore_eos):
- sampled: 4 slots generating 64 tokens at once at temperature 0.8, story prompts: aggregate decode tokens/s (from the
  first token); seeded on a default engine, each prompt is computed in llama_decodes of its own, padded;
- beside: the same with only the first job seeded: the other three's decode tokens/s (what a seeded job costs the
  unseeded ones beside it);
- copy: 1 slot asked to repeat a 300-token code text at temperature 0.3, 96 tokens: decode tokens/s (where speculation pays);
- ttft: a cold 300-token prompt, 1 token: time to first token (a seeded job computes its last prompt token alone).
Each figure: median over rounds (min-max); each ratio: the median of the per-round ratios (min-max).
"""

from __future__ import annotations

import argparse
import statistics

from protocol import Job, JobDone, Sampling, pack_tokens
from worker.config import WorkerConfig
from worker.engine import Engine

STORY = "<start_of_turn>user\nTell story {i} about a ship, its cook and a storm.<end_of_turn>\n<start_of_turn>model\n"
TEXT = (
    "def apply_discount(order, rate):\n    total = sum(item.price * item.quantity for item in order.items)\n"
    "    if rate <= 0 or rate >= 1:\n        raise ValueError('rate must be between 0 and 1')\n"
    "    discounted = total * (1 - rate)\n    order.total = round(discounted, 2)\n    return order.total\n"
)
COPY = f"<start_of_turn>user\nRepeat this code exactly:\n{TEXT * 3}<end_of_turn>\n<start_of_turn>model\n"
LONG = "The lighthouse keeper wrote in the log that the wind had turned north before dawn and the sea rose. "

MODES = ("default-unseeded", "default-seeded", "deterministic-seeded")


def batch(
    e: Engine,
    prompts: list[list[int]],
    tokens: int,
    seeds: list[int | None],
    tag: str,
    temperature: float = 0.8,
    counted: slice = slice(None),
) -> tuple[float, list[JobDone]]:
    """Decode tokens/s of the jobs `counted`, from the first token of any to the end of the last of them."""
    for s in range(e.cfg.slots):
        e.call(lambda e, s=s: e.prefixes.clear(e.table[s])).result()
    streams = [
        e.submit(
            Job(
                id=f"{tag}-{i}",
                slot=i,
                tokens=pack_tokens(p),
                sampling=Sampling(temperature=temperature, seed=seeds[i], max_tokens=tokens, ignore_eos=True),
            )
        )
        for i, p in enumerate(prompts)
    ]
    dones = [s.result(600) for s in streams]
    assert all(isinstance(d, JobDone) for d in dones), dones
    first = min(d.timings.ttft_ms for d in dones) / 1000  # (from each job's arrival: they arrive together)
    last = max(d.timings.total_ms for d in dones[counted]) / 1000  # the end of the last job counted
    return sum(d.generated_tokens for d in dones[counted]) / (last - first), dones  # type: ignore[misc]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    a = p.parse_args()
    engines = {
        "default": Engine(WorkerConfig(slots=4, ctx_per_slot=2048, threads=2)).start(),
        "deterministic": Engine(WorkerConfig(slots=4, ctx_per_slot=2048, threads=2, deterministic=True)).start(),
    }
    vocab = engines["default"].vocab
    res: dict[str, dict[str, list[float]]] = {m: {"sampled": [], "beside": [], "copy": [], "ttft": []} for m in MODES}
    for r in range(a.rounds):
        order = MODES[r % 3 :] + MODES[: r % 3]
        stories = [vocab.tokenize(STORY.format(i=10 * r + i)) for i in range(4)]
        copy = [vocab.tokenize(COPY.replace("rate", f"rate{r}"))]
        long = [vocab.tokenize(f"Round {r}. " + LONG * 14)]
        for m in order:
            e = engines[m.split("-")[0]]
            seeded = m.endswith("-seeded")
            seeds = [1000 * r + i if seeded else None for i in range(4)]
            tps, _ = batch(e, stories, 64, seeds, f"{m}-{r}-s")
            res[m]["sampled"].append(tps)
            tps, _ = batch(e, stories, 64, [seeds[0], None, None, None], f"{m}-{r}-b", counted=slice(1, None))
            res[m]["beside"].append(tps)
            tps, _ = batch(e, copy, 96, seeds, f"{m}-{r}-c", temperature=0.3)
            res[m]["copy"].append(tps)
            _, d = batch(e, long, 1, seeds, f"{m}-{r}-t")
            res[m]["ttft"].append(d[0].timings.ttft_ms)
            print(f"round {r} {m:22s} sampled {res[m]['sampled'][-1]:6.1f} tok/s  beside {res[m]['beside'][-1]:6.1f} tok/s  "
                  f"copy {res[m]['copy'][-1]:6.1f} tok/s  "
                  f"ttft {res[m]['ttft'][-1]:6.1f} ms ({len(long[0])} tokens)", flush=True)  # fmt: skip
    for m in MODES:
        print(m, "  ".join(f"{k} {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for k, v in res[m].items()))
    base = res["default-unseeded"]
    for m in MODES[1:]:
        parts = []
        for k in base:
            ratios = [x / b for x, b in zip(res[m][k], base[k], strict=True)]
            parts.append(f"{k} {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})")
        print(f"{m} / default-unseeded: " + "  ".join(parts))
    for name, e in engines.items():
        c = e.counters
        print(f"{name}: guessed {c.spec_proposed}, taken {c.spec_accepted}, steps {c.steps}, batch rows {c.batch_rows}")
        e.stop()


if __name__ == "__main__":
    main()
