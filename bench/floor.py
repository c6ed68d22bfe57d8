"""What llama.cpp itself needs for one turn, with no server: the prefill of the turn's new tokens after its history.

A server that reuses the whole history still has to compute the new tokens, and each of them attends to every
position before it, so this cost grows with the history whatever the server does. `bench.run` measures it for
the turns the long-session goal compares, with kvroute's own context settings (`worker.llama.Llama`: same
threads, slots, context and batch), so the report can say how flat a turn could possibly be on this machine.

    python -m bench.floor --threads 2 --slots 4 --ctx-per-slot 26112 --point 2229:51 --point 25000:51

prints one JSON object: {"points": [[history, new, seconds], ...]}. History tokens are arbitrary ids (attention
costs the same whatever the tokens are); each point is the median of `--repeat` timed prefills.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from common.model import resolve_model
from worker.config import WorkerConfig
from worker.llama import Llama


def measure(llama: Llama, points: list[tuple[int, int]], repeat: int) -> list[tuple[int, int, float]]:
    """Seconds to prefill `new` tokens (logits for the last) after `history` tokens in slot 0, per point."""
    rng = random.Random(0)
    need = max(h + n for h, n in points)
    tokens = [rng.randrange(1000, llama.vocab.n_vocab) for _ in range(need)]
    chunk = llama.batch.capacity
    held = 0
    out: dict[tuple[int, int], float] = {}
    for history, new in sorted(set(points)):
        if held > history:
            llama.seq_rm(0, history, -1)
            held = history
        while held < history:  # extend the history in full chunks, as a prefill would
            n = min(chunk, history - held)
            _decode(llama, tokens[held : held + n], held, logits=False)
            held += n
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            _decode(llama, tokens[history : history + new], history, logits=True)
            times.append(time.perf_counter() - t0)
            llama.seq_rm(0, history, -1)
        out[(history, new)] = statistics.median(times)
    return [(h, n, out[(h, n)]) for h, n in points]


def _decode(llama: Llama, tokens: list[int], pos: int, *, logits: bool) -> None:
    llama.batch.clear()
    llama.batch.add_run(tokens, pos, 0, logits)
    ret = llama.decode()
    if ret != 0:
        raise RuntimeError(f"llama_decode returned {ret} at position {pos} ({len(tokens)} tokens)")


def point(text: str) -> tuple[int, int]:
    try:
        history, new = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a point is HISTORY:NEW (two integers), got {text!r}") from None
    if history < 0 or new < 1:
        raise argparse.ArgumentTypeError(f"a point needs HISTORY >= 0 and NEW >= 1, got {text!r}")
    return history, new


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF path (default: kvroute's default model)")
    p.add_argument("--threads", type=int, default=WorkerConfig.threads)
    p.add_argument("--slots", type=int, default=WorkerConfig.slots, help="slots of the context (as the server had)")
    p.add_argument("--ctx-per-slot", type=int, required=True)
    p.add_argument("--n-batch", type=int, default=WorkerConfig.n_batch)
    p.add_argument("--point", type=point, action="append", required=True, help="HISTORY:NEW, repeatable")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--gpu", type=int, default=None, help="every layer on this GPU (default: CPU)")
    a = p.parse_args(argv)
    if any(h + n > a.ctx_per_slot for h, n in a.point):
        p.error(f"every HISTORY + NEW must fit --ctx-per-slot {a.ctx_per_slot}")
    llama = Llama(
        resolve_model(a.model), slots=a.slots, ctx_per_slot=a.ctx_per_slot, n_batch=a.n_batch, threads=a.threads, gpu=a.gpu
    )
    try:
        points = measure(llama, a.point, a.repeat)
    finally:
        llama.close()
    json.dump({"points": points}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
