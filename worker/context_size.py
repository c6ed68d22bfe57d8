"""The slot context a worker takes with `--ctx-per-slot 0` (auto), as llama-server's `-c 0` does: the context the
model was trained for, capped so that every slot's KV cache fits a memory budget (`--kv-budget-mb`; auto: a
quarter of the machine's RAM on CPU, three quarters of the GPU's free memory once the weights are loaded).

`auto_ctx_per_slot` is the rule (pure); the rest reads the machine.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path

import llama_cpp

ROUND = 256  # an auto size is a multiple of this (llama.cpp allocates KV cells in blocks of 256)
AUTO_FLOOR = 256  # the least auto gives, whatever the budget: a smaller slot would refuse almost every prompt
UNKNOWN_TRAIN = 4096  # for a model whose GGUF does not say what it was trained for
RAM_SHARE = 4  # auto budget on CPU: RAM / 4, for all CPU workers of one `serve` together (the rest: weights, host cache)
HOST_TIER_MAX_MB = 8192  # the auto host-RAM tier is RAM / 4 as well, at most this (llama-server's --cache-ram default)
GPU_SHARE = 0.75  # auto budget on a GPU: of its free memory after the weights (the rest: compute buffers)
GGML_GPU_TYPES = (1, 2)  # ggml_backend_dev_type: GPU, then integrated GPU (the devices llama.cpp numbers for main_gpu)


@dataclass(frozen=True)
class CtxChoice:
    ctx: int  # tokens per slot
    reason: str  # "trained length", "kv budget", "unknown trained length" or "--ctx-per-slot"
    budget_bytes: int = 0  # the budget auto was given (0: none, the length was asked for)


def auto_ctx_per_slot(n_ctx_train: int, slots: int, bytes_per_token: float, budget_bytes: int) -> CtxChoice:
    """The trained length, unless `slots` slots of it take more than `budget_bytes` of KV: then the longest
    multiple of ROUND that fits (AUTO_FLOOR at least). A model whose state does not grow with its length
    (recurrent: 0 bytes per token) always gets its trained length."""
    trained = n_ctx_train if n_ctx_train > 0 else UNKNOWN_TRAIN
    why = "trained length" if n_ctx_train > 0 else "unknown trained length"
    if bytes_per_token <= 0:
        return CtxChoice(trained, why, budget_bytes)
    fits = int(budget_bytes // (slots * bytes_per_token)) // ROUND * ROUND
    if fits >= trained:
        return CtxChoice(trained, why, budget_bytes)
    return CtxChoice(max(fits, AUTO_FLOOR), "kv budget", budget_bytes)


# llama.cpp's default pattern of sliding-window layers where a GGUF does not say it (`load_swa_pattern` in its models/):
# every Nth layer attends to everything, the others to their window
SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "gemma-embedding": 6, "cohere2": 4, "gpt-oss": 2, "llama4": 4,
                "exaone4": 4, "olmo2": 4, "mellum": 4, "plamo3": 8}  # fmt: skip


def swa_layers(arch: str, n_layer: int, pattern: int | None) -> int | None:
    """How many of `n_layer` layers have a sliding window: by the GGUF's `sliding_window_pattern` (every Nth layer
    dense), else llama.cpp's default for `arch`; None when unknown."""
    n = pattern if pattern is not None else SWA_PATTERNS.get(arch)
    if n is None:
        return None
    return n_layer if n == 0 else sum(1 for il in range(n_layer) if il % n < n - 1)


@dataclass(frozen=True)
class SwaChoice:
    full: bool  # sliding-window layers keep every position (llama.cpp's swa_full)
    reason: str


def choose_swa_full(
    asked: str, n_swa: int, swa_share: float | None, ctx: int, slots: int, per_token: float, budget_bytes: int
) -> SwaChoice:
    """Whether the window layers keep every position (`on`: any prefix can be cut back to, at a global layer's memory
    per token) or only their window (`off`: reuse through context checkpoints, worker/checkpoints.py). `auto`: on while
    `slots` slots of `ctx` tokens at `per_token` bytes (every layer at full length) fit `budget_bytes`, else off (when
    that saves memory: `swa_share`, the share of the per-token bytes in window layers, is known)."""
    if n_swa <= 0:
        return SwaChoice(True, "no sliding window")
    if asked != "auto":
        return SwaChoice(asked == "on", "--swa-full")
    need = slots * ctx * per_token
    if not swa_share:
        return SwaChoice(True, "the window layers' share of the KV is unknown")
    sizes = f"{need / 2**20:.0f} MiB for {slots} x {ctx} tokens, KV budget {budget_bytes >> 20} MiB"
    if need <= budget_bytes:
        return SwaChoice(True, f"a full-size window cache fits ({sizes})")
    return SwaChoice(False, f"a full-size window cache does not fit ({sizes})")


def ram_bytes() -> int:
    """The machine's RAM, or this process's cgroup (v2) memory limit when that is less (containers, systemd's MemoryMax=)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = _cgroup_limit()
    return min(total, limit) if limit else total


def _cgroup_limit() -> int | None:
    try:
        line = next(x for x in Path("/proc/self/cgroup").read_text().splitlines() if x.startswith("0::"))
        value = (Path("/sys/fs/cgroup") / line[3:].lstrip("/") / "memory.max").read_text().strip()
    except (OSError, StopIteration):
        return None
    return int(value) if value.isdigit() else None  # "max": no limit


def host_tier_mb(workers: int = 1) -> int:
    """Auto host-RAM tier (`--host-cache-mb`) of each of `workers` workers sharing this machine: a quarter of its RAM
    (another quarter is the CPU workers' KV budget), at most llama-server's `--cache-ram` default."""
    return min(HOST_TIER_MAX_MB, ram_bytes() // RAM_SHARE // max(1, workers) >> 20)


def cpu_budget_bytes(workers: int = 1) -> int:
    """Auto budget of each of `workers` CPU workers sharing this machine."""
    return ram_bytes() // RAM_SHARE // max(1, workers)


def llama_lib_dir() -> Path:
    """Where llama-cpp-python loads llama.cpp from: its package's lib/, or $LLAMA_CPP_LIB_PATH (a build of one's own,
    a CUDA build say, beside a package installed without one)."""
    return Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(llama_cpp.__file__).parent / "lib")


@dataclass(frozen=True)
class Device:
    """One of llama.cpp's devices (ggml's backend devices), as `kvroute doctor` shows them."""

    name: str  # CPU, CUDA0, ...
    description: str  # the card's or CPU's name
    kind: int  # ggml_backend_dev_type: 0 CPU, 1 GPU, 2 integrated GPU, 3 accelerator
    free: int  # bytes
    total: int


def llama_devices() -> list[Device]:
    """Every device this llama.cpp build can use, in ggml's order ([] if the library cannot be read)."""
    try:
        lib = ctypes.CDLL(str(llama_lib_dir() / "libggml.so"))
    except OSError:
        return []
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    for text in (lib.ggml_backend_dev_name, lib.ggml_backend_dev_description):
        text.restype = ctypes.c_char_p
        text.argtypes = [ctypes.c_void_p]
    size_p = ctypes.POINTER(ctypes.c_size_t)
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, size_p, size_p]
    found = []
    for i in range(lib.ggml_backend_dev_count()):
        d = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(d, ctypes.byref(free), ctypes.byref(total))
        name = (lib.ggml_backend_dev_name(d) or b"").decode(errors="replace")
        description = (lib.ggml_backend_dev_description(d) or b"").decode(errors="replace")
        found.append(Device(name, description, lib.ggml_backend_dev_type(d), int(free.value), int(total.value)))
    return found


def llama_gpus() -> list[Device]:
    """The devices `--gpu I` numbers (llama.cpp takes integrated GPUs only when there is no other)."""
    devices = llama_devices()
    for kind in GGML_GPU_TYPES:
        if gpus := [d for d in devices if d.kind == kind]:
            return gpus
    return []


def gpu_free_bytes(gpu: int) -> int | None:
    """Free memory of GPU `gpu` as llama.cpp numbers them (ggml's GPU devices in order), or None if unknown."""
    gpus = llama_gpus()
    return gpus[gpu].free if gpu < len(gpus) else None


def default_budget_bytes(gpu: int | None) -> int:
    """The auto `--kv-budget-mb` of one worker (in bytes): on a GPU, GPU_SHARE of its free memory; on CPU (or a GPU
    whose memory cannot be read), RAM / RAM_SHARE."""
    free = gpu_free_bytes(gpu) if gpu is not None else None
    return int(free * GPU_SHARE) if free is not None else cpu_budget_bytes()
