"""`kvroute router`: the router process alone; workers and clients connect to its two endpoints.

Signals: SIGTERM/SIGINT drain (new requests get `draining`, accepted ones finish within --drain-timeout-s,
then get an error; a second signal cuts the wait short), then exit 0. SIGHUP reloads nothing and logs so.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal

import zmq

from common import logs
from common.config import add_args, from_args
from common.model import resolve_model
from router.config import RouterConfig
from router.models import ServedModel, from_flag, model_name
from router.security import Security
from router.server import Router


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_args(parser, RouterConfig, skip=("model",))
    add_model_argument(
        parser,
        "GGUF model whose vocabulary the router tokenizes with (default: bundled Gemma 3 270M); NAME=PATH, repeated: "
        "several models, each served by the workers that say its NAME (`kvroute worker --model-name NAME`)",
    )
    parser.add_argument(
        "--default-model", metavar="NAME", help="with several models: the one requests naming an unknown model go to"
    )


def add_model_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """`--model [NAME=]PATH`, repeatable (`kvroute router` and `kvroute serve`)."""
    parser.add_argument("--model", action="append", metavar="[NAME=]PATH", help=help)


def model_values(args: argparse.Namespace) -> list[str]:
    """The `--model` values given (a config file's `model = "..."` is one)."""
    return [args.model] if isinstance(args.model, str) else list(args.model or [])


def models_given(args: argparse.Namespace) -> list[ServedModel] | None:
    """`--model` repeated or named: the models to serve; None: one model, `cfg.model` (a config file's `model`)."""
    given = model_values(args)
    if len(given) <= 1 and not any("=" in g for g in given):
        return None
    return [from_flag(g) for g in given]


def load_router(
    cfg: RouterConfig,
    served: list[ServedModel] | None = None,
    *,
    default_model: str | None = None,
    models_max: int = 0,
    memory_mb: float = 0,
) -> Router:
    """Load the vocabularies and bind both sockets; user errors raise common.config.UsageError. `served`: the models
    (several: one core each, router/models.py); None: `cfg.model` alone, named by its file."""
    from common.config import UsageError
    from common.vocab import Vocab, VocabError

    check_keys(cfg)
    models: list[tuple[ServedModel, Vocab]] = []
    for spec in served or [ServedModel(name="", path=cfg.model or "")]:
        path = resolve_model(spec.path or None)
        try:
            vocab = Vocab.load(path)
        except VocabError as exc:
            raise UsageError(f"model {spec.name}: {exc}" if spec.name else str(exc)) from None
        models.append((dataclasses.replace(spec, name=spec.name or model_name(vocab), path=str(path)), vocab))
    try:
        (first, vocab), *more = models
        router = Router(
            cfg, vocab, served=first, more=more, default_model=default_model, models_max=models_max, memory_mb=memory_mb
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        router.bind()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    except zmq.ZMQError as exc:
        raise UsageError(f"cannot bind {cfg.client_endpoint} / {cfg.worker_endpoint}: {exc}") from None
    return router


def check_keys(cfg: RouterConfig) -> None:
    """A key setup `bind` would refuse, refused before anything loads (a vocabulary takes a second or more)."""
    from common.config import UsageError

    try:
        Security.from_config(cfg)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def handle_signals(router: Router) -> None:
    """SIGTERM/SIGINT: graceful stop; SIGHUP: logged, nothing reloaded."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, router.shutdown)
    loop.add_signal_handler(signal.SIGHUP, router.hangup)


async def serve_router(router: Router) -> None:
    handle_signals(router)
    await router.run()


def run_loop(coro: object) -> None:
    try:
        import uvloop

        uvloop.run(coro)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(coro)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    logs.setup(process="router")
    from common.config import UsageError

    try:
        served = models_given(args)
        given = model_values(args)
        cfg = from_args(RouterConfig, args, model=None if served or not given else given[0])
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    router = load_router(cfg, served, default_model=getattr(args, "default_model", None))
    run_loop(serve_router(router))
    router.ctx.destroy(linger=1000)  # the last replies (drain errors) leave before the process does
    return 0
