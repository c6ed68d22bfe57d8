"""What deterministic mode costs: `--deterministic` vs the default, two engines side by side, interleaved rounds.

    .venv/bin/python -m bench.exact_probe [--rounds 5] [--threads 2]

1. throughput: 3 slots generating 48 tokens each at once: aggregate decode tokens/s (slot 3 keeps the conversation);
2. agent turn: a conversation of ~1,000 tokens gets its next 40-token user message, then its reply of 24 tokens,
   and so on: time to first token of the turn, whose history (previous reply included) is cached.

Prints the medians, the min-max across rounds and the ratio deterministic / default (goals: throughput >= 0.9,
cached TTFT <= 1.1), and each engine's steps and batch rows over the whole run (counts, free of the machine's noise:
deterministic mode pads its decode batches, see worker/core.py).
"""

from __future__ import annotations

import argparse
import statistics

from bench.worker_bench import decode_rate, run
from protocol import unpack_tokens
from worker.config import WorkerConfig
from worker.engine import Engine

STORY = "The lighthouse keeper wrote in the log that the wind had turned north before dawn and the sea rose. "


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    engines = {m: Engine(WorkerConfig(slots=4, ctx_per_slot=4096, threads=a.threads, deterministic=m == "deterministic")).start()
               for m in ("default", "deterministic")}  # fmt: skip
    vocab = engines["default"].vocab
    history = {m: vocab.tokenize(STORY * 10) for m in engines}
    tput: dict[str, list[float]] = {m: [] for m in engines}
    ttft: dict[str, list[float]] = {m: [] for m in engines}
    for r in range(a.rounds):
        for m, e in engines.items():
            stories = [vocab.tokenize(f"r{r} story {i}: {STORY}") for i in range(3)]
            tput[m].append(decode_rate(e, stories, 48, None))
            text = f"\nUser: question {r}, about the boats and the lamp in the storm, please answer.\nKeeper:"
            turn = vocab.tokenize(text, add_special=False)
            prompt = history[m] + turn
            done = run(e, prompt, f"{m}-t{r}", slot=3, max_tokens=24)
            if r > 0:  # the first turn is cold
                ttft[m].append(done.timings.ttft_ms)
            history[m] = prompt + unpack_tokens(done.tokens)
            print(f"round {r} {m:14s} {tput[m][-1]:6.1f} tok/s  turn ttft {done.timings.ttft_ms:6.1f} ms  "
                  f"reused {done.reused_tokens}/{done.prompt_tokens}", flush=True)  # fmt: skip
    for m in engines:
        print(f"{m:14s} throughput {statistics.median(tput[m]):6.1f} tok/s ({min(tput[m]):.1f}-{max(tput[m]):.1f})"
              f"  cached ttft {statistics.median(ttft[m]):6.1f} ms ({min(ttft[m]):.1f}-{max(ttft[m]):.1f})")  # fmt: skip
    d, x = "default", "deterministic"
    print(f"deterministic / default: throughput {statistics.median(tput[x]) / statistics.median(tput[d]):.2f}x (goal >= 0.9), "
          f"cached ttft {statistics.median(ttft[x]) / statistics.median(ttft[d]):.2f}x (goal <= 1.1)")  # fmt: skip
    for m, e in engines.items():
        c = e.counters
        print(f"{m:14s} steps {c.steps}  batch rows {c.batch_rows}  generated {c.generated_tokens}  "
              f"guessed {c.spec_proposed}, taken {c.spec_accepted}")  # fmt: skip
        e.stop()


if __name__ == "__main__":
    main()
