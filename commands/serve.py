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
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq.asyncio

from commands.models_config import ModelEntry, from_file, from_flags, seconds, worker_prefix
from common import logs
from common.config import ConfigFileError, UsageError, add_args, from_args, opt, to_flags
from common.files import runtime_dir
from common.keys import generate, read_key
from common.vocab import Vocab
from gateway.server import HttpConfig, parse_host_port, serve_http
from router.config import DEFAULT_CLIENT_ENDPOINT, RouterConfig
from router.main import add_model_argument, model_values
from router.models import ServedModel
from router.server import Router
from router.supervisor import Supervisor, SupervisorConfig, WorkerSpec
from worker.config import (
    WorkerConfig,
    cache_type_opt,
    checkpoint_every_opt,
    checkpoint_mb_opt,
    checkpoint_slot_mb_opt,
    ctx_checkpoints_opt,
    ctx_per_slot_opt,
    flash_attn_opt,
    kv_budget_opt,
    n_gpu_layers_opt,
    spec_max_opt,
    spec_ngram_opt,
    spec_opt,
    swa_full_opt,
)
from worker.context_size import cpu_budget_bytes, host_tier_mb


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
    ctx_per_slot: int = ctx_per_slot_opt()
    kv_budget_mb: int = kv_budget_opt(" (divided among the CPU workers)")
    n_gpu_layers: int | None = n_gpu_layers_opt("--gpus")
    threads: int = opt(0, "CPU threads per worker; 0 = the CPU count divided among the CPU workers")
    n_batch: int = opt(512, "most prompt tokens computed in one engine step")
    step_target_ms: int = opt(
        1500,
        "while jobs generate, a step computes about this long of prompt work at the measured speed (at most --n-batch "
        "tokens), so their next token waits that long, not for a whole chunk; 250 ms at most while a job of higher "
        "priority may come back (0: --n-batch tokens always)",
    )
    host_cache_mb: int | None = opt(
        None,
        "host RAM per worker for evicted slot contents, restored when they are wanted again (0: off; default: a quarter "
        "of RAM shared by the workers, at most 8192 each as llama-server's --cache-ram)",
    )
    cache_dir: str | None = opt(
        None,
        "disk tier: each worker keeps saved states in DIR/<worker id>, survives restarts (default: no disk tier)",
        metavar="DIR",
    )
    disk_cache_gb: float = opt(16.0, "most disk space each worker's --cache-dir tier takes")
    deterministic: bool = opt(
        False, "bit-identical output cached vs cold and batched vs alone (workers pad small batches, no flash attention)"
    )
    spec: str = spec_opt()
    spec_max: int = spec_max_opt()
    spec_ngram: int = spec_ngram_opt()
    cache_type_k: str = cache_type_opt("keys")
    cache_type_v: str = cache_type_opt("values")
    flash_attn: str = flash_attn_opt()
    swa_full: str = swa_full_opt()
    ctx_checkpoints: int = ctx_checkpoints_opt()
    checkpoint_slot_mb: int = checkpoint_slot_mb_opt()
    checkpoint_mb: int = checkpoint_mb_opt()
    checkpoint_every: int = checkpoint_every_opt()

    def __post_init__(self) -> None:
        if self.cpu_workers < 0 or self.slots < 1 or self.threads < 0 or (self.host_cache_mb or 0) < 0:
            raise ValueError("cpu_workers, slots, threads and host_cache_mb must be positive")
        if self.n_gpu_layers is not None and self.n_gpu_layers < 0:
            raise ValueError(f"--n-gpu-layers must be at least 0, got {self.n_gpu_layers}")
        if self.n_gpu_layers and not self.gpus:
            raise ValueError(f"--n-gpu-layers {self.n_gpu_layers} needs --gpus (without it the workers run on CPU)")

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
            kv_budget_mb=self.kv_budget_mb,
            n_batch=self.n_batch,
            step_target_ms=self.step_target_ms,
            host_cache_mb=self.host_cache_mb,
            disk_cache_gb=self.disk_cache_gb,
            deterministic=self.deterministic,
            spec=self.spec,
            spec_max=self.spec_max,
            spec_ngram=self.spec_ngram,
            cache_type_k=self.cache_type_k,
            cache_type_v=self.cache_type_v,
            flash_attn=self.flash_attn,
            swa_full=self.swa_full,
            ctx_checkpoints=self.ctx_checkpoints,
            checkpoint_slot_mb=self.checkpoint_slot_mb,
            checkpoint_mb=self.checkpoint_mb,
            checkpoint_every=self.checkpoint_every,
        )


def worker_specs(local: LocalWorkers, model: str, served_as: str | None = None, mmproj: str | None = None) -> list[WorkerSpec]:
    """Each local worker's flags, written from its WorkerConfig (id, incarnation and endpoint are the supervisor's).
    `served_as`: the router's name of the model, when it serves several (ids start with it: `coder-cpu0`); `mmproj`:
    its vision projector."""
    base = dataclasses.replace(local.worker_config(model), mmproj=mmproj)
    if local.host_cache_mb is None:  # the auto host-RAM tier is the machine's, shared by its workers
        base = dataclasses.replace(base, host_cache_mb=host_tier_mb(len(local.gpu_list()) or local.cpu_workers))
    if served_as is not None:
        base = dataclasses.replace(base, model_name=served_as)
    start = "" if served_as is None else worker_prefix(served_as) + "-"
    own = ("worker_id", "incarnation", "connect", "curve_key", "router_key")

    def flags(**fields: Any) -> tuple[str, ...]:
        return tuple(to_flags(dataclasses.replace(base, **fields), skip=own))

    def own_dir(name: str) -> str | None:  # a disk tier is one worker's: each gets a directory of its own
        return None if local.cache_dir is None else str(Path(local.cache_dir) / name)

    gpus = local.gpu_list()
    if gpus:
        gpu_flags = {"threads": local.threads or 2, "n_gpu_layers": local.n_gpu_layers}
        # a GPU named twice gets two workers (each a share of its memory): gpu0, gpu0.1
        names = [f"{start}gpu{g}" + (f".{gpus[:i].count(g)}" if g in gpus[:i] else "") for i, g in enumerate(gpus)]
        return [
            WorkerSpec(n, flags(gpu=g, cache_dir=own_dir(n), **gpu_flags), served_as) for n, g in zip(names, gpus, strict=True)
        ]
    n = local.cpu_workers
    cpu_flags: dict[str, Any] = {"threads": local.threads or max(1, (os.cpu_count() or 1) // max(1, n))}
    if n > 1 and local.ctx_per_slot == 0 and local.kv_budget_mb == 0:  # the auto budget is the machine's, not each one's
        cpu_flags["kv_budget_mb"] = cpu_budget_bytes(n) >> 20
    return [WorkerSpec(f"{start}cpu{i}", flags(cache_dir=own_dir(f"{start}cpu{i}"), **cpu_flags), served_as) for i in range(n)]


def footprint(spec: ServedModel, vocab: Vocab, local: LocalWorkers) -> ServedModel:
    """`spec` with where its workers run and what one takes (router/models.py's memory budget): the file's size and
    its KV as the worker will size it (`--kv-budget-mb`; else its slots x `--ctx-per-slot`, or x the trained length
    within the CPU's auto budget), unless the operator gave `memory_mb`."""
    gpus = local.gpu_list()
    devices = tuple(f"gpu{g}" for g in gpus) if gpus else ("cpu",) * local.cpu_workers
    weights = Path(spec.path).stat().st_size / 2**20
    if local.kv_budget_mb:
        kv = float(local.kv_budget_mb) / (1 if gpus else max(1, local.cpu_workers))
    else:
        ctx = local.ctx_per_slot or vocab.arch_meta_int("context_length") or 4096
        kv = local.slots * ctx * vocab.kv_bytes_per_token() / 2**20
        if not local.ctx_per_slot and not gpus:
            kv = min(kv, cpu_budget_bytes(local.cpu_workers) / 2**20)
    memory = spec.memory_mb if spec.memory_given else weights + kv
    return dataclasses.replace(spec, devices=devices, weights_mb=weights, memory_mb=memory)


def connect_endpoint(bound: str) -> str:
    """Where local workers connect for a bound endpoint (a wildcard bind is reached on loopback)."""
    return bound.replace("://0.0.0.0:", "://127.0.0.1:").replace("://*:", "://127.0.0.1:")


@dataclass(frozen=True)
class ServeModels:
    """The models besides `--model`: how many are loaded at once, which one unknown names go to, keep-alive."""

    models: str | None = opt(None, "a models file (TOML, one [models.NAME] table each: commands/models_config.py)",
                             metavar="FILE")  # fmt: skip
    models_max: int = opt(0, "most models loaded at once; a request for another unloads the least recently used idle "
                          "one (0: no bound)")  # fmt: skip
    default_model: str | None = opt(None, "the model requests naming an unknown model go to (default: none, they get "
                                    "404, unless one model is served)", metavar="NAME")  # fmt: skip
    keep_alive: str = opt("-1", "how long a model stays loaded unused, as seconds or a duration (5m, 1h); -1: kept "
                          "(a models file's keep_alive and a request's keep_alive win)", metavar="DURATION")  # fmt: skip
    models_memory_mb: int = opt(0, "memory (MiB) the loaded models' workers may take on each device: RAM for the CPU "
                                "workers together, each GPU's own for GPU workers; a model that does not fit beside "
                                "the loaded ones unloads the least recently used idle one there first (0: no bound). "
                                "A worker's need: a models file's memory_mb, else its file and KV estimated, then "
                                "what it said it took")  # fmt: skip


def served_models(args: argparse.Namespace) -> list[ModelEntry] | None:
    """The models `--model` and `--models` name; None for the one model of old (`--model PATH` or the default)."""
    picked = from_args(ServeModels, args)
    keep = seconds(picked.keep_alive, "--keep-alive")
    given = model_values(args)
    entries = from_flags(given, keep)
    if picked.models:
        entries += from_file(picked.models, keep)
    several = picked.models or picked.models_max or picked.models_memory_mb
    if len(entries) <= 1 and "=" not in "".join(given) and not several and keep < 0:
        return None
    if not entries:
        entries = [ModelEntry(ServedModel(name="", path="", keep_alive_s=keep))]
    return entries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_args(parser, RouterConfig, skip=("model",))
    add_model_argument(
        parser,
        "a GGUF model (default: bundled Gemma 3 270M); NAME=PATH, repeated, serves several, each by its NAME in the "
        "API's `model` field",
    )
    add_args(parser, ServeModels)
    add_args(parser, LocalWorkers)
    add_args(parser, SupervisorConfig)
    add_args(parser, HttpConfig, skip=("router", "model_name", "curve_key", "router_key", "max_frame_bytes", "processes"))
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        help="HTTP processes serving --http together (SO_REUSEPORT); 0, the default: as the machine allows (one with "
        "CPU workers, whose llama.cpp takes every core; with GPU workers one per 4 cores the router and the workers "
        "leave, at most 8)",
    )


def auto_http_processes(cores: int, gpus: int) -> int:
    """`serve --processes 0`. CPU workers run llama.cpp on every core, so one process; with GPU workers, one per 4
    cores left after the router's one and 2 per worker (a gateway process streams about 20,000 tokens/s on a core:
    bench/README.md, "The token path"), at most 8."""
    if gpus == 0:
        return 1
    return max(1, min(8, (cores - 1 - 2 * gpus) // 4))


def reply_endpoint_for(given: str, worker_endpoint: str) -> str:
    """`--reply-endpoint auto` picks an address only this host reaches: with workers that may connect from other hosts
    (a worker endpoint bound beyond loopback) the HTTP API takes its replies through the router unless told where."""
    local = worker_endpoint.startswith(("ipc://", "tcp://127.0.0.1:", "tcp://localhost:", "tcp://[::1]:"))
    if given != "auto" or local:
        return given
    logs.get(__name__).info(
        "direct_replies_off",
        worker_endpoint=worker_endpoint,
        reason="workers may connect from other hosts; give --reply-endpoint tcp://THIS_HOST:* to have them stream here",
    )
    return "off"


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
        alias=args.alias,
        strict_model_name=args.strict_model_name,
        strict_api=args.strict_api,
        shared_cache=args.shared_cache,
        tenant_per_key=args.tenant_per_key,
        allowed_hosts=args.allowed_hosts,
        cors_origins=args.cors_origins,
        curve_key=keys,
        router_key=keys,
        max_body_bytes=args.max_body_bytes,
        max_frame_bytes=router_cfg.max_frame_bytes,
        stream_stall_s=args.stream_stall_s,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        max_connections=args.max_connections,
        reply_endpoint=reply_endpoint_for(args.reply_endpoint, router_cfg.worker_endpoint),
        pooling=args.pooling,
        max_image_bytes=args.max_image_bytes,
        max_images=args.max_images,
        max_image_side=args.max_image_side,
        max_image_pixels=args.max_image_pixels,
        image_fetch=args.image_fetch,
        image_fetch_timeout_s=args.image_fetch_timeout_s,
        processes=args.processes or auto_http_processes(os.cpu_count() or 1, len(LocalWorkers(gpus=args.gpus).gpu_list())),
    )


async def serve(
    router_cfg: RouterConfig,
    local: LocalWorkers,
    sup_cfg: SupervisorConfig,
    *,
    signals: bool = True,
    started: Callable[[Router, Supervisor], None] | None = None,
    http: HttpConfig | None = None,
    models: list[ModelEntry] | None = None,
    models_cfg: ServeModels = ServeModels(),
) -> None:
    """Run the router and its supervised workers until the router stops (SIGINT/SIGTERM).
    `started(router, supervisor)` is called once both exist (tests and benchmarks hold on to them).
    `models`: several models (commands/models_config.py), each with its own workers; None: `router_cfg.model`."""
    local_workers = bool(local.gpu_list()) or local.cpu_workers > 0
    router_cfg, keys_dir = worker_keys_for_this_run(router_cfg) if local_workers else (router_cfg, None)
    try:
        await _serve(router_cfg, local, sup_cfg, signals, started, http, models, models_cfg)
    finally:
        if keys_dir is not None:
            shutil.rmtree(keys_dir, ignore_errors=True)


def worker_keys_for_this_run(router_cfg: RouterConfig) -> tuple[RouterConfig, Path | None]:
    """Workers join `serve`'s router only with a key, on loopback too: without --worker-keys, a key pair made for this
    run, in a directory only this user can enter (common/files.py), is the one key the worker socket lets in (the
    local workers are given it); a process of another user cannot read it, so cannot join and receive every tenant's
    prompts. With --curve-key, that key is the one. Returns the directory made (removed at exit), or None. (With
    `--workers 0` workers join from elsewhere: the worker socket is then as `kvroute router`'s, router/security.py.)"""
    if router_cfg.worker_keys:
        return router_cfg, None
    directory = Path(tempfile.mkdtemp(prefix=f"serve-{os.getpid()}-", dir=private_dir()))
    curve_key = router_cfg.curve_key
    if curve_key is None:
        curve_key = str(generate(directory, "router")[0])
    allowed = directory / "workers"
    allowed.mkdir(mode=0o700)
    public = read_key(curve_key, secret=False).decode()
    (allowed / "router.pub").write_text(f"public = {public}\n")
    logs.get(__name__).info("workers_need_a_key", keys=str(directory), reason="only a worker holding it joins")
    return dataclasses.replace(router_cfg, curve_key=curve_key, worker_keys=str(allowed)), directory


async def _serve(
    router_cfg: RouterConfig,
    local: LocalWorkers,
    sup_cfg: SupervisorConfig,
    signals: bool,
    started: Callable[[Router, Supervisor], None] | None,
    http: HttpConfig | None,
    models: list[ModelEntry] | None,
    models_cfg: ServeModels,
) -> None:
    from common.model import resolve_model
    from router.main import check_keys, handle_signals, load_router

    check_keys(router_cfg)  # (before any worker starts)
    early: Supervisor | None = None
    if models is None:
        model = str(resolve_model(router_cfg.model))
        # the workers start loading the model while the router loads its vocabulary (router/supervisor.py `spawn`)
        early = Supervisor(
            None,
            with_keys(worker_specs(local, model, mmproj=router_cfg.mmproj), router_cfg),
            sup_cfg,
            connect_endpoint(router_cfg.worker_endpoint),
        )
        await early.spawn()
        try:
            router = load_router(dataclasses.replace(router_cfg, model=model))
        except BaseException:
            await early.stop()
            raise
        names = [Path(model).stem]
    else:
        defaults = [e.served.name for e in models if e.default]
        router = load_router(
            dataclasses.replace(router_cfg, model=None),
            [e.served for e in models],
            default_model=models_cfg.default_model or (defaults[0] if defaults else None),
            models_max=models_cfg.models_max,
            memory_mb=models_cfg.models_memory_mb,
        )
        several = len(models) > 1
        specs = []
        for entry, m in zip(models, router.models, strict=True):
            try:
                own = dataclasses.replace(local, **entry.workers)
            except (TypeError, ValueError) as exc:
                raise UsageError(f"model {m.name}: {exc}") from None
            specs += worker_specs(own, m.spec.path, m.name if several else None, m.spec.mmproj or router_cfg.mmproj)
            m.spec = footprint(m.spec, m.vocab, own)
        model = router.models.cores[0].spec.path
        names = [name for m in router.models for name in (m.name, *m.spec.aliases)]
    if early is not None:
        sup = early
        sup.attach(router)
    else:
        sup = Supervisor(router, with_keys(specs, router_cfg), sup_cfg, connect_endpoint(router_cfg.worker_endpoint))
    if signals:
        handle_signals(router)
    sup.start()
    if started is not None:
        started(router, sup)
    http_task = None
    if http is not None:
        more = [n for n in [*http.alias.split(","), *names[1:]] if n]
        http = dataclasses.replace(http, model_name=names[0], alias=",".join(dict.fromkeys(more)))
        http_task = asyncio.ensure_future(serve_http_processes(http))
    listed = [f"{m.name} ({Path(m.spec.path).name})" for m in router.models] if models else [Path(model).name]
    _say_where(router_cfg, http, ", ".join(listed))
    try:
        await _run_with_http(router, http_task, http)
    finally:
        if http_task is not None:
            http_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await http_task
        await sup.stop()


async def _run_with_http(router: Router, http_task: asyncio.Future[None] | None, http: HttpConfig | None) -> None:
    """Run the router until it stops; an HTTP API that stops first (its port taken at start-up, or a crash later)
    stops the router too and the command says why: a `serve` whose API is gone must not go on serving in silence."""
    run = asyncio.ensure_future(router.run())
    if http_task is None or http is None:
        await run
        return
    await asyncio.wait([run, http_task], return_when=asyncio.FIRST_COMPLETED)
    if run.done():
        await run
        return
    failure = None if http_task.cancelled() else http_task.exception()
    logs.get(__name__).error("http_stopped", url=http.http, error=str(failure), reason="the router stops with it")
    router.shutdown()
    await run
    if isinstance(failure, OSError):
        raise UsageError(f"cannot serve HTTP on {http.http}: {failure.strerror or failure}") from None
    raise UsageError(f"the HTTP API on {http.http} stopped: {failure or 'it ended'}") from None


def with_keys(specs: list[WorkerSpec], router_cfg: RouterConfig) -> list[WorkerSpec]:
    """Local workers hold the router's own key (when `serve` made or was given one for its workers)."""
    if not (router_cfg.worker_keys and router_cfg.curve_key):
        return specs
    keys = ("--curve-key", router_cfg.curve_key, "--router-key", router_cfg.curve_key)
    return [dataclasses.replace(s, flags=(*s.flags, *keys)) for s in specs]


async def serve_http_processes(http: HttpConfig) -> None:
    """The HTTP API in this loop, and `--processes` - 1 more processes on its port (gateway/processes.py)."""
    from gateway.processes import HttpProcesses

    await HttpProcesses(http, http.processes - 1).beside(lambda ready: serve_http(http, ready=ready, signals=False))


def guard_zmq_clients(router_cfg: RouterConfig, http: HttpConfig | None) -> tuple[RouterConfig, HttpConfig | None]:
    """With an API key on the HTTP API, the ZMQ client socket must not be a way around it. Without CURVE client keys,
    the default TCP endpoint becomes an IPC socket in a directory only this user can enter; an endpoint the user
    chose is kept, with a warning when it is TCP."""
    keyed = http is not None and bool(http.api_key or os.environ.get("KVROUTE_API_KEY"))
    if not keyed or router_cfg.client_keys or http is None:
        return router_cfg, http
    endpoint = router_cfg.client_endpoint
    if endpoint == DEFAULT_CLIENT_ENDPOINT:
        endpoint = f"ipc://{private_dir() / f'clients-{parse_host_port(http.http)[1]}.sock'}"
        logs.get(__name__).info("zmq_clients_private", endpoint=endpoint, reason="the HTTP API has a key")
        return dataclasses.replace(router_cfg, client_endpoint=endpoint), dataclasses.replace(http, router=endpoint)
    if not endpoint.startswith("ipc://"):
        logs.get(__name__).warning(
            "zmq_clients_open",
            endpoint=endpoint,
            reason="the HTTP API has a key but anyone who reaches this ZMQ endpoint is served without one: use "
            "--zmq ipc://PATH or CURVE client keys (--client-keys)",
        )
    return router_cfg, http


def private_dir() -> Path:
    """A directory only this user can enter, for IPC sockets and keys (common/files.py `runtime_dir`)."""
    try:
        return runtime_dir()
    except OSError as exc:
        raise UsageError(f"{exc}: give --zmq ipc://PATH in a directory of yours") from None


def _say_where(router_cfg: RouterConfig, http: HttpConfig | None, served: str) -> None:
    """One short block on stdout saying what is served where (logs go to stderr)."""
    lines = [f"kvroute serving {served}"]
    if http is not None:
        host, port = parse_host_port(http.http)
        lines.append(f"  OpenAI API  http://{host}:{port}/v1   (health: /health, metrics: /metrics)")
    lines.append(f"  ZMQ clients {router_cfg.client_endpoint}   (kvroute status / complete / chat --connect ...)")
    lines.append(f"  workers     {router_cfg.worker_endpoint}")
    print("\n".join(lines), flush=True)


def run(args: argparse.Namespace) -> int:
    from router.main import run_loop

    logs.setup(process="serve")
    try:
        models = served_models(args)
        models_cfg = from_args(ServeModels, args)
        given = model_values(args)
        router_cfg = from_args(RouterConfig, args, model=given[0] if given and models is None else None)
        local = from_args(LocalWorkers, args)
        local.gpu_list()
        local.worker_config(None)  # a bad worker flag stops start-up here, before any process starts
        sup_cfg = from_args(SupervisorConfig, args)
    except (ValueError, ConfigFileError) as exc:
        raise UsageError(str(exc)) from None
    try:
        http = http_config(args, router_cfg)
    except ValueError as exc:  # (each message names its flag)
        raise UsageError(str(exc)) from None
    router_cfg, http = guard_zmq_clients(router_cfg, http)
    run_loop(serve(router_cfg, local, sup_cfg, http=http, models=models, models_cfg=models_cfg))
    zmq.asyncio.Context.instance().destroy(linger=1000)  # the last replies leave before the process does
    return 0
