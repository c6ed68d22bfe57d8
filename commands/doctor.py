"""`kvroute doctor`: what a bug report needs about this machine and this install, and whether llama.cpp runs here.

Versions (kvroute, Python, llama-cpp-python), llama.cpp's own system info and the flags this environment's build was
made with (against the ones `scripts/setup` would use now), the CPU's features (AVX-512 and AMX: listed, permitted by
the kernel, compiled in), GPUs seen and whether this build can use them, the default model's path and checksum, free
memory, and a smoke test: the model loaded and a few tokens decoded in a child process, so that a crash is reported
(with its signal and what to try) instead of killing the command. Exit status 0 when the smoke test passed.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common import build
from common.model import ModelError, resolve_model, sha256_of
from common.start_record import ADVICE, STAGES
from common.vocab import Vocab, VocabError
from kvroute import __version__
from router import sampling_defaults
from worker.context_size import llama_devices

SMOKE_TIMEOUT_S = 300.0
ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158  # Linux x86-64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="PATH", help="GGUF model for the smoke test (default: the bundled one)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for the smoke test")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument("--no-smoke", action="store_true", help="skip the smoke test (no model is loaded)")
    parser.add_argument("--gpu", type=int, default=None, metavar="I", help="run the smoke test on GPU I (default: CPU)")


def run(args: argparse.Namespace) -> int:
    report = collect(args.model, args.threads, smoke=not args.no_smoke, gpu=args.gpu)
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0 if args.no_smoke or report["smoke"].get("ok") else 1


def collect(model: str | None, threads: int, smoke: bool = True, gpu: int | None = None) -> dict[str, Any]:
    report: dict[str, Any] = {
        "kvroute": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "llama": llama_build(),
        "cpu": cpu(),
        "gpus": gpus(),
        "memory": memory(),
    }
    try:
        path = resolve_model(model)
        report["model"] = {"path": str(path), "bytes": path.stat().st_size, "sha256": sha256_of(path)}
        report["model"]["sampling"] = model_sampling(path)
    except (ModelError, OSError) as exc:
        report["model"] = {"error": str(exc)}
    if smoke and "path" in report["model"]:
        report["smoke"] = smoke_test(report["model"]["path"], threads, gpu)
    else:
        report["smoke"] = {"skipped": "--no-smoke" if not smoke else "no model"}
    return report


def model_sampling(path: Path) -> dict[str, Any]:
    """What a request that leaves sampling to the server gets from this model without --temp and friends: its GGUF's
    general.sampling.* values, else llama-server's (router/sampling_defaults.py)."""
    try:
        vocab = Vocab.load(path)
    except VocabError as exc:
        return {"error": str(exc)}
    try:
        got = sampling_defaults.resolve({}, {}, vocab.meta)
    finally:
        vocab.close()
    return {"values": got.values, "sources": got.sources, "not_applied": got.not_applied}


def llama_build() -> dict[str, Any]:
    import llama_cpp

    wanted = build.this_machine()
    recorded = build.installed_key(Path(sys.prefix))
    info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "system_info": info,
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),
        "devices": [asdict(d) for d in llama_devices()],
        "amx_compiled_in": "AMX" in info,
        "installed_build_key": recorded,
        "wanted_build_key": wanted.key,
        "build_matches": recorded == wanted.key,
        "wanted_flags": wanted.env(),
    }


def cpu() -> dict[str, Any]:
    flags = set(build.cpu_flags())
    model = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.partition(":")[2].strip() for line in lines if line.startswith("model name")), "")
    amx = sorted(f for f in flags if f.startswith("amx"))
    return {
        "model": model or platform.processor(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "avx2": "avx2" in flags,
        "avx512": sorted(f for f in flags if f.startswith("avx512")),
        "amx": amx,
        "amx_permitted": amx_permitted() if amx else None,
        "flags": sorted(flags),
    }


def amx_permitted() -> bool | None:
    """Whether the kernel lets a process use AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM), asked in a child process."""
    code = (
        "import ctypes,sys; libc=ctypes.CDLL(None, use_errno=True);"
        f"sys.exit(0 if libc.syscall({SYS_ARCH_PRCTL}, {ARCH_REQ_XCOMP_PERM}, {XFEATURE_XTILEDATA}) == 0 else 1)"
    )
    try:
        return subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None


def gpus() -> dict[str, Any]:
    seen: dict[str, Any] = {
        "nvidia_devices": sorted(glob.glob("/dev/nvidia[0-9]*")),
        "amd_kfd": os.path.exists("/dev/kfd"),
        "render_nodes": sorted(glob.glob("/dev/dri/renderD*")),
    }
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            seen["nvidia_smi"] = out.stdout.strip().splitlines() or out.stderr.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            seen["nvidia_smi"] = f"failed: {exc}"
    return seen


def memory() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                out[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def smoke_test(model: str, threads: int, gpu: int | None = None) -> dict[str, Any]:
    """The model loaded and a few tokens decoded in a child process, as a worker's start does."""
    cmd = [sys.executable, "-m", "worker.startcheck", model, str(threads), *([] if gpu is None else [str(gpu)])]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"no answer in {SMOKE_TIMEOUT_S:g} s"}
    if out.returncode == 0:
        try:
            return dict(json.loads(out.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            return {"ok": False, "error": f"unreadable answer: {out.stdout[-300:]!r}"}
    if out.returncode < 0:
        name = signal.Signals(-out.returncode).name
        what = f"llama.cpp crashed (signal {-out.returncode}, {name}) {STAGES['first_decode']} or while loading the model"
        return {"ok": False, "error": f"{what} on this CPU. What to try: {ADVICE}", "stderr": out.stderr[-2000:]}
    return {"ok": False, "error": f"exit status {out.returncode}", "stderr": out.stderr[-2000:]}


def sampling_line(sampling: dict[str, Any]) -> str:
    """`temperature=0.6 (gguf), top_k=40 (llama-server), ...; not run: general.sampling.xtc_probability=0.1`."""
    if "error" in sampling:
        return f"not read: {sampling['error']}"
    line = ", ".join(f"{k}={v} ({sampling['sources'][k]})" for k, v in sampling["values"].items())
    line += " for requests that set none (--temp and friends override)"
    if sampling["not_applied"]:
        line += "; not run: " + ", ".join(f"{k}={v}" for k, v in sampling["not_applied"].items())
    return line


def render(r: dict[str, Any]) -> str:
    ll, c, g, m, s = r["llama"], r["cpu"], r["gpus"], r["model"], r["smoke"]
    mem = r["memory"]
    amx = ", ".join(c["amx"]) or "none"
    if c["amx"]:
        amx += f"; kernel permits: {c['amx_permitted']}"
    amx += f"; compiled into this llama.cpp: {'yes' if ll['amx_compiled_in'] else 'no'}"
    gpu_list = g.get("nvidia_smi") or g["nvidia_devices"] or g["render_nodes"] or "none"
    lines = [
        f"kvroute          {r['kvroute']}",
        f"python           {r['python']}",
        f"platform         {r['platform']}",
        f"llama-cpp-python {ll['llama_cpp_python']}",
        f"llama.cpp        {ll['system_info']}",
        f"build            installed key {ll['installed_build_key'] or 'none recorded'}, wanted {ll['wanted_build_key']}"
        f" ({'matches' if ll['build_matches'] else 'differs: ./scripts/setup reinstalls it'})",
        f"build flags      {json.dumps(ll['wanted_flags'])}",
        f"cpu              {c['model']} ({c['machine']}, {c['cores']} cores)",
        f"avx2 / avx-512   {c['avx2']} / {', '.join(c['avx512']) or 'none'}",
        f"amx              {amx}",
        f"gpus             {gpu_list}; this build can offload: {ll['gpu_offload']}",
        *(
            f"llama.cpp device {d['name']}: {d['description']}, {d['free'] / 2**30:.1f} GiB free of {d['total'] / 2**30:.1f}"
            for d in ll["devices"]
        ),
        f"memory           {mem.get('MemAvailable', 0) / 2**30:.1f} GiB available of {mem.get('MemTotal', 0) / 2**30:.1f} GiB",
        f"model            {m.get('path', m.get('error'))}" + (f"  sha256 {m['sha256']}" if "sha256" in m else ""),
    ]
    if sampling := m.get("sampling"):
        lines.append(f"sampling         {sampling_line(sampling)}")
    if s.get("ok"):
        lines.append(
            f"smoke test       ok on {s.get('device', 'cpu')}: loaded in {s['load_s']} s, 4 tokens decoded in {s['decode_ms']} ms"
        )
    elif "skipped" in s:
        lines.append(f"smoke test       skipped ({s['skipped']})")
    else:
        lines.append(f"smoke test       FAILED: {s['error']}")
    return "\n".join(lines)
