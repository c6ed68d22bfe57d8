"""The GPU path run end to end (issue 31, part 2): `kvroute serve --gpus` with every layer on the GPU, with part of
them (`--n-gpu-layers`), and with two workers on one GPU; each answers a chat request, and `kvroute status` shows
each worker's device and KV size. Prints what it saw; exit status 1 if any of them failed.

    python -m bench.gpu.smoke --gpu 0 [--model PATH]
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.systems import Server, Setup
from common.model import resolve_model

CASES = {
    "all layers on the GPU": (1, ()),
    "8 layers on the GPU (--n-gpu-layers 8)": (1, ("--n-gpu-layers", "8")),
    "two workers on one GPU": (2, ()),
}


def check(name: str, setup: Setup, logs: Path) -> bool:
    print(f"== {name}", flush=True)
    try:
        with Server("kvroute", setup, logs / f"{name.split()[0]}.log") as server:
            print(f"started in {server.startup_s:.1f} s: {server.command_line}")
            t = time.perf_counter()
            body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "temperature": 0}
            reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
            usage = reply.get("usage", {})
            print(f"chat: {time.perf_counter() - t:.3f} s, usage {usage}")
            zmq = server.argvs[0][server.argvs[0].index("--zmq") + 1]
            status = subprocess.run(
                [sys.executable, "-m", "commands.cli", "status", "--connect", zmq], capture_output=True, text=True, timeout=30
            )
            print(status.stdout.strip() or status.stderr.strip())
            return bool(usage.get("completion_tokens")) and status.returncode == 0
    except Exception as exc:  # report and go on to the next case
        print(f"FAILED: {type(exc).__name__}: {exc}")
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", type=int, default=0, help="GPU index (-1: CPU, to try the script where there is no GPU)")
    p.add_argument("--model", default=None)
    p.add_argument("--logs", type=Path, default=Path(tempfile.gettempdir()) / "kvroute-gpu-smoke")
    p.add_argument("--kvroute-flags", default="", help="more `kvroute serve` flags for every case (context_probe's PICK)")
    a = p.parse_args()
    model = str(resolve_model(a.model))
    ok = True
    gpu = None if a.gpu < 0 else a.gpu
    for name, (workers, flags) in CASES.items():
        flags = (flags if gpu is not None else ()) + tuple(shlex.split(a.kvroute_flags))
        setup = Setup(model=model, threads=2, workers=workers, slots=4, ctx_per_slot=2048, kvroute_flags=flags, gpu=gpu)
        ok = check(name, setup, a.logs) and ok
    print("smoke:", "ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
