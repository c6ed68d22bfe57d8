"""common.files.made_once: a derived file (a tiny model, a GGUF with another template) is made on first use only, and
a make that fails leaves no file to trust."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.files import made_once


def test_a_file_is_made_once_into_its_directory_and_then_reused(tmp_path: Path) -> None:
    calls: list[Path] = []

    def make(tmp: Path) -> None:
        calls.append(tmp)
        tmp.write_bytes(b"gguf")

    out = tmp_path / "derived" / "model.gguf"
    assert made_once(out, make) == out and out.read_bytes() == b"gguf"
    assert made_once(out, make) == out
    assert len(calls) == 1 and calls[0] != out and not calls[0].exists()  # (made beside it, then renamed)


def test_a_make_that_fails_leaves_no_file(tmp_path: Path) -> None:
    def half(tmp: Path) -> None:
        tmp.write_bytes(b"gg")
        raise OSError("disk full")

    out = tmp_path / "model.gguf"
    with pytest.raises(OSError, match="disk full"):
        made_once(out, half)
    assert not out.exists() and not list(tmp_path.iterdir())  # (nor the half-made one beside it)
