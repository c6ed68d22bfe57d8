"""Which context settings a llama.cpp build survives on a device: each case loads the model and creates a context
(worker/llama.py `Llama`, as a worker does), then decodes a few tokens, in a child process of its own, so that a
crash (found on an H200, 2026-11-26: `kvroute doctor --gpu 0` passed with 1 slot x 256 tokens, a worker with 4 x 2048
died of SIGSEGV before its context was made) is a row of the table, with the Python call it happened under and
llama.cpp's last log lines, instead of the end of the run. Then llama.cpp alone (its Python bindings, no kvroute
code) makes a worker's context with one setting changed at a time (n_ubatch, kv_unified, swa_full): a crash there
and not with another setting names the cause and whose it is.

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


# llama.cpp alone (no kvroute code): (slots, ctx per slot, n_ubatch, kv_unified, swa_full), a worker's context with one
# of its settings changed at a time, to tell a llama.cpp fault from ours
RAW_CASES = [
    (4, 2048, 516, False, True),  # as a worker makes it (worker/llama.py _context_params)
    (4, 2048, 512, False, True),
    (4, 2048, 516, True, True),
    (4, 2048, 516, False, False),
    (1, 256, 64, False, True),
]


def raw(model: str, gpu: int | None, slots: int, ctx: int, ubatch: int, unified: bool, swa_full: bool) -> dict[str, object]:
    """Load the model and make a context with llama-cpp-python's bindings only, then decode 4 tokens."""
    import llama_cpp

    from common.vocab import init_backend

    init_backend()
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0 if gpu is None else -1
    if gpu is not None:
        mp.split_mode, mp.main_gpu = 0, gpu
    model_p = llama_cpp.llama_model_load_from_file(model.encode(), mp)
    cp = llama_cpp.llama_context_default_params()
    cp.n_seq_max, cp.n_ctx, cp.n_batch, cp.n_ubatch = slots, slots * ctx, ubatch, ubatch
    cp.kv_unified, cp.swa_full = unified, swa_full
    ctx_p = llama_cpp.llama_init_from_model(model_p, cp)
    if not ctx_p:
        raise RuntimeError("llama_init_from_model returned NULL")
    try:
        tokens = (llama_cpp.llama_token * 4)(2, 100, 200, 300)
        return {"decode": llama_cpp.llama_decode(ctx_p, llama_cpp.llama_batch_get_one(tokens, 4))}
    finally:
        llama_cpp.llama_free(ctx_p)
        llama_cpp.llama_model_free(model_p)


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
    p.add_argument("--raw-case", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    from common.model import resolve_model

    model = str(resolve_model(a.model))
    gpu = None if a.gpu < 0 else a.gpu
    if a.case or a.raw_case:
        print(json.dumps(one(model, gpu, *json.loads(a.case)) if a.case else raw(model, gpu, *json.loads(a.raw_case))))
        return 0
    env = dict(os.environ, KVROUTE_LLAMA_VERBOSE="1")
    failed = 0
    runs = [("--case", c, "slots {} ctx {} n_batch {} threads {} fa {}".format(*c)) for c in CASES]
    runs += [
        ("--raw-case", c, "llama.cpp alone: slots {} ctx {} n_ubatch {} kv_unified {} swa_full {}".format(*c)) for c in RAW_CASES
    ]
    for flag, case, label in runs:
        argv = [sys.executable, "-X", "faulthandler", "-m", "bench.gpu.context_probe", "--gpu", str(a.gpu),
                "--model", model, flag, json.dumps(case)]  # fmt: skip
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
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
