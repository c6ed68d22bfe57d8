"""`kvroute serve`: the router, N supervised local workers and the HTTP API in one command.

One worker per GPU given with --gpus, else --cpu-workers workers on CPU (threads shared between
them). The router, the supervisor and the OpenAI-compatible HTTP API (`--http`, 'off' for none) run
in one asyncio loop; workers are child processes (`kvroute worker`), restarted with backoff.

SIGTERM/SIGINT drain the router (see router.server: accepted requests finish or get an error), then the
workers are stopped; SIGHUP is logged and changes nothing. With CURVE on (--curve-key), the local workers
and the HTTP API use the router's own key pair, which the router always lets in.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq.asyncio

from gateway.main import HttpConfig, parse_host_port, serve_http
from kvroute import logs
from kvroute.config import add_args, from_args, opt, to_flags
from router.config import RouterConfig
from router.server import Router
from router.supervisor import Supervisor, SupervisorConfig, WorkerSpec
from worker.config import WorkerConfig, cache_type_opt, flash_attn_opt, spec_max_opt, spec_ngram_opt, spec_opt


@dataclass(frozen=True)
class LocalWorkers:
    gpus: str | None = opt(None, "comma-separated GPU indices: one worker per GPU (default: CPU workers)", metavar="0,1")
    cpu_workers: int = opt(
        1,
        "number of CPU workers when no --gpus are given (0: none, workers join from elsewhere)",
        flag="--workers",
        aliases=("--cpu-workers",),
    )
    slots: int = opt(4, "slots per worker")
    ctx_per_slot: int = opt(4096, "context length of each slot, in tokens")
    threads: int = opt(0, "CPU threads per worker; 0 = the CPU count divided among the CPU workers")
    n_batch: int = opt(512, "most prompt tokens computed in one engine step")
    host_cache_mb: int = opt(2048, "host RAM per worker for evicted slot contents, restored when they are wanted again")
    deterministic: bool = opt(
        False, "bit-identical output cached vs cold and batched vs alone (workers pad small batches, no flash attention)"
    )
    spec: str = spec_opt()
    spec_max: int = spec_max_opt()
    spec_ngram: int = spec_ngram_opt()
    cache_type_k: str = cache_type_opt("keys")
    cache_type_v: str = cache_type_opt("values")
    flash_attn: str = flash_attn_opt()

    def __post_init__(self) -> None:
        if self.cpu_workers < 0 or self.slots < 1 or self.ctx_per_slot < 16 or self.threads < 0 or self.host_cache_mb < 0:
            raise ValueError("cpu_workers, slots, ctx_per_slot, threads and host_cache_mb must be positive")

    def gpu_list(self) -> list[int]:
        try:
            return [int(x) for x in (self.gpus or "").split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--gpus takes comma-separated integers, got {self.gpus!r}") from None

    def worker_config(self, model: str | None) -> WorkerConfig:
        """What every local worker shares (its checks raise ValueError naming the flag)."""
        return WorkerConfig(
            model=model,
            slots=self.slots,
            ctx_per_slot=self.ctx_per_slot,
            n_batch=self.n_batch,
            host_cache_mb=self.host_cache_mb,
            deterministic=self.deterministic,
            spec=self.spec,
            spec_max=self.spec_max,
            spec_ngram=self.spec_ngram,
            cache_type_k=self.cache_type_k,
            cache_type_v=self.cache_type_v,
            flash_attn=self.flash_attn,
        )


def worker_specs(local: LocalWorkers, model: str) -> list[WorkerSpec]:
    """Each local worker's flags, written from its WorkerConfig (id, incarnation and endpoint are the supervisor's)."""
    base = local.worker_config(model)
    own = ("worker_id", "incarnation", "connect", "curve_key", "router_key")

    def flags(**fields: Any) -> tuple[str, ...]:
        return tuple(to_flags(dataclasses.replace(base, **fields), skip=own))

    gpus = local.gpu_list()
    if gpus:
        return [WorkerSpec(f"gpu{g}", flags(gpu=g, threads=local.threads or 2)) for g in gpus]
    n = local.cpu_workers
    threads = local.threads or max(1, (os.cpu_count() or 1) // max(1, n))
    return [WorkerSpec(f"cpu{i}", flags(threads=threads)) for i in range(n)]


def connect_endpoint(bound: str) -> str:
    """Where local workers connect for a bound endpoint (a wildcard bind is reached on loopback)."""
    return bound.replace("://0.0.0.0:", "://127.0.0.1:").replace("://*:", "://127.0.0.1:")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_args(parser, RouterConfig)
    add_args(parser, LocalWorkers)
    add_args(parser, SupervisorConfig)
    add_args(parser, HttpConfig, skip=("router", "model_name", "curve_key", "router_key", "max_frame_bytes"))


def http_config(args: argparse.Namespace, router_cfg: RouterConfig) -> HttpConfig | None:
    """The HTTP API in front of this router (None with --http off); `serve` names the model once it is resolved."""
    if args.http == "off":
        return None
    parse_host_port(args.http)
    keys = router_cfg.curve_key if router_cfg.client_keys else None
    return HttpConfig(
        http=args.http,
        router=connect_endpoint(router_cfg.client_endpoint),
        api_key=args.api_key,
        curve_key=keys,
        router_key=keys,
        max_body_bytes=args.max_body_bytes,
        max_frame_bytes=router_cfg.max_frame_bytes,
        stream_stall_s=args.stream_stall_s,
    )


async def serve(
    router_cfg: RouterConfig,
    local: LocalWorkers,
    sup_cfg: SupervisorConfig,
    *,
    signals: bool = True,
    started: Callable[[Router, Supervisor], None] | None = None,
    http: HttpConfig | None = None,
) -> None:
    """Run the router and its supervised workers until the router stops (SIGINT/SIGTERM).
    `started(router, supervisor)` is called once both exist (tests and benchmarks hold on to them)."""
    from kvroute.model import resolve_model
    from router.main import handle_signals, load_router

    model = str(resolve_model(router_cfg.model))
    router = load_router(dataclasses.replace(router_cfg, model=model))
    specs = worker_specs(local, model)
    if router_cfg.worker_keys and router_cfg.curve_key:  # local workers hold the router's own key
        keys = ("--curve-key", router_cfg.curve_key, "--router-key", router_cfg.curve_key)
        specs = [dataclasses.replace(s, flags=(*s.flags, *keys)) for s in specs]
    sup = Supervisor(router, specs, sup_cfg, connect_endpoint(router_cfg.worker_endpoint))
    if signals:
        handle_signals(router)
    sup.start()
    if started is not None:
        started(router, sup)
    http_task = None
    if http is not None:
        http = dataclasses.replace(http, model_name=Path(model).stem)
        http_task = asyncio.ensure_future(serve_http(http))
    _say_where(router_cfg, http, model)
    try:
        await router.run()
    finally:
        if http_task is not None:
            http_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await http_task
        await sup.stop()


def _say_where(router_cfg: RouterConfig, http: HttpConfig | None, model: str) -> None:
    """One short block on stdout saying what is served where (logs go to stderr)."""
    lines = [f"kvroute serving {Path(model).name}"]
    if http is not None:
        host, port = parse_host_port(http.http)
        lines.append(f"  OpenAI API  http://{host}:{port}/v1   (health: /health, metrics: /metrics)")
    lines.append(f"  ZMQ clients {router_cfg.client_endpoint}   (kvroute status / complete / chat --connect ...)")
    lines.append(f"  workers     {router_cfg.worker_endpoint}")
    print("\n".join(lines), flush=True)


def run(args: argparse.Namespace) -> int:
    from kvroute.config import UsageError
    from router.main import run_loop

    logs.setup(process="serve")
    try:
        router_cfg = from_args(RouterConfig, args)
        local = from_args(LocalWorkers, args)
        local.gpu_list()
        local.worker_config(None)  # a bad worker flag stops start-up here, before any process starts
        sup_cfg = from_args(SupervisorConfig, args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        http = http_config(args, router_cfg)
    except ValueError as exc:
        raise UsageError(f"--http: {exc}") from None
    run_loop(serve(router_cfg, local, sup_cfg, http=http))
    zmq.asyncio.Context.instance().destroy(linger=1000)  # the last replies leave before the process does
    return 0
