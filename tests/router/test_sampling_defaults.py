"""Issue 63: a request that leaves sampling to the server gets the operator's values, else the model's own (its GGUF's
`general.sampling.*`, read by llama.cpp's rules), else llama-server's. Real GGUFs written with the `gguf` package."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.tiny_chat import chat_model
from commands.doctor import model_sampling, sampling_line
from commands.models_config import from_file
from common.config import ConfigFileError
from common.vocab import Vocab
from router.sampling_defaults import LLAMA_SERVER, resolve

AUTHORED = {  # what Qwen3's authors publish for thinking, and two samplers kvroute does not run
    "general.sampling.temp": 0.6,
    "general.sampling.top_k": 20,
    "general.sampling.top_p": 0.95,
    "general.sampling.min_p": 0.0,
    "general.sampling.penalty_repeat": 1.05,
    "general.sampling.xtc_probability": 0.5,
    "general.sampling.sequence": "top_k;temperature",
}


@pytest.fixture(scope="module")
def authored(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model(tmp_path_factory.mktemp("gguf") / "authored.gguf", "Qwen-Qwen3-0.6B", metadata=AUTHORED)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model(tmp_path_factory.mktemp("gguf") / "plain.gguf", "Qwen-Qwen3-0.6B")


def defaults_of(path: Path, model_file: dict[str, float | int] | None = None, **flags: float | int | None):  # type: ignore[no-untyped-def]
    vocab = Vocab.load(path)
    try:
        return resolve(model_file or {}, flags, vocab.meta)
    finally:
        vocab.close()


def test_a_gguf_with_its_authors_sampling_gives_those_values(authored: Path) -> None:
    got = defaults_of(authored)
    assert got.values == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0, "repeat_penalty": 1.05,
                          "repeat_last_n": 64}  # fmt: skip
    assert got.sources == {**dict.fromkeys(got.values, "gguf"), "repeat_last_n": "llama-server"}
    assert set(got.not_applied) == {"general.sampling.xtc_probability", "general.sampling.sequence"}


def test_a_gguf_without_them_gets_llama_servers_defaults(plain: Path) -> None:
    got = defaults_of(plain)
    assert got.values == LLAMA_SERVER == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
                                          "repeat_penalty": 1.0, "repeat_last_n": 64}  # fmt: skip
    assert set(got.sources.values()) == {"llama-server"} and got.not_applied == {}


def test_the_operator_wins_field_by_field_the_models_file_over_the_flags(authored: Path) -> None:
    got = defaults_of(authored, {"top_k": 5}, temperature=0.0, top_k=9, seed=3, min_p=None)
    assert (got.values["top_k"], got.sources["top_k"]) == (5, "models file")
    assert (got.values["temperature"], got.sources["temperature"]) == (0.0, "flag")
    assert (got.values["seed"], got.sources["seed"]) == (3, "flag")
    assert (got.values["min_p"], got.sources["min_p"]) == (0.0, "gguf")
    assert "seed" not in defaults_of(authored).values, "without the operator's seed each request draws its own"


def test_gguf_values_are_read_as_llama_cpp_reads_them() -> None:
    meta = {"general.sampling.top_k": "-1", "general.sampling.temp": "-0.5", "general.sampling.top_p": "7",
            "general.sampling.min_p": "abc"}  # fmt: skip
    got = resolve({}, {}, meta.get)
    assert (got.values["top_k"], got.values["temperature"]) == (0, 0.0)  # (<= 0: off, greedy)
    assert got.values["top_p"] == 0.95 and got.sources["top_p"] == "llama-server"
    assert got.not_applied["general.sampling.top_p"] == "7 (not a usable value)"
    assert got.values["min_p"] == 0.05  # (not a number: llama.cpp keeps its own too)


def test_doctor_says_the_models_defaults_and_what_it_does_not_run(authored: Path) -> None:
    line = sampling_line(model_sampling(authored))
    assert "temperature=0.6 (gguf)" in line and "repeat_last_n=64 (llama-server)" in line
    assert "not run: general.sampling.sequence=top_k;temperature" in line


def test_a_models_file_sets_sampling_per_model_and_names_a_wrong_value(tmp_path: Path) -> None:
    good = tmp_path / "models.toml"
    good.write_text('[models.coder]\npath = "x.gguf"\ntemp = 0.2\ntop_k = 20\nseed = 5\n')
    (entry,) = from_file(str(good), -1.0)
    assert dict(entry.served.sampling) == {"temperature": 0.2, "top_k": 20, "seed": 5}
    for line, named in (("top_p = 0.0", "top_p"), ('temp = "hot"', "temp"), ("top_k = 1.5", "top_k")):
        bad = tmp_path / "bad.toml"
        bad.write_text(f'[models.coder]\npath = "x.gguf"\n{line}\n')
        with pytest.raises(ConfigFileError, match=f"`{named}`"):
            from_file(str(bad), -1.0)
