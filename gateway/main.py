"""`kvroute http`: the OpenAI-compatible HTTP API as its own process (or several: gateway/processes.py), in front of
a running router."""

from __future__ import annotations

import argparse

from common import logs
from common.config import add_args, from_args
from gateway.server import HttpConfig, parse_host_port, serve_http, warn_open_router


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_args(parser, HttpConfig)


def run(args: argparse.Namespace) -> int:
    from common.config import UsageError

    try:
        cfg = from_args(HttpConfig, args)
        parse_host_port(cfg.http)
    except ValueError as exc:  # (each message names its flag)
        raise UsageError(str(exc)) from None
    if (cfg.curve_key is None) != (cfg.router_key is None):
        raise UsageError("--curve-key and --router-key go together")
    logs.setup(process="http")
    warn_open_router(cfg)
    import uvloop

    from gateway.processes import HttpProcesses

    others = HttpProcesses(cfg, cfg.processes - 1)  # (the rest serve beside this one: gateway/processes.py)
    try:
        uvloop.run(others.beside(lambda ready: serve_http(cfg, ready=ready)))  # (it stops its children itself)
    except OSError as exc:
        raise UsageError(f"cannot serve HTTP on {cfg.http}: {exc.strerror or exc}") from None
    return 0
