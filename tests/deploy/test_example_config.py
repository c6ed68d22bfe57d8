"""deploy/kvroute.toml loads cleanly against the real `kvroute router` and `kvroute worker` flags, so the
example never drifts from the code; and the units' own flags (--gpu, --worker-id) still parse with it."""

from __future__ import annotations

from pathlib import Path

from commands.cli import build_parser
from common.config import load_config_file

EXAMPLE = str(Path(__file__).resolve().parents[2] / "deploy" / "kvroute.toml")


def test_example_config_matches_the_router_and_worker_flags() -> None:
    parser, _, subs = build_parser()
    router = load_config_file(EXAMPLE, "router", subs["router"])
    worker = load_config_file(EXAMPLE, "worker", subs["worker"])
    assert router["worker_keys"] and router["curve_key"] and worker["router_key"] and worker["curve_key"]
    subs["router"].set_defaults(**router)
    subs["worker"].set_defaults(**worker)
    args = parser.parse_args(["worker", "--config", EXAMPLE, "--gpu", "1", "--worker-id", "box-gpu1"])
    assert (args.gpu, args.worker_id, args.slots, args.connect) == (1, "box-gpu1", worker["slots"], worker["connect"])
    args = parser.parse_args(["router", "--config", EXAMPLE])
    assert args.worker_endpoint == router["worker_endpoint"] and args.drain_timeout_s == router["drain_timeout_s"]
