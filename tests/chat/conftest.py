"""Chat-layer fixtures: the vendored templates, and llguidance over the default model's real vocabulary (no weights)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from chat.request import ChatFormat
from chat.template import ChatTemplate
from common.model import resolve_model
from common.vocab import Vocab
from worker.guide import GuideTokenizer

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "templates"


def chat_format(name: str, *, generic_tools: bool = False) -> ChatFormat:
    """A vendored template by file stem, with Llama-style BOS/EOS texts (`generic_tools`: as `--generic-tools`)."""
    template = ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), name, bos_text="<s>", eos_text="</s>")
    return ChatFormat(template, generic_tools=generic_tools)


@pytest.fixture(scope="session")
def vocab() -> Iterator[Vocab]:
    v = Vocab.load(resolve_model(None))
    yield v
    v.close()


@pytest.fixture(scope="session")
def guide_tokenizer(vocab: Vocab) -> Iterator[GuideTokenizer]:
    tok = GuideTokenizer(vocab)
    tok.get()
    yield tok
    tok.close()
