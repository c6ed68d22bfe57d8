"""Which context settings a llama.cpp build survives on a device: each case loads the model and creates a context
(worker/llama.py `Llama`, as a worker does), then decodes a few tokens, in a child process of its own, so that a
crash (found on an H200, 2026-11-26: `kvroute doctor --gpu 0` passed with 1 slot x 256 tokens, a worker with 4 x 2048
died of SIGSEGV before its context was made) is a row of the table, with the Python call it happened under, the
native frames (bench/gpu/segv_trace.c, preloaded with --preload) and llama.cpp's last log lines, instead of the end
of the run. Then llama.cpp alone (its Python bindings, no kvroute code) makes a worker's context with one setting
changed at a time (n_ubatch, kv_unified, swa_full): a crash there and not with another setting names the cause and
whose it is.

The worker-shaped cases (4 slots x 2048, n_batch 512) come in order of preference, each with the `kvroute serve`
flags that make a worker create that context; the last line, `PICK: FLAGS`, gives the first that lived (`PICK: none`
if none did), so that a device script can run everything after the probe with them.

    python -m bench.gpu.context_probe --gpu 0 [--model PATH] [--preload segv_trace.so] [--failed-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

PARALLEL = 4  # cases at once: each is a model load and a context, small beside a GPU's memory


@dataclass(frozen=True)
class Case:
    label: str
    kwargs: dict[str, object]  # worker/llama.py Llama's keywords (kvroute) or raw()'s (llama.cpp alone)
    flags: str | None = None  # the `kvroute serve` flags that make a worker's context as this case does
    raw: bool = False


def _kv(slots: int, ctx: int, n_batch: int, threads: int = 2, fa: str = "auto", swa: str = "on") -> dict[str, object]:
    return {"slots": slots, "ctx_per_slot": ctx, "n_batch": n_batch, "threads": threads, "flash_attn": fa, "swa_full": swa}


# the doctor's smoke test first, then one change at a time towards a worker's defaults
BISECT = [
    Case("smoke test's (1 x 256, n_batch 32, 16 threads)", _kv(1, 256, 32, 16)),
    Case("1 x 256, n_batch 32, 2 threads", _kv(1, 256, 32)),
    Case("1 x 2048, n_batch 32", _kv(1, 2048, 32)),
    Case("1 x 256, n_batch 512", _kv(1, 256, 512)),
    Case("1 x 2048, n_batch 512", _kv(1, 2048, 512)),
    Case("2 x 256, n_batch 32", _kv(2, 256, 32)),
    Case("4 x 256, n_batch 32", _kv(4, 256, 32)),
    Case("4 x 2048, n_batch 32", _kv(4, 2048, 32)),
]
# a worker's context (4 x 2048, n_batch 512: 516 rows), then each with one setting a user can change; in this order
WORKER = [
    Case("worker's defaults", _kv(4, 2048, 512), ""),
    Case("worker, --flash-attn off", _kv(4, 2048, 512, fa="off"), "--flash-attn off"),
    Case("worker, --flash-attn on", _kv(4, 2048, 512, fa="on"), "--flash-attn on"),
    Case("worker, --swa-full off", _kv(4, 2048, 512, swa="off"), "--swa-full off"),
    Case("worker, --n-batch 508 (512 rows)", _kv(4, 2048, 508), "--n-batch 508"),
    Case("worker, --n-batch 252 (256 rows)", _kv(4, 2048, 252), "--n-batch 252"),
    Case("worker, --swa-full off --flash-attn off", _kv(4, 2048, 512, fa="off", swa="off"), "--swa-full off --flash-attn off"),
]
LARGE = [Case("64 x 3072, n_batch 512 (bench/worker_bench.py's)", _kv(64, 3072, 512))]
# a process's imports before its first model load (2026-11-28, an H200: every worker, worker_bench.py and in-process
# test died in `llama_model_load_from_file` while each case above lived; the one native library those processes had
# loaded and these had not was llguidance's): `imports` are imported before the model loads, `imports_after` after it
IMPORTS = [
    Case("worker's defaults, llguidance imported first", {**_kv(4, 2048, 512), "imports": ["llguidance"]}),
    Case("worker's defaults, llguidance._lib alone first", {**_kv(4, 2048, 512), "imports": ["llguidance._lib"]}),
    Case("worker's defaults, worker.engine imported first", {**_kv(4, 2048, 512), "imports": ["worker.engine"]}),
    Case("worker's defaults, zmq imported first", {**_kv(4, 2048, 512), "imports": ["zmq"]}),
    Case("worker's defaults, llguidance imported after the load", {**_kv(4, 2048, 512), "imports_after": ["llguidance"]}),
    Case(
        "worker's defaults, llguidance imported after the load, then a second load",
        {**_kv(4, 2048, 512), "imports_after": ["llguidance"], "load_again": True},
    ),
]


def _raw(slots: int, ctx: int, ubatch: int, unified: bool, swa_full: bool, fa: int = -1) -> Case:
    label = f"llama.cpp alone: {slots} x {ctx}, n_ubatch {ubatch}, kv_unified {unified}, swa_full {swa_full}, fa {fa}"
    return Case(
        label, {"slots": slots, "ctx": ctx, "ubatch": ubatch, "unified": unified, "swa_full": swa_full, "fa": fa}, raw=True
    )


# llama.cpp alone (no kvroute code): a worker's context with one of its settings changed at a time, to tell a
# llama.cpp fault from ours
RAW = [
    _raw(4, 2048, 516, False, True),  # as a worker makes it (worker/llama.py _context_params)
    _raw(4, 2048, 512, False, True),
    _raw(4, 2048, 516, True, True),
    _raw(4, 2048, 516, False, False),
    _raw(4, 2048, 516, False, True, fa=0),
    _raw(1, 2048, 516, False, True),
    _raw(1, 256, 64, False, True),
]
CASES = BISECT + WORKER + LARGE + IMPORTS + RAW


def raw(
    model: str, gpu: int | None, slots: int, ctx: int, ubatch: int, unified: bool, swa_full: bool, fa: int
) -> dict[str, object]:
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
    cp.kv_unified, cp.swa_full, cp.flash_attn_type = unified, swa_full, fa
    ctx_p = llama_cpp.llama_init_from_model(model_p, cp)
    if not ctx_p:
        raise RuntimeError("llama_init_from_model returned NULL")
    try:
        tokens = (llama_cpp.llama_token * 4)(2, 100, 200, 300)
        return {"decode": llama_cpp.llama_decode(ctx_p, llama_cpp.llama_batch_get_one(tokens, 4))}
    finally:
        llama_cpp.llama_free(ctx_p)
        llama_cpp.llama_model_free(model_p)


def one(
    model: str,
    gpu: int | None,
    imports: tuple[str, ...] = (),
    imports_after: tuple[str, ...] = (),
    load_again: bool = False,
    **kwargs: object,
) -> dict[str, object]:
    import importlib

    from worker.llama import Llama
    from worker.startcheck import first_decode

    for name in imports:
        importlib.import_module(name)
    llama = Llama(model, gpu=gpu, **kwargs)  # type: ignore[arg-type]
    try:
        for name in imports_after:
            importlib.import_module(name)
        if load_again:
            llama.close()
            llama = Llama(model, gpu=gpu, **kwargs)  # type: ignore[arg-type]
        return {"tokens": first_decode(llama), "rows": llama.rows, "kv_mib": llama.info.kv_bytes >> 20}
    finally:
        llama.close()


FRAME = re.compile(r"^(\S+)\(([^)+]*)\+(0x[0-9a-f]+)\)\[0x[0-9a-f]+\]$")


def named(lines: list[str]) -> list[str]:
    """segv_trace's frames with their function names: `lib.so(+0xOFF)` through addr2line (the build keeps its symbol
    table), a mangled name through c++filt."""
    out = []
    for line in lines:
        m = FRAME.match(line.strip())
        if not m:
            out.append(line)
            continue
        path, sym, off = m.groups()
        name = sym
        try:
            if not sym and shutil.which("addr2line"):
                name = subprocess.run(
                    ["addr2line", "-C", "-f", "-e", path, off], capture_output=True, text=True, timeout=20
                ).stdout.split("\n")[0]
            elif sym and shutil.which("c++filt"):
                name = subprocess.run(["c++filt", sym], capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
        out.append(f"{os.path.basename(path)}: {name or '?'} +{off}")
    return out


@dataclass
class Outcome:
    case: Case
    returncode: int
    stdout: str
    stderr: str
    argv: list[str] = field(default_factory=list)


def run_case(case: Case, a: argparse.Namespace, model: str, env: dict[str, str]) -> Outcome:
    flag = "--raw-case" if case.raw else "--case"
    argv = [sys.executable, "-X", "faulthandler", "-m", "bench.gpu.context_probe", "--gpu", str(a.gpu), "--model", model,
            flag, json.dumps(case.kwargs)]  # fmt: skip
    try:
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        return Outcome(case, out.returncode, out.stdout, out.stderr, argv)
    except subprocess.TimeoutExpired as exc:
        return Outcome(case, -999, str(exc.stdout or ""), f"timed out after 120 s\n{exc.stderr or ''}", argv)


def report(o: Outcome) -> None:
    if o.returncode == 0:
        print(f"ok      {o.case.label}: {o.stdout.strip().splitlines()[-1]}")
        return
    print(f"FAILED  {o.case.label}: exit {o.returncode}")
    lines = o.stderr.strip().splitlines()
    native = lines.index("--- native stack (segv_trace) ---") if "--- native stack (segv_trace) ---" in lines else len(lines)
    before = lines[:native]
    stack = [line.strip() for line in before if line.strip().startswith("File ")][:8]
    logs = [line for line in before if not line.strip().startswith("File ")][-20:]
    print("\n".join(f"    {line}" for line in [*logs, "  python stack:", *stack]))
    if native < len(lines):
        print("  native stack:\n" + "\n".join(f"    {line}" for line in named(lines[native + 1 :])[:30]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpu", type=int, default=0, help="GPU index (-1: CPU, to try the probe where there is no GPU)")
    p.add_argument("--model", default=None)
    p.add_argument("--preload", default=None, help="a library to preload into each case (segv_trace.so)")
    p.add_argument("--failed-out", default=None, help="write the first failed kvroute case's argv here (JSON)")
    p.add_argument("--only", default=None, help="run only the cases whose label contains this")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child's one case, as JSON
    p.add_argument("--raw-case", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    from common.model import resolve_model

    model = str(resolve_model(a.model))
    gpu = None if a.gpu < 0 else a.gpu
    if a.case or a.raw_case:
        print(json.dumps(one(model, gpu, **json.loads(a.case)) if a.case else raw(model, gpu, **json.loads(a.raw_case))))
        return 0
    env = dict(os.environ, KVROUTE_LLAMA_VERBOSE="1")
    if a.preload:
        env["LD_PRELOAD"] = os.path.abspath(a.preload)
    cases = [c for c in CASES if not a.only or a.only in c.label]
    with ThreadPoolExecutor(PARALLEL) as pool:
        outcomes = list(pool.map(lambda c: run_case(c, a, model, env), cases))
    for o in outcomes:
        report(o)
    failed = [o for o in outcomes if o.returncode != 0]
    first = next((o for o in failed if not o.case.raw), None)
    if a.failed_out and first is not None:
        with open(a.failed_out, "w") as f:
            json.dump([arg for arg in first.argv if arg != "-X" and arg != "faulthandler"], f)
    picked = next((o.case.flags for o in outcomes if o.case.flags is not None and o.returncode == 0), None)
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} cases lived")
    print(f"PICK: {'none' if picked is None else picked or '(defaults)'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
