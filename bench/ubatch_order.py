"""What a batch's row order costs: llama.cpp's ubatches with one KV stream per slot.

With `kv_unified = false` (kvroute's worker, and llama-server's with `--parallel`) llama.cpp splits a batch with
`split_equal(sequential)`: one ubatch takes only increasing, consecutive seq ids, the same number of rows from each,
and every ubatch is a pass over the weights. Four slots hold the same text; each shape decodes some rows (a seq id,
its rows, how many of them ask for logits; rows without logits are padding) and removes their KV again. Shapes run
interleaved, round after round; the figure is the median after the first rounds (worker/batching.py `_write` rests
on it).

    .venv/bin/python -m bench.ubatch_order [--rounds 12] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common.model import resolve_model
from worker.config import WorkerConfig
from worker.llama import Llama

SLOTS = 4
HELD = 250  # tokens each slot holds
TEXT = "the keeper of the lighthouse wrote in his log that the wind turned north and the sea rose over the rocks. "
WARMUP_ROUNDS = 3
# name: (seq id, rows, rows with logits) in batch order
SHAPES: dict[str, list[tuple[int, int, int]]] = {
    "slots 0,1,2,3 x 1": [(0, 1, 1), (1, 1, 1), (2, 1, 1), (3, 1, 1)],
    "slots 1,2,0,3 x 1 (out of order)": [(1, 1, 1), (2, 1, 1), (0, 1, 1), (3, 1, 1)],
    "slots 0,2 x 1 (a gap)": [(0, 1, 1), (2, 1, 1)],
    "slots 0,2 x 1, padding row in 1": [(0, 1, 1), (1, 1, 0), (2, 1, 1)],
    "slots 0,1 x 1": [(0, 1, 1), (1, 1, 1)],
    "slot 0 x 1": [(0, 1, 1)],
    "slot 0 x 4, slots 1-3 x 1 (guesses)": [(0, 4, 4), (1, 1, 1), (2, 1, 1), (3, 1, 1)],
    "slot 0 x 4, slots 1-3 x 1 + 3 padding": [(0, 4, 4), (1, 4, 1), (2, 4, 1), (3, 4, 1)],
    "slots 0-3 x 4 (guesses in every slot)": [(s, 4, 4) for s in range(SLOTS)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    llama = Llama(resolve_model(WorkerConfig().model), slots=SLOTS, ctx_per_slot=1024, n_batch=512, threads=args.threads)
    tokens = llama.vocab.tokenize(TEXT * 20)[:HELD]
    for seq in range(SLOTS):
        llama.batch.clear()
        llama.batch.add_run(tokens, 0, seq, True)
        if llama.decode() != 0:
            raise SystemExit("llama_decode failed while filling the slots")

    def decode(shape: list[tuple[int, int, int]]) -> float:
        llama.batch.clear()
        for seq, rows, logits in shape:
            for i in range(rows):
                llama.batch.add(tokens[i], HELD + i, seq, i < logits)
        t0 = time.perf_counter()
        if llama.decode() != 0:
            raise SystemExit("llama_decode failed")
        took = time.perf_counter() - t0
        for seq, _, _ in shape:
            llama.seq_rm(seq, HELD, -1)
        return took * 1e3

    times: dict[str, list[float]] = {name: [] for name in SHAPES}
    for _ in range(args.rounds):
        for name, shape in SHAPES.items():
            times[name].append(decode(shape))
    print(f"{args.rounds} interleaved rounds, median of all but the first {WARMUP_ROUNDS}, --threads {args.threads}")
    for name, ms in times.items():
        kept = ms[WARMUP_ROUNDS:] or ms
        print(f"  {name:40s} {statistics.median(kept):7.1f} ms ({min(kept):.1f}-{max(kept):.1f})")
    llama.close()


if __name__ == "__main__":
    main()
