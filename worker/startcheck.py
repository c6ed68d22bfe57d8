"""A worker checks its engine before it says hello: a llama.cpp that crashes on this machine is seen at start, not on
a user's request (each stage is recorded by common/start_record.py, which also says when to stop trying)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import llama_cpp
import numpy as np

from worker.faults import Faults
from worker.llama import Llama


def identity(model_path: str) -> str:
    """The build (llama.cpp's version and system info) and the model file (path, size, time): what a crash is of."""
    try:
        st = os.stat(model_path)
        model = f"{os.path.realpath(model_path)}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        model = model_path
    build = f"{llama_cpp.__version__}:{llama_cpp.llama_print_system_info().decode(errors='replace')}"
    return hashlib.sha256(f"{build}\n{model}".encode()).hexdigest()[:16]


def first_decode(llama: Llama, tokens: int = 4) -> list[int]:
    """Decode a few tokens on slot 0 greedily, as a request would, then clear the slot; returns the tokens chosen.
    Raises on an error code. A build that cannot run on this CPU kills the process here instead."""
    token = llama.vocab.bos if llama.vocab.bos is not None else 0
    chosen = []
    try:
        for pos in range(tokens):
            llama.batch.clear()
            llama.batch.add(token, pos, 0, True)
            ret = llama.decode()
            if ret != 0:
                raise RuntimeError(f"llama_decode returned {ret} in the worker's first decode")
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llama.ctx, 0), shape=(llama.vocab.n_vocab,))
            token = int(logits.argmax())
            chosen.append(token)
    finally:
        llama.batch.clear()
        llama.seq_clear(0)
    return chosen


def smoke(model: str, threads: int, gpu: int | None = None) -> dict[str, object]:
    """Load `model` on one small slot (on GPU `gpu`, else CPU) and run the first decode, as a worker's start does
    (`kvroute doctor` runs this in a child process, so a crash is reported there rather than suffered)."""
    t0 = time.monotonic()
    llama = Llama(model, slots=1, ctx_per_slot=256, n_batch=32, threads=threads, gpu=gpu)
    loaded = time.monotonic()
    try:
        Faults.from_env().at_start("first-decode", "doctor")  # the fault tests' stand-in for a build that crashes here
        tokens = first_decode(llama)
    finally:
        llama.close()
    return {
        "ok": True,
        "tokens": tokens,
        "load_s": round(loaded - t0, 3),
        "decode_ms": round((time.monotonic() - loaded) * 1e3, 1),
        "device": llama.device,
    }


if __name__ == "__main__":  # python -m worker.startcheck MODEL [THREADS [GPU]]: one JSON line
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else (os.cpu_count() or 1)
    print(json.dumps(smoke(sys.argv[1], threads, int(sys.argv[3]) if len(sys.argv) > 3 else None)))
