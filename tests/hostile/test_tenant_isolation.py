"""One tenant's prompts tell another nothing (issue item 6): the router's cache of prompt heads is per tenant, so how
fast a prompt is tokenized does not say whether another tenant sent the same head."""

from __future__ import annotations

from common.vocab import Vocab
from router.prompt_tokens import PromptTokenizer


def turn(role: str, text: str) -> str:
    return f"<start_of_turn>{role}\n{text}<end_of_turn>\n"


def test_a_prompt_head_kept_for_one_tenant_is_not_reused_for_another(vocab: Vocab) -> None:
    pt = PromptTokenizer(vocab)
    history = turn("user", "The secret plan is written in the harbour log. " * 40) + turn("model", "Understood.")
    first = history + "<start_of_turn>model\n"
    nxt = history + turn("user", "And then?") + "<start_of_turn>model\n"
    pt.tokenize(first, True, tenant="a")
    before = pt.reused_tokens
    ours = pt.tokenize(nxt, True, tenant="a")
    assert pt.reused_tokens > before  # the same tenant's next turn reuses its head
    before = pt.reused_tokens
    theirs = pt.tokenize(nxt, True, tenant="b")
    assert pt.reused_tokens == before  # another tenant's does not: tokenized whole
    assert list(ours) == list(theirs) == vocab.tokenize(nxt, add_special=True)
