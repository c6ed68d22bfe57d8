"""Which context settings a llama.cpp build survives on a device: each case loads the model and creates a context
(worker/llama.py `Llama`, as a worker does), then decodes a few tokens, in a child process of its own, so that a
crash (found on an H200, 2026-11-26: `kvroute doctor --gpu 0` passed with 1 slot x 256 tokens, a worker with 4 x 2048
died of SIGSEGV before its context was made) is a row of the table, with the Python call it happened under and
llama.cpp's last log lines, instead of the end of the run.

    python -m bench.gpu.context_probe --gpu 0 [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

# (slots, ctx per slot, n_batch, threads, flash attention): the doctor's smoke test first, then one change at a time
# towards a worker's defaults
CASES = [
    (1, 256, 32, 16, "auto"),
    (1, 256, 32, 2, "auto"),
    (1, 2048, 32, 16, "auto"),
    (1, 256, 512, 16, "auto"),
    (4, 256, 32, 16, "auto"),
    (4, 2048, 512, 2, "auto"),
    (4, 2048, 512, 2, "off"),
    (4, 2048, 512, 2, "on"),
    (64, 3072, 512, 2, "auto"),
]


def one(model: str, gpu: int | None, slots: int, ctx: int, n_batch: int, threads: int, flash_attn: str) -> dict[str, object]:
    from worker.llama import Llama
    from worker.startcheck import first_decode

    llama = Llama(model, slots=slots, ctx_per_slot=ctx, n_batch=n_batch, threads=threads, gpu=gpu, flash_attn=flash_attn)
    try:
        return {"tokens": first_decode(llama), "rows": llama.rows, "kv_mib": llama.info.kv_bytes >> 20}
    finally:
        llama.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", type=int, default=0, help="GPU index (-1: CPU, to try the probe where there is no GPU)")
    p.add_argument("--model", default=None)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child's one case, as JSON
    a = p.parse_args()
    from kvroute.model import resolve_model

    model = str(resolve_model(a.model))
    if a.case:
        print(json.dumps(one(model, None if a.gpu < 0 else a.gpu, *json.loads(a.case))))
        return 0
    env = dict(os.environ, KVROUTE_LLAMA_VERBOSE="1")
    failed = 0
    for case in CASES:
        argv = [sys.executable, "-X", "faulthandler", "-m", "bench.gpu.context_probe", "--gpu", str(a.gpu),
                "--model", model, "--case", json.dumps(case)]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        label = "slots {} ctx {} n_batch {} threads {} fa {}".format(*case)
        if out.returncode == 0:
            print(f"ok      {label}: {out.stdout.strip().splitlines()[-1]}")
            continue
        failed += 1
        print(f"FAILED  {label}: exit {out.returncode}")
        lines = out.stderr.strip().splitlines()
        stack = [line for line in lines if line.strip().startswith("File ")][:6]
        print("\n".join(f"    {line}" for line in [*lines[-25:], "  python stack:", *stack]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
