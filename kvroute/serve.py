"""`kvroute serve`: the router and N supervised local workers in one command.

One worker per GPU given with --gpus, else --cpu-workers workers on CPU (threads shared between
them). The router and the supervisor run in one asyncio loop; workers are child processes
(`kvroute worker`), restarted with backoff when they exit.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from kvroute import logs
from kvroute.config import add_args, from_args, opt
from router.config import RouterConfig
from router.server import Router
from router.supervisor import Supervisor, SupervisorConfig, WorkerSpec


@dataclass(frozen=True)
class LocalWorkers:
    gpus: str | None = opt(None, "comma-separated GPU indices: one worker per GPU (default: CPU workers)", metavar="0,1")
    cpu_workers: int = opt(1, "number of CPU workers when no --gpus are given")
    slots: int = opt(4, "slots per worker")
    ctx_per_slot: int = opt(4096, "context length of each slot, in tokens")
    threads: int = opt(0, "CPU threads per worker; 0 = the CPU count divided among the CPU workers")
    n_batch: int = opt(512, "most prompt tokens computed in one engine step")
    deterministic: bool = opt(
        False, "bit-identical greedy output cached vs cold (workers run without weight repacking and flash attention)"
    )

    def __post_init__(self) -> None:
        if self.cpu_workers < 0 or self.slots < 1 or self.ctx_per_slot < 16 or self.threads < 0:
            raise ValueError("cpu_workers, slots, ctx_per_slot and threads must be positive")

    def gpu_list(self) -> list[int]:
        try:
            return [int(x) for x in (self.gpus or "").split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--gpus takes comma-separated integers, got {self.gpus!r}") from None


def worker_specs(local: LocalWorkers, model: str) -> list[WorkerSpec]:
    common = [
        "--model",
        model,
        "--slots",
        str(local.slots),
        "--ctx-per-slot",
        str(local.ctx_per_slot),
        "--n-batch",
        str(local.n_batch),
    ]
    if local.deterministic:
        common.append("--deterministic")
    gpus = local.gpu_list()
    if gpus:
        threads = local.threads or 2
        return [WorkerSpec(f"gpu{g}", (*common, "--gpu", str(g), "--threads", str(threads))) for g in gpus]
    n = local.cpu_workers
    threads = local.threads or max(1, (os.cpu_count() or 1) // max(1, n))
    return [WorkerSpec(f"cpu{i}", (*common, "--threads", str(threads))) for i in range(n)]


def connect_endpoint(bound: str) -> str:
    """Where local workers connect for a bound endpoint (a wildcard bind is reached on loopback)."""
    return bound.replace("://0.0.0.0:", "://127.0.0.1:").replace("://*:", "://127.0.0.1:")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_args(parser, RouterConfig)
    add_args(parser, LocalWorkers)
    add_args(parser, SupervisorConfig)


async def serve(
    router_cfg: RouterConfig,
    local: LocalWorkers,
    sup_cfg: SupervisorConfig,
    *,
    signals: bool = True,
    started: Callable[[Router, Supervisor], None] | None = None,
) -> None:
    """Run the router and its supervised workers until the router stops (SIGINT/SIGTERM).
    `started(router, supervisor)` is called once both exist (tests and benchmarks hold on to them)."""
    from kvroute.model import resolve_model
    from router.main import load_router

    model = str(resolve_model(router_cfg.model))
    router = load_router(dataclasses.replace(router_cfg, model=model))
    sup = Supervisor(router, worker_specs(local, model), sup_cfg, connect_endpoint(router_cfg.worker_endpoint))
    if signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, router.stop)
    sup.start()
    if started is not None:
        started(router, sup)
    try:
        await router.run()
    finally:
        await sup.stop()


def run(args: argparse.Namespace) -> int:
    from kvroute.cli import UsageError
    from router.main import run_loop

    logs.setup(process="serve")
    try:
        router_cfg = from_args(RouterConfig, args)
        local = from_args(LocalWorkers, args)
        local.gpu_list()
        sup_cfg = from_args(SupervisorConfig, args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    run_loop(serve(router_cfg, local, sup_cfg))
    return 0
