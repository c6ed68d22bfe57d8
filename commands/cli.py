"""`kvroute` command line. Each subcommand lives with its process (router/, worker/, gateway/) or in this package
(serve, talk); this file wires them.

Every failure a user can cause (bad flag, missing model, unreachable endpoint) ends in one line on stderr
and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from common.config import ConfigFileError, UsageError, load_config_file
from common.model import ModelError, resolve_model
from kvroute import __version__

# name -> (module, help, add_arguments name, run name)
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "serve": (
        "commands.serve",
        "start the router, local workers and the HTTP API; serve the default model",
        "add_arguments",
        "run",
    ),
    "router": ("router.main", "run the router process alone (workers and clients connect to it)", "add_arguments", "run"),
    "worker": ("worker.main", "run one worker process: one llama context on one device", "add_arguments", "run"),
    "http": ("gateway.main", "run the OpenAI-compatible HTTP API in front of a running router", "add_arguments", "run"),
    "complete": (
        "commands.talk",
        "complete a prompt on a running server, streaming to the terminal",
        "add_complete_arguments",
        "run_complete",
    ),
    "chat": ("commands.talk", "chat with a running server, streaming to the terminal", "add_chat_arguments", "run_chat"),
    "keys": ("common.keys", "generate CurveZMQ key pairs for secured TCP between hosts", "add_arguments", "run"),
    "status": ("commands.talk", "show workers, slots and what each slot holds", "add_status_arguments", "run_status"),
    "doctor": (
        "commands.doctor",
        "report this machine and install for a bug report, and check that llama.cpp runs here",
        "add_arguments",
        "run",
    ),
}


# Subcommands that run a daemon and so may read their flags from a TOML file (--config).
CONFIGURABLE = {"serve", "router", "worker", "http"}


def _model_path(args: argparse.Namespace) -> int:
    print(resolve_model(None))
    return 0


def build_parser() -> tuple[
    argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]], dict[str, argparse.ArgumentParser]
]:
    parser = argparse.ArgumentParser(
        prog="kvroute",
        description="Serve llama.cpp models without recomputing prompt prefixes: a prefix-aware router and workers.",
    )
    parser.add_argument("--version", action="version", version=f"kvroute {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    runners: dict[str, Callable[[argparse.Namespace], int]] = {}
    subparsers: dict[str, argparse.ArgumentParser] = {}

    for name, (module_name, help_text, add_name, run_name) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        getattr(module, add_name)(p)
        if name in CONFIGURABLE:
            p.add_argument("--config", metavar="FILE", help=f"TOML file whose [{name}] table sets these flags (flags given win)")
        runners[name] = getattr(module, run_name)
        subparsers[name] = p

    model = sub.add_parser("model", help="the default model", description="Manage the default model file.")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    model_sub.add_parser(
        "path", help="assemble the default model on first use and print its path", description="Print the default GGUF's path."
    )
    runners["model"] = _model_path
    return parser, runners, subparsers


def main(argv: Sequence[str] | None = None) -> int:
    parser, runners, subparsers = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    try:
        if getattr(args, "config", None):
            sub = subparsers[args.command]
            sub.set_defaults(**load_config_file(args.config, args.command, sub))
            args = parser.parse_args(argv)  # flags on the command line still win over the file
        return runners[args.command](args)
    except (ModelError, UsageError, ConfigFileError) as exc:
        print(f"kvroute {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
