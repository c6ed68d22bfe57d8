"""Worker configuration: one frozen dataclass; the CLI flags are generated from it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from common.config import opt

KV_TYPES = ("f16", "q8_0", "q4_0")  # --cache-type-k/-v: f16 as llama.cpp's default, or quantized (less memory)
FLASH_ATTN = ("auto", "on", "off")
SPEC = ("auto", "ngram", "none")
SWA_FULL = ("auto", "on", "off")


# The fields below are the worker's and `kvroute serve`'s (which hands them on to its workers): one definition each.


def spec_opt() -> Any:
    return opt(
        "auto",
        "speculative decoding: ngram = verify guesses taken from the conversation itself (prompt lookup) in the "
        "same batch (the same tokens, bit for bit with --deterministic; without it a request with a seed takes no "
        "guesses); auto = ngram unless --snapshots, or a recurrent or hybrid model whose state llama.cpp cannot take back "
        "(it can for qwen35, nemotron_h, lfm2: 4 guesses a step there); "
        "none = off",
        choices=list(SPEC),
    )


def spec_max_opt() -> Any:
    return opt(16, "most guessed tokens verified per slot and step (--spec ngram)")


def spec_ngram_opt() -> Any:
    return opt(4, "tokens that must match an earlier place in the conversation before guessing (--spec ngram)")


def ctx_checkpoints_opt() -> Any:
    return opt(
        32,
        "context checkpoints a slot keeps at most, where its memory cannot be cut back to any prefix (recurrent, "
        "hybrid, a window cache of its window alone): saved states a prompt sharing only part of the slot resumes "
        "from (0: none)",
    )


def checkpoint_slot_mb_opt() -> Any:
    return opt(1024, "most MiB of host RAM one slot's context checkpoints take")


def checkpoint_mb_opt() -> Any:
    return opt(4096, "most MiB of host RAM the context checkpoints of all slots of a worker take")


def checkpoint_every_opt() -> Any:
    return opt(8192, "a context checkpoint every this many tokens of a long prompt, besides those near its end (0: none)")


def swa_full_opt() -> Any:
    return opt(
        "auto",
        "sliding-window layers keep every position (on: any prefix can be cut back to, at a global layer's memory "
        "per token) or only their window (off: far less memory, reuse through context checkpoints); auto: on when "
        "the slots fit the KV budget so, else off",
        choices=list(SWA_FULL),
    )


def cache_type_opt(of: str) -> Any:
    need = " (quantized values need flash attention)" if of == "values" else ""
    return opt(
        "f16", f"type of the KV cache's {of}: f16, q8_0 (about half of f16's memory) or q4_0{need}", choices=list(KV_TYPES)
    )


def flash_attn_opt() -> Any:
    return opt("auto", "flash attention: auto (llama.cpp decides; on with quantized values), on or off", choices=list(FLASH_ATTN))


def ctx_per_slot_opt() -> Any:
    return opt(
        0,
        "context length of each slot, in tokens; 0 = auto: the length the model was trained for (32768 for the default "
        "Gemma 3 270M), shortened to fit --kv-budget-mb. A length beyond the trained one is served, with a warning",
    )


def kv_budget_opt(cpu_share: str) -> Any:
    return opt(
        0,
        "MiB that the KV cache of all slots may take with --ctx-per-slot 0 (auto): the auto length is cut to the "
        "longest multiple of 256 whose slots x tokens x KV bytes per token fit (18 KiB per token for the default model "
        f"with f16 KV). 0 = auto: on CPU a quarter of the RAM{cpu_share}; on a GPU three quarters of its free memory "
        "once the weights are loaded",
    )


def n_gpu_layers_opt(gpu_flag: str) -> Any:
    return opt(
        None,
        f"layers offloaded to the GPU ({gpu_flag}), the others run on CPU: for a model larger than the GPU's memory. "
        f"Default: all of them with {gpu_flag}, none without",
        metavar="N",
    )


GPU_ENV = "KVROUTE_GPU"  # the GPU a worker takes when --gpu is not given (the test suite run on a GPU, say)


def env_gpu() -> int | None:
    value = os.environ.get(GPU_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"${GPU_ENV} must be a GPU index (0, 1, ...), got {value!r}")
    return int(value)


@dataclass(frozen=True)
class WorkerConfig:
    model: str | None = opt(None, "GGUF model file (default: the bundled Gemma 3 270M)", metavar="PATH")
    mmproj: str | None = opt(
        None, "the model's vision projector GGUF (llama-server's --mmproj): images in prompts are encoded with it", metavar="FILE"
    )
    slots: int = opt(4, "number of slots (parallel sequences, llama seq_ids 0..N-1)")
    ctx_per_slot: int = ctx_per_slot_opt()
    kv_budget_mb: int = kv_budget_opt("")
    threads: int = opt(os.cpu_count() or 1, "CPU threads for llama.cpp")
    n_batch: int = opt(512, "most prompt tokens computed in one engine step (chunked prefill)")
    step_target_ms: int = opt(
        1500,
        "while jobs generate, a step computes about this long of prompt work at the measured speed (at most n_batch "
        "tokens), so their next token waits that long, not for a whole chunk; 250 ms at most while a job of higher "
        "priority may come back (0: n_batch tokens always)",
    )
    gpu: int | None = opt(
        None, f"GPU index to pin the model and context to (one GPU); default: ${GPU_ENV}, else CPU", metavar="I"
    )
    n_gpu_layers: int | None = n_gpu_layers_opt("--gpu")
    connect: str = opt(
        "tcp://127.0.0.1:5556",
        "router's worker endpoint to connect to; several, comma-separated: routers side by side over one fleet (this "
        "worker reports to each, and each keeps an exact mirror of its slots)",
    )
    worker_id: str = opt("w0", "this worker's id (its ZMQ identity)")
    model_name: str = opt(
        "", "the router's name for the model this worker serves, when the router serves several (default: found by the GGUF)"
    )
    incarnation: int | None = opt(
        None, "this process start's number (default: the start time in ms, new on every start, systemd's included)"
    )
    deterministic: bool = opt(
        False,
        "bit-identical output cached vs cold and batched vs alone for every request, seeded or not (without it a request "
        "with a seed repeats cached or cold, but not beside other generating jobs); small batches padded, no weight "
        "repacking, no flash attention",
    )
    spec: str = spec_opt()
    spec_max: int = spec_max_opt()
    spec_ngram: int = spec_ngram_opt()
    snapshots: bool = opt(
        False,
        "cut a slot back only to its context checkpoints, as a memory that cannot be trimmed is (automatic for "
        "recurrent and hybrid models): the checkpoint path on any model",
    )
    ctx_checkpoints: int = ctx_checkpoints_opt()
    checkpoint_slot_mb: int = checkpoint_slot_mb_opt()
    checkpoint_mb: int = checkpoint_mb_opt()
    checkpoint_every: int = checkpoint_every_opt()
    swa_full: str = swa_full_opt()
    cache_type_k: str = cache_type_opt("keys")
    cache_type_v: str = cache_type_opt("values")
    flash_attn: str = flash_attn_opt()
    host_cache_mb: int | None = opt(
        None,
        "host RAM for copies of evicted slot contents, restored when their conversation returns (0: off; default: a "
        "quarter of RAM, at most 8192 as llama-server's --cache-ram; `serve` shares it among its workers: set it where "
        "workers started apart share a machine)",
    )
    cache_dir: str | None = opt(
        None,
        "disk tier: a directory of this worker's own for saved states. What host RAM evicts, and on a graceful stop "
        "every slot and host-RAM entry, is written there, and restored after a restart (default: no disk tier)",
        metavar="DIR",
    )
    disk_cache_gb: float = opt(16.0, "most disk space the --cache-dir tier takes (least recently used files go first)")
    drain_timeout_s: float = opt(
        60.0, "on SIGTERM: running jobs get this long to finish; then they are handed back (JobError draining)"
    )
    curve_key: str | None = opt(None, "this worker's CurveZMQ key file (secret; `kvroute keys generate`)", metavar="FILE")
    router_key: str | None = opt(None, "the router's public key file (.pub); with --curve-key: CURVE", metavar="FILE")
    alive_file: str | None = opt(
        None,
        "a file touched every few seconds while the engine is idle or making progress (as systemd's watchdog is "
        "pinged): a liveness probe where there is no systemd, e.g. Kubernetes (deploy/kubernetes)",
        metavar="FILE",
    )
    start_record: str | None = opt(
        None,
        "file recording this worker's starts, so that a llama.cpp crashing at start is seen and not started again "
        "after 3 crashes (default: worker-ID.start.json in $RUNTIME_DIRECTORY, $XDG_RUNTIME_DIR or the temp directory)",
        metavar="FILE",
    )

    @property
    def routers(self) -> list[str]:
        """The router endpoints of `connect` (several: routers side by side)."""
        return [e.strip() for e in self.connect.split(",") if e.strip()]

    def __post_init__(self) -> None:
        if self.gpu is None and (gpu := env_gpu()) is not None:  # (read here: a bad value is a usage error, not a crash)
            object.__setattr__(self, "gpu", gpu)
        routers = self.routers
        if not routers:
            raise ValueError(f"--connect names no router endpoint: {self.connect!r}")
        if len(set(routers)) != len(routers) or len(routers) > 255:
            raise ValueError(f"--connect must name up to 255 different router endpoints, got {self.connect!r}")
        if self.slots < 1 or self.slots > 256:
            raise ValueError(f"slots must be in 1..256, got {self.slots}")
        if self.ctx_per_slot != 0 and self.ctx_per_slot < 16:
            raise ValueError(f"--ctx-per-slot must be 0 (auto) or at least 16, got {self.ctx_per_slot}")
        if self.kv_budget_mb < 0:
            raise ValueError(f"--kv-budget-mb must be at least 0 (0: auto), got {self.kv_budget_mb}")
        if self.n_gpu_layers is not None and self.n_gpu_layers < 0:
            raise ValueError(f"--n-gpu-layers must be at least 0, got {self.n_gpu_layers}")
        if self.n_gpu_layers and self.gpu is None:
            raise ValueError(f"--n-gpu-layers {self.n_gpu_layers} needs --gpu (without it the worker runs on CPU)")
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.step_target_ms < 0:
            raise ValueError(f"--step-target-ms must be 0 or more, got {self.step_target_ms}")
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be at least 1, got {self.n_batch}")
        if self.spec not in SPEC:
            raise ValueError(f"--spec must be auto, ngram or none, got {self.spec!r}")
        if not 1 <= self.spec_max <= self.n_batch:
            raise ValueError(f"--spec-max must be in 1..n_batch ({self.n_batch}), got {self.spec_max}")
        if not 1 <= self.spec_ngram <= 64:
            raise ValueError(f"--spec-ngram must be in 1..64, got {self.spec_ngram}")
        if self.spec == "ngram" and self.snapshots:
            raise ValueError("--spec cannot be used with --snapshots (rejected guesses are removed by trimming KV)")
        if self.ctx_checkpoints < 0 or self.checkpoint_slot_mb < 0 or self.checkpoint_mb < 0 or self.checkpoint_every < 0:
            raise ValueError("--ctx-checkpoints, --checkpoint-slot-mb, --checkpoint-mb and --checkpoint-every must be at least 0")
        if self.swa_full not in SWA_FULL:
            raise ValueError(f"--swa-full must be auto, on or off, got {self.swa_full!r}")
        if self.host_cache_mb is not None and self.host_cache_mb < 0:
            raise ValueError(f"host_cache_mb must be at least 0, got {self.host_cache_mb}")
        if self.disk_cache_gb < 0:
            raise ValueError(f"--disk-cache-gb must be at least 0, got {self.disk_cache_gb}")
        if self.cache_dir is not None and not self.cache_dir.strip():
            raise ValueError("--cache-dir must name a directory")
        for flag, value, allowed in (
            ("--cache-type-k", self.cache_type_k, KV_TYPES),
            ("--cache-type-v", self.cache_type_v, KV_TYPES),
            ("--flash-attn", self.flash_attn, FLASH_ATTN),
        ):
            if value not in allowed:
                raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
        if self.deterministic and self.flash_attn == "on":
            raise ValueError("--flash-attn on cannot be used with --deterministic (its result depends on the batch)")
        if self.cache_type_v != "f16" and (self.flash_attn == "off" or self.deterministic):
            why = "--deterministic turns it off" if self.deterministic else "--flash-attn off"
            raise ValueError(f"--cache-type-v {self.cache_type_v} needs flash attention ({why})")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be at least 0, got {self.drain_timeout_s}")
        if (self.curve_key is None) != (self.router_key is None):
            raise ValueError("--curve-key and --router-key go together (CURVE needs this worker's key and the router's)")
