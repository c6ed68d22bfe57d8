"""The TOML config file maps onto the same settings as the CLI flags; bad keys and values stop start-up with one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from commands.cli import build_parser
from common.config import ConfigFileError, load_config_file


def http_parser():  # the `http` command exists from the foundation on; the others share the same code path
    return build_parser()[2]["http"]


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "kvroute.toml"
    p.write_text(text)
    return str(p)


def test_values_are_read_with_dash_or_underscore(tmp_path: Path) -> None:
    path = write(tmp_path, '[http]\nhttp = "127.0.0.1:9001"\nmodel-name = "gemma"\n[other]\nx = 1\n')
    assert load_config_file(path, "http", http_parser()) == {"http": "127.0.0.1:9001", "model_name": "gemma"}


def test_flags_on_the_command_line_win(tmp_path: Path) -> None:
    parser, _, subs = build_parser()
    path = write(tmp_path, '[http]\nhttp = "127.0.0.1:9001"\nmodel_name = "from-file"\n')
    subs["http"].set_defaults(**load_config_file(path, "http", subs["http"]))
    args = parser.parse_args(["http", "--config", path, "--model-name", "from-flag"])
    assert (args.http, args.model_name) == ("127.0.0.1:9001", "from-flag")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[http]\nmodle_name = "x"\n', "unknown key 'modle_name'"),
        ("[http]\nhttp = 8000\n", "[http] http: expected a string, got 8000"),
        ("[http]\nhttp = \n", "not valid TOML"),
        ("[router]\nslots = 2\n", None),
        ("http = 3\n", "[http] must be a table"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, text: str, message: str | None) -> None:
    path = write(tmp_path, text)
    if message is None:
        assert load_config_file(path, "http", http_parser()) == {}
        return
    with pytest.raises(ConfigFileError) as info:
        load_config_file(path, "http", http_parser())
    assert message in str(info.value)


def test_cli_stops_with_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[http]\nbogus = true\n")
    out = subprocess.run(
        [sys.executable, "-m", "commands.cli", "http", "--config", path], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "unknown key 'bogus'" in out.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "commands.cli", "http", "--config", str(tmp_path / "none.toml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "cannot read config file" in missing.stderr


def test_local_worker_flags_are_written_from_the_worker_config() -> None:
    import argparse

    from commands.serve import LocalWorkers, worker_specs
    from common.config import add_args, from_args
    from worker.config import WorkerConfig

    sizes = {"slots": 3, "ctx_per_slot": 2048, "threads": 4, "n_batch": 256, "step_target_ms": 400, "host_cache_mb": 0}
    local = LocalWorkers(cpu_workers=2, deterministic=True, spec="ngram", spec_max=3, **sizes)
    specs = worker_specs(local, "/m.gguf")
    assert [s.worker_id for s in specs] == ["cpu0", "cpu1"]
    parser = argparse.ArgumentParser()
    add_args(parser, WorkerConfig)
    cfg = from_args(WorkerConfig, parser.parse_args(list(specs[0].flags)))
    want = WorkerConfig(model="/m.gguf", deterministic=True, spec="ngram", spec_max=3, **sizes)
    assert cfg == want
    gpu = worker_specs(LocalWorkers(gpus="1"), "/m.gguf")[0]
    assert gpu.worker_id == "gpu1" and from_args(WorkerConfig, parser.parse_args(list(gpu.flags))).gpu == 1


def test_every_command_prints_its_help() -> None:
    """Help texts go through argparse's %-formatting: a stray '%' in one would make `--help` crash."""
    from commands.cli import build_parser

    _, _, subparsers = build_parser()
    assert {"serve", "worker", "router"} <= set(subparsers)
    for name, p in subparsers.items():
        assert f"usage: kvroute {name}" in p.format_help()
