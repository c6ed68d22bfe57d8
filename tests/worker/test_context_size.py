"""The slot context a worker takes by default (the trained length, capped by the KV budget), and the flags that
size a worker: --ctx-per-slot, --kv-budget-mb, --n-gpu-layers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from commands.serve import LocalWorkers, worker_specs
from protocol import Hello, worker_to_router_decoder
from router.supervisor import WorkerSpec
from worker.config import GPU_ENV, WorkerConfig, env_gpu
from worker.context_size import (
    AUTO_FLOOR,
    HOST_TIER_MAX_MB,
    CtxChoice,
    auto_ctx_per_slot,
    cpu_budget_bytes,
    gpu_free_bytes,
    host_tier_mb,
    llama_devices,
    llama_gpus,
    ram_bytes,
)

MiB = 2**20
GEMMA_TRAIN = 32768  # the default model's gemma3.context_length
GEMMA_KV_PER_TOKEN = 18 * 1 * (256 * 2 + 256 * 2)  # layers x KV heads x (key + value dims) x f16 bytes


def test_the_trained_length_unless_the_slots_would_exceed_the_budget() -> None:
    per_slot = GEMMA_TRAIN * GEMMA_KV_PER_TOKEN  # 576 MiB
    assert auto_ctx_per_slot(GEMMA_TRAIN, 4, GEMMA_KV_PER_TOKEN, 4 * per_slot) == CtxChoice(32768, "trained length", 4 * per_slot)
    capped = auto_ctx_per_slot(GEMMA_TRAIN, 4, GEMMA_KV_PER_TOKEN, 1024 * MiB)
    assert capped.reason == "kv budget" and capped.ctx == 14336  # 1 GiB / (4 x 18 KiB) = 14563, down to a multiple of 256
    assert 4 * capped.ctx * GEMMA_KV_PER_TOKEN <= 1024 * MiB < 4 * (capped.ctx + 256) * GEMMA_KV_PER_TOKEN
    assert auto_ctx_per_slot(GEMMA_TRAIN, 256, GEMMA_KV_PER_TOKEN, MiB).ctx == AUTO_FLOOR  # never less than a usable slot
    assert auto_ctx_per_slot(0, 4, GEMMA_KV_PER_TOKEN, 2**40) == CtxChoice(4096, "unknown trained length", 2**40)
    assert auto_ctx_per_slot(1 << 20, 4, 0, MiB).ctx == 1 << 20  # recurrent: the state does not grow with the length


@pytest.mark.parametrize(
    ("fields", "flag"),
    [({"ctx_per_slot": 8}, "--ctx-per-slot"), ({"ctx_per_slot": -1}, "--ctx-per-slot"), ({"kv_budget_mb": -1}, "--kv-budget-mb"),
     ({"n_gpu_layers": 10}, "--n-gpu-layers 10 needs --gpu"), ({"n_gpu_layers": -2, "gpu": 0}, "--n-gpu-layers"),
     ({"step_target_ms": -1}, "--step-target-ms")],
)  # fmt: skip
def test_impossible_sizes_are_refused_naming_the_flag(fields: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        WorkerConfig(**fields)


def test_serve_hands_gpu_layers_to_gpu_workers_and_splits_the_auto_budget_among_cpu_workers() -> None:
    assert WorkerConfig(n_gpu_layers=0).n_gpu_layers == 0 and WorkerConfig(gpu=1, n_gpu_layers=12).n_gpu_layers == 12
    with pytest.raises(ValueError, match="--n-gpu-layers 8 needs --gpus"):
        LocalWorkers(n_gpu_layers=8)
    (gpu,) = worker_specs(LocalWorkers(gpus="1", n_gpu_layers=12), "/m.gguf")
    assert gpu.flags[gpu.flags.index("--n-gpu-layers") + 1] == "12" and "--gpu" in gpu.flags
    (one,) = worker_specs(LocalWorkers(cpu_workers=1), "/m.gguf")
    assert "--ctx-per-slot" not in one.flags and "--kv-budget-mb" not in one.flags  # auto, the machine's budget
    two = worker_specs(LocalWorkers(cpu_workers=2), "/m.gguf")
    assert all(s.flags[s.flags.index("--kv-budget-mb") + 1] == str(cpu_budget_bytes(2) // MiB) for s in two)
    fixed = worker_specs(LocalWorkers(cpu_workers=2, ctx_per_slot=1024), "/m.gguf")
    assert all("--kv-budget-mb" not in s.flags for s in fixed)


def test_the_host_ram_tier_is_a_quarter_of_ram_shared_by_the_workers_at_most_llama_servers_default() -> None:
    ram_mb = ram_bytes() // MiB
    assert host_tier_mb() == min(HOST_TIER_MAX_MB, ram_mb // 4) and HOST_TIER_MAX_MB == 8192  # (--cache-ram's default)
    assert host_tier_mb(2) == min(HOST_TIER_MAX_MB, ram_mb // 8) and host_tier_mb(0) == host_tier_mb(1)

    def tier(spec: WorkerSpec) -> str:
        return spec.flags[spec.flags.index("--host-cache-mb") + 1]

    assert [tier(s) for s in worker_specs(LocalWorkers(cpu_workers=2), "/m.gguf")] == [str(host_tier_mb(2))] * 2
    assert [tier(s) for s in worker_specs(LocalWorkers(gpus="0,1,2"), "/m.gguf")] == [str(host_tier_mb(3))] * 3
    assert [tier(s) for s in worker_specs(LocalWorkers(cpu_workers=2, host_cache_mb=0), "/m.gguf")] == ["0", "0"]
    assert WorkerConfig().host_cache_mb is None  # (a worker started alone: host_tier_mb(), worker/core.py)
    with pytest.raises(ValueError, match="host_cache_mb"):
        WorkerConfig(host_cache_mb=-1)


@contextmanager
def started_worker(log: Path, *flags: str) -> Iterator[tuple[Hello, list[dict]]]:
    """A real `kvroute worker` (1 slot, no --ctx-per-slot): its hello, and its log lines up to then."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    cmd = [sys.executable, "-m", "commands.cli", "worker", "--connect", f"tcp://127.0.0.1:{port}", "--worker-id", "wd"]
    cmd += ["--slots", "1", "--threads", "1", "--host-cache-mb", "0", *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=dict(os.environ, KVROUTE_LOG_FORMAT="json"), stdout=out, stderr=out)
    try:
        assert sock.poll(120_000), "no hello in 120 s"
        hello = worker_to_router_decoder().decode(sock.recv_multipart()[-1])
        assert isinstance(hello, Hello), hello
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
        yield hello, lines
    finally:
        proc.kill()
        proc.wait()
        sock.close(linger=0)
        ctx.term()


def slot_context_line(lines: list[dict]) -> dict:
    (line,) = [x for x in lines if x.get("event") == "slot_context"]
    return line


@pytest.mark.model
def test_a_worker_without_ctx_per_slot_takes_the_trained_length_within_its_budget(tmp_path: Path) -> None:
    with started_worker(tmp_path / "w.log") as (hello, lines):
        want = auto_ctx_per_slot(GEMMA_TRAIN, 1, GEMMA_KV_PER_TOKEN, cpu_budget_bytes())
        assert hello.ctx_per_slot == want.ctx  # 32768 wherever a quarter of the RAM holds 576 MiB
        line = slot_context_line(lines)
        assert (line["ctx_per_slot"], line["reason"], line["n_ctx_train"]) == (want.ctx, want.reason, GEMMA_TRAIN)
        assert hello.kv_bytes == want.ctx * GEMMA_KV_PER_TOKEN


@pytest.mark.model
def test_the_kv_budget_caps_the_default_length(tmp_path: Path) -> None:
    with started_worker(tmp_path / "w.log", "--kv-budget-mb", "64", "--swa-full", "on") as (hello, lines):
        assert hello.ctx_per_slot == 3584  # 64 MiB / 18 KiB = 3640 tokens, down to a multiple of 256
        line = slot_context_line(lines)
        assert (line["reason"], line["kv_budget_mib"]) == ("kv budget", 64)


@pytest.mark.model
def test_where_a_full_size_window_cache_does_not_fit_auto_takes_the_window_alone_and_says_why(tmp_path: Path) -> None:
    """Gemma 3 270M's 15 window layers of 18 hold 512 positions and a batch (padded to 1,280 cells) instead of the
    slot's length: its 3 global layers' 3 KiB a token fit 15,360 tokens in the 64 MiB where 18 KiB fit 3,584."""
    with started_worker(tmp_path / "w.log", "--kv-budget-mb", "64") as (hello, lines):
        (window,) = [x for x in lines if x.get("event") == "window_cache"]
        assert window["full"] is False and "does not fit" in window["reason"] and window["window"] == 512
        assert hello.ctx_per_slot == 15360 and hello.kv_bytes <= 64 * 2**20
        line = slot_context_line(lines)
        assert (line["reason"], line["kv_budget_mib"]) == ("kv budget", 64)


def test_a_gpu_named_twice_gets_two_workers_with_their_own_ids() -> None:
    specs = worker_specs(LocalWorkers(gpus="0,0,1"), "/m.gguf")
    assert [s.worker_id for s in specs] == ["gpu0", "gpu0.1", "gpu1"]
    assert [s.flags[s.flags.index("--gpu") + 1] for s in specs] == ["0", "0", "1"]


@pytest.mark.parametrize(("value", "gpu"), [("", None), ("1", 1), (" 0 ", 0)])
def test_kvroute_gpu_names_the_default_gpu(monkeypatch: pytest.MonkeyPatch, value: str, gpu: int | None) -> None:
    monkeypatch.setenv(GPU_ENV, value)
    assert env_gpu() == gpu


def test_kvroute_gpu_that_is_not_an_index_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GPU_ENV, "cuda:0")
    with pytest.raises(ValueError, match=r"\$KVROUTE_GPU must be a GPU index"):
        env_gpu()
    with pytest.raises(ValueError, match=r"\$KVROUTE_GPU must be a GPU index"):
        WorkerConfig()  # (when a worker's settings are made, not when the module is imported)
    out = subprocess.run([sys.executable, "-m", "commands.cli", "worker", "--connect", "tcp://127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60, env={**os.environ, GPU_ENV: "cuda:0"})  # fmt: skip
    assert out.returncode != 0 and out.stderr.strip().splitlines() == [
        "kvroute worker: error: $KVROUTE_GPU must be a GPU index (0, 1, ...), got 'cuda:0'"
    ]


def test_kvroute_gpu_is_the_gpu_of_a_worker_that_names_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GPU_ENV, "1")
    assert WorkerConfig().gpu == 1 and WorkerConfig(gpu=0).gpu == 0


def test_llama_devices_are_read_from_the_build_in_use() -> None:
    """This CPU build lists the CPU and no GPU, so `--gpu 0` has no free memory to size by (None, not a crash)."""
    devices = llama_devices()
    assert devices and devices[0].kind == 0 and devices[0].total > 0
    assert llama_gpus() == [] and gpu_free_bytes(0) is None
