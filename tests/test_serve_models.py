"""`kvroute serve`'s models: `--model [NAME=]PATH` repeated, a models file, and each model's worker flags; the HTTP
API's `keep_alive` durations."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from commands.cli import build_parser
from commands.models_config import from_file, from_flags
from commands.serve import LocalWorkers, served_models, worker_specs
from common.config import ConfigFileError, add_args, from_args
from gateway.errors import RequestError
from gateway.normalise import keep_alive_s
from worker.config import WorkerConfig


def serve_args(*flags: str) -> argparse.Namespace:
    parser, _, _ = build_parser()
    return parser.parse_args(["serve", *flags])


def test_one_model_of_old_and_several_named() -> None:
    assert served_models(serve_args()) is None
    assert served_models(serve_args("--model", "/m/a.gguf")) is None  # one unnamed model: as before
    entries = served_models(serve_args("--model", "coder=/m/a.gguf", "--model", "/m/b.gguf", "--keep-alive", "5m"))
    assert entries is not None
    assert [(e.served.name, e.served.path, e.served.keep_alive_s) for e in entries] == [
        ("coder", "/m/a.gguf", 300.0),
        ("", "/m/b.gguf", 300.0),  # named by its file when loaded
    ]
    named = served_models(serve_args("--model", "small=/m/a.gguf"))
    assert named is not None and named[0].served.name == "small"
    with pytest.raises(ValueError, match="NAME=PATH"):
        from_flags(["=x.gguf"], -1)


def test_a_models_file_gives_each_model_its_workers_and_keep_alive(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        '[models.coder]\npath = "/m/coder.gguf"\naliases = ["gpt-4o"]\ngpus = [0, 1]\nslots = 8\npinned = true\n'
        'default = true\nmemory_mb = 9000\n\n[models.small]\npath = "/m/small.gguf"\nkeep_alive = "10m"\n'
        'load = "on_demand"\ngeneric_tools = true\n'
    )
    coder, small = from_file(str(path), -1.0)
    assert coder.served.generic_tools is None and small.served.generic_tools is True  # (None: the --generic-tools flag's)
    assert coder.served.aliases == ("gpt-4o",) and coder.served.pinned and coder.default
    assert coder.workers == {"gpus": "0,1", "slots": 8} and coder.served.keep_alive_s == -1.0
    assert coder.served.memory_mb == 9000 and coder.served.memory_given and not small.served.memory_given
    assert small.served.keep_alive_s == 600.0 and not small.served.load_at_start and small.workers == {}


def test_a_workers_footprint_is_its_file_and_its_kv() -> None:
    from commands.serve import footprint
    from common.model import default_model_path
    from common.vocab import Vocab
    from router.models import ServedModel

    path = str(default_model_path())
    vocab, spec = Vocab.load(path), ServedModel(name="m", path=path)
    weights = Path(path).stat().st_size / 2**20
    cpu = footprint(spec, vocab, LocalWorkers(cpu_workers=2, slots=2, ctx_per_slot=1024))
    per_token = 18 * 1 * (256 + 256) * 2  # Gemma 3 270M: 18 layers, one KV head of 256, f16
    assert cpu.devices == ("cpu", "cpu") and cpu.memory_mb == pytest.approx(weights + 2 * 1024 * per_token / 2**20)
    gpu = footprint(spec, vocab, LocalWorkers(gpus="0,1", slots=4, kv_budget_mb=512))
    assert gpu.devices == ("gpu0", "gpu1") and gpu.memory_mb == pytest.approx(weights + 512)
    given = footprint(ServedModel(name="m", path=path, memory_mb=100.0, memory_given=True), vocab, LocalWorkers())
    assert given.memory_mb == 100 and given.weights_mb == pytest.approx(weights)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[models.a]\npath = "x"\nslot = 2\n', "unknown key 'slot'"),
        ("[models.a]\nslots = 2\n", "`path`"),
        ('[models.a]\npath = "x"\nload = "later"\n', "`load` must be"),
        ('[models.a]\npath = "x"\nkeep_alive = "soon"\n', "keep_alive: expected seconds"),
        ('[models.a]\npath = "x"\naliases = "b"\n', "`aliases` must be a list"),
        ('[models.a]\npath = "x"\nmemory_mb = "lots"\n', "`memory_mb` must be a number of MiB"),
        ('[models.a]\npath = "x"\ngeneric_tools = "yes"\n', "`generic_tools` must be true or false"),
        ("[serve]\nslots = 2\n", "no [models.NAME] table"),
    ],
)
def test_a_bad_models_file_names_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "models.toml"
    path.write_text(text)
    with pytest.raises(ConfigFileError, match=message.replace("[", r"\[").replace("(", r"\(")):
        from_file(str(path), -1.0)


def test_workers_of_a_named_model_carry_its_name() -> None:
    specs = worker_specs(LocalWorkers(cpu_workers=2, cache_dir="/c"), "/m/a.gguf", "qwen2.5:7b")
    assert [s.worker_id for s in specs] == ["qwen2.5_7b-cpu0", "qwen2.5_7b-cpu1"]
    assert all(s.model == "qwen2.5:7b" for s in specs)
    parser = argparse.ArgumentParser()
    add_args(parser, WorkerConfig)
    cfg = from_args(WorkerConfig, parser.parse_args(list(specs[1].flags)))
    assert cfg.model_name == "qwen2.5:7b" and cfg.cache_dir == "/c/qwen2.5_7b-cpu1"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, None), (10, 10.0), (0, 0.0), (-1, -1.0), ("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3), ("-5m", -1.0)],
)
def test_keep_alive_takes_seconds_or_durations(value: object, seconds: float | None) -> None:
    assert keep_alive_s(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5m10", True, [5]])
def test_a_bad_keep_alive_is_refused_naming_it(value: object) -> None:
    with pytest.raises(RequestError) as info:
        keep_alive_s(value)
    assert info.value.param == "keep_alive"


def test_a_config_file_gives_one_model_or_several(tmp_path: Path) -> None:
    from common.config import load_config_file

    parser, _, subs = build_parser()
    path = tmp_path / "kvroute.toml"
    path.write_text('[router]\nmodel = ["alpha=/m/a.gguf", "beta=/m/b.gguf"]\n[serve]\nmodel = "/m/a.gguf"\n')
    assert load_config_file(str(path), "router", subs["router"]) == {"model": ["alpha=/m/a.gguf", "beta=/m/b.gguf"]}
    subs["serve"].set_defaults(**load_config_file(str(path), "serve", subs["serve"]))
    assert served_models(parser.parse_args(["serve", "--config", str(path)])) is None  # one model, as before
    both = served_models(parser.parse_args(["serve", "--config", str(path), "--model", "b=/m/b.gguf"]))
    assert both is not None and [e.served.name for e in both] == ["", "b"]
