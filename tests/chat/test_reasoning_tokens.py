"""The reader's count of the thinking's tokens (`OutputParser.reasoning_tokens`: the Responses API's
`output_tokens_details.reasoning_tokens`, Chat's `completion_tokens_details.reasoning_tokens`; issue 63): every token
that opened, continued or closed the thinking, an opening tag the model wrote in several tokens included; a feed of
several tokens in which the thinking ends counts its share of them (no model)."""

from __future__ import annotations

import pytest
import template_table as tt

from chat.output import OutputSpec
from chat.output_parser import OutputParser, share
from chat.request import ChatFormat


def chat_format(name: str) -> ChatFormat:
    return ChatFormat(tt.template(name))


QWEN3 = chat_format("Qwen-Qwen3-0.6B")
TAGS = OutputSpec(reasoning=QWEN3.reasoning)


def fed(spec: OutputSpec, pieces: list[str | tuple[str, int]]) -> OutputParser:
    p = spec.parser()
    for piece in pieces:
        text, n = piece if isinstance(piece, tuple) else (piece, 1)
        p.feed(text, n)
    p.finish()
    return p


@pytest.mark.parametrize(
    ("pieces", "count", "reasoning", "text"),
    [
        (["<think>", "plan", "</think>", "Hi"], 3, "plan", "Hi"),
        (["<", "think", ">", "plan", "</", "think", ">", "Hi"], 7, "plan", "Hi"),  # (tags as a vocabulary without them)
        (["\n", "<th", "ink>", "a", "</think>", "\n\n", "Hi"], 5, "a", "Hi"),  # (the newline before the tag too)
        ([("<think></think>", 2), "Hi"], 2, None, "Hi"),  # (an empty thinking block, in one feed)
        (["<", "b>", "Hi"], 0, None, "<b>Hi"),  # (looked like the tag's start, was not)
        (["Hi", " there"], 0, None, "Hi there"),
    ],
)
def test_the_thinkings_tokens_tags_included(
    pieces: list[str | tuple[str, int]], count: int, reasoning: str | None, text: str
) -> None:
    p = fed(TAGS, pieces)
    assert (p.reasoning_tokens, p.reasoning_text, p.text) == (count, reasoning, text)


def test_a_feed_of_several_tokens_where_the_thinking_ends_counts_its_share() -> None:
    p = fed(TAGS, ["<think>", "hmm", ("</think>\n\nThe answer is twelve", 8)])  # its first 8 bytes of 30 end the thinking
    assert p.reasoning_tokens == 2 + 3 and p.text == "The answer is twelve"
    p = fed(TAGS, [("<think>hmm</think>", 3), ("Answer", 2)])  # (all of a feed that ends with the tag)
    assert p.reasoning_tokens == 3
    opened = fed(OutputSpec(reasoning=("<think>", "</think>"), in_reasoning=True), [("hmm</think>" + "x" * 89, 10)])
    assert opened.reasoning_tokens == 2  # (11 bytes of 100: one token and a part)
    assert [share("ab", 1, 4), share("ab", 2, 4), share("abc", 0, 3), share("é.", 1, 3)] == [2, 4, 1, 2]


def test_harmony_counts_the_analysis_header_and_its_end_not_the_final_messages() -> None:
    gpt_oss = chat_format("openai-gpt-oss-120b")
    spec = OutputSpec(family=gpt_oss.family, reasoning=gpt_oss.reasoning)
    tokens = ["<|channel|>", "analysis", "<|message|>", "Think", " more", "<|end|>", "<|start|>", "assistant", "<|channel|>",
              "final", "<|message|>", "Hi"]  # fmt: skip
    p = fed(spec, tokens)  # type: ignore[arg-type]
    assert (p.reasoning_tokens, p.reasoning_text, p.text) == (6, "Think more", "Hi")
    p = fed(
        spec, [("<|channel|>analysis<|message|>", 3), ("Think more<|end|><|start|>assistant<|channel|>final<|message|>Hi", 8)]
    )
    assert p.reasoning_tokens == 3 + 3 and p.text == "Hi"  # (17 bytes of 63 of the second feed)
    p = fed(spec, ["<|channel|>", "final", "<|message|>", "Hi"])
    assert p.reasoning_tokens == 0 and p.text == "Hi"
