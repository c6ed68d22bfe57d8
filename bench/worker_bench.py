"""Worker benchmark (run by hand): the worker's ratios, side by side, in one run.

    .venv/bin/python bench/worker_bench.py [--threads 2] [--deterministic] [--repeats 5] [--slots 8] [--gpu 0]

1. agent turn: cached time to first token / cold time to first token (~2,000-token history + ~50 new tokens)
2. batching: aggregate decode tokens/s with every slot (8 by default) generating / with 1 slot
3. engine overhead: time outside llama_decode as a share of step time, every slot decoding
4. grammar: aggregate decode tokens/s of every slot when one of them is grammar-constrained / when none is
   (interleaved repeats; goal >= 0.90)
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec

from protocol import Constraint, Job, JobDone, ResponseFormat, Sampling, pack_tokens
from worker.config import WorkerConfig
from worker.engine import Engine


def run(engine: Engine, prompt: list[int], jid: str, *, slot: int, max_tokens: int, cache: bool = True) -> JobDone:
    job = Job(
        id=jid,
        slot=slot,
        tokens=pack_tokens(prompt),
        sampling=Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        prefix_cache=cache,
    )
    done = engine.submit(job).result(600)
    assert isinstance(done, JobDone), done
    return done


def decode_rate(engine: Engine, prompts: list[list[int]], gen: int, guided: Constraint | None, salt: str = "") -> float:
    """Aggregate decode tokens/s of one job per prompt, all at once (the first one under `guided`), for tenant
    `salt`; slots cleared first so that each round computes the same."""
    for s in range(len(prompts)):
        engine.call(lambda e, s=s: e.prefixes.clear(e.table[s])).result()
    sampling = Sampling(temperature=0.0, max_tokens=gen, ignore_eos=True)
    t = time.perf_counter()
    streams = [
        engine.submit(
            Job(
                id=f"g{i}-{t}",
                slot=i,
                tokens=pack_tokens(p),
                sampling=sampling,
                constraint=guided if i == 0 else None,
                cache_salt=salt,
            )
        )
        for i, p in enumerate(prompts)
    ]
    dones = [s.result(600) for s in streams]
    assert all(isinstance(d, JobDone) for d in dones), dones
    wall = time.perf_counter() - t
    first = max(d.timings.ttft_ms for d in dones) / 1000  # every slot is decoding from here on
    return sum(d.generated_tokens - 1 for d in dones) / (wall - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--gen", type=int, default=64, help="tokens per slot in the batching run")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats of the grammar comparison")
    ap.add_argument("--slots", type=int, default=8, help="slots, all decoding in the batching, overhead and grammar runs")
    ap.add_argument("--gpu", type=int, default=None, help="every layer on this GPU (default: CPU)")
    a = ap.parse_args()
    n = a.slots
    config = WorkerConfig(slots=n, ctx_per_slot=3072, threads=a.threads, deterministic=a.deterministic, gpu=a.gpu)
    engine = Engine(config).start()
    v = engine.vocab
    history = v.tokenize("Agent log: the tool returned a list of files and their sizes. " * 170)[:2000]
    turn = v.tokenize(" Now summarise what the files contain and decide the next tool call to make.", add_special=False)
    turn = (turn * 4)[:50]
    prompt = history + turn

    # 1. agent turn
    cold = run(engine, prompt, "cold", slot=0, max_tokens=1, cache=False)
    run(engine, history, "seed", slot=1, max_tokens=1, cache=False)  # slot 1 holds the history
    cached = run(engine, prompt, "cached", slot=1, max_tokens=1)
    agent = cached.timings.ttft_ms / cold.timings.ttft_ms

    # 2 + 3. batching and overhead
    prompts = [v.tokenize(f"Story {i}: once upon a time there was") for i in range(n)]
    t = time.perf_counter()
    one = run(engine, prompts[0], "one", slot=0, max_tokens=a.gen, cache=False)
    tps1 = one.generated_tokens / (one.timings.decode_ms / 1000)
    for s in range(n):  # every slot emptied first
        engine.call(lambda e, s=s: e.prefixes.clear(e.table[s])).result()
    c0 = msgspec.structs.replace(engine.counters)
    t = time.perf_counter()
    streams = [
        engine.submit(
            Job(id=f"b{i}", slot=i, tokens=pack_tokens(p), sampling=Sampling(temperature=0.0, max_tokens=a.gen, ignore_eos=True))
        )
        for i, p in enumerate(prompts)
    ]
    dones = [s.result(600) for s in streams]
    wall = time.perf_counter() - t
    c1 = engine.counters
    first = min(d.timings.ttft_ms for d in dones) / 1000
    tpsn = sum(d.generated_tokens for d in dones) / (wall - first)
    overhead = 1 - (c1.decode_s - c0.decode_s) / (c1.step_s - c0.step_s)

    # 4. grammar: every slot decoding, one of them under a JSON-array grammar that never ends by itself
    schema = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1000}  # longer than --gen
    from chat.grammar import constraint  # llguidance after the model loads (worker/guide.py says why)

    guided = constraint(None, None, "auto", True, ResponseFormat(type="json_schema", schema=schema), None)
    assert guided is not None
    free, constrained = [], []
    for _ in range(a.repeats):
        free.append(decode_rate(engine, prompts, a.gen, None))
        constrained.append(decode_rate(engine, prompts, a.gen, guided))
    ratios = [c / f for f, c in zip(free, constrained, strict=True)]
    engine.stop()

    where = "CPU" if a.gpu is None else f"GPU {a.gpu}"
    print(f"mode: {'deterministic' if a.deterministic else 'default'}, threads {a.threads}, {where}, {n} slots")
    print(
        f"agent turn   : cold TTFT {cold.timings.ttft_ms:8.1f} ms, cached TTFT {cached.timings.ttft_ms:7.1f} ms "
        f"(reused {cached.reused_tokens}), ratio {agent:.3f} (target <= 0.10)"
    )
    print(f"batching     : 1 slot {tps1:6.1f} tok/s, {n} slots {tpsn:6.1f} tok/s, ratio {tpsn / tps1:.2f} (target >= 1.3)")
    print(f"overhead     : {overhead * 100:.1f}% of step time outside llama_decode at {n} slots (target <= 5%)")
    free_tps, guided_tps = statistics.median(free), statistics.median(constrained)
    print(
        f"grammar      : {n} slots {free_tps:6.1f} tok/s, one constrained {guided_tps:6.1f} tok/s, "
        f"ratio {statistics.median(ratios):.3f} (per repeat {min(ratios):.3f}..{max(ratios):.3f}; target >= 0.90)"
    )


if __name__ == "__main__":
    main()
