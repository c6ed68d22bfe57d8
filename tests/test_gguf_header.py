"""common/weights.py reads a GGUF's header itself: the tokenizer's fingerprint (the vocabulary's, common/vocab.py) and
the weights'. Checked on small files written by llama.cpp's own `gguf` writer, against its own reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from common.weights import GGUFError, tensor_data_starts, tokenizer_fingerprint, weights_fingerprint

TOKENS = ["<pad>", "<eos>", "a", "b", "ab", "▁the"]


def write(
    path: Path,
    *,
    tokens: list[str] = TOKENS,
    scores: list[float] | None = None,
    eos: int = 1,
    name: str = "m",
    weight: float = 1.0,
    tokenizer_last: bool = False,
) -> Path:
    w = GGUFWriter(str(path), "llama")
    w.add_name(name)  # (not the tokenizer's: changes no fingerprint of the vocabulary)

    def tokenizer() -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores if scores is not None else [0.0] * len(tokens))
        w.add_eos_token_id(eos)

    if not tokenizer_last:
        tokenizer()
    w.add_uint32("llama.context_length", 64)
    if tokenizer_last:
        tokenizer()
    w.add_tensor("a.weight", np.full((4, 8), weight, dtype=np.float32))
    w.add_tensor("b.weight", np.arange(16, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_tokenizer_fingerprint_follows_the_tokenizer_metadata_only(tmp_path: Path) -> None:
    base = tokenizer_fingerprint(write(tmp_path / "base.gguf"))
    # other weights, another name, the same keys in another order: the same vocabulary
    assert tokenizer_fingerprint(write(tmp_path / "w.gguf", weight=2.0, name="other")) == base
    assert tokenizer_fingerprint(write(tmp_path / "o.gguf", tokenizer_last=True)) == base
    # a token's text, a score, a special id: another vocabulary
    assert tokenizer_fingerprint(write(tmp_path / "t.gguf", tokens=[*TOKENS[:-1], "▁thé"])) != base
    assert tokenizer_fingerprint(write(tmp_path / "s.gguf", scores=[0.0] * 5 + [-1.0])) != base
    assert tokenizer_fingerprint(write(tmp_path / "e.gguf", eos=0)) != base


def test_the_weights_fingerprint_follows_the_weights_and_the_tensor_starts_are_the_readers(tmp_path: Path) -> None:
    path = write(tmp_path / "base.gguf")
    assert tensor_data_starts(path) == [int(t.data_offset) for t in GGUFReader(str(path)).tensors]
    assert weights_fingerprint(write(tmp_path / "n.gguf", name="other")) == weights_fingerprint(path)
    assert weights_fingerprint(write(tmp_path / "w.gguf", weight=2.0)) != weights_fingerprint(path)


def test_a_file_cut_inside_its_token_list_is_named_as_malformed(tmp_path: Path) -> None:
    data = write(tmp_path / "base.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index(b"\xe2\x96\x81the") + 2])  # inside the last token's text
    with pytest.raises(GGUFError, match=r"cut\.gguf|string"):
        tokenizer_fingerprint(cut)
    with pytest.raises(GGUFError):
        weights_fingerprint(cut)
    (tmp_path / "not.gguf").write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFError, match="no GGUF magic"):
        tokenizer_fingerprint(tmp_path / "not.gguf")
