"""Probe turns rendered with a chat template (as llama.cpp's chat-diff-analyzer does): assistant turns with known names,
keys and values (one call, three calls, two parameters, none, each JSON type), and the text the model writes for
each (`Probe.reply`). What the template writes around the probes says its tool-call syntax
(chat/syntax_derivation.py) and its thinking tags (chat/thinking_derivation.py), and checks a family against it
(chat/syntax_check.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

from chat.calls import WS
from chat.template import ChatTemplate, RawJSON

NAMES = ("fnprobeone", "fnprobetwo", "fnprobethree")
KEYS = ("keyprobeone", "keyprobetwo")
VALUES = ("valueprobeone", "valueprobetwo", "valueprobethree")
IDS = tuple(f"PrObE{k:04d}" for k in range(8))  # 9 letters and digits: what Mistral's templates insist on
CONTENT, REASONING = "contentprobe", "reasoningprobe"
SAMPLES: dict[str, Any] = {"string": "valueprobeone", "integer": 42, "number": 2.5, "boolean": True,
                           "object": {"inner": 1}, "array": [1, "a"]}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": n, "description": "probe", "parameters": {
        "type": "object", "properties": {k: {"type": "string"} for k in KEYS}}}}
    for n in NAMES
]  # fmt: skip


def lcp(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


BOUNDARY = ">]\n}"
END_MARK = re.compile(r"<[^<>\s]{2,}>|\[[^\[\]\s]{2,}\]")  # a turn's end marker (`<|im_end|>`, `</s>`, `[e~[`...)


def boundary(text: str, i: int) -> int:
    """`i` moved back to the end of a tag or line (where a shared prefix ends inside a marker, `<t` of `<think>` and
    `<tool_call>`, the marker is not split)."""
    while 0 < i < len(text) and text[i - 1] not in BOUNDARY:
        i -= 1
    return i


def squeeze(text: str) -> str:
    """The text without whitespace runs between markers (where templates differ by a newline)."""
    return re.sub(r"(?<=[>\]])\s+|\s+(?=[<\[])", "", text)


def lcs(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[-1 - i] == b[-1 - i]:
        i += 1
    return i


class Probe:
    """Renders probe turns with one template: `reply(message)` is the text the model writes for that assistant message
    (what follows the generation prompt, without the turn's end)."""

    def __init__(self, template: ChatTemplate) -> None:
        self.t = template
        self.user = [{"role": "user", "content": "userprobe"}]
        self.tools: list[dict[str, Any]] | None = TOOLS
        try:
            self.gen = self.render(None, gen=True)
        except Exception:  # a template that reads tools in another shape (Cohere's command-r-plus): none given
            self.tools = None
            self.gen = self.render(None, gen=True)
        plain = self.raw({"role": "assistant", "content": CONTENT})
        if plain is None or CONTENT not in plain:
            raise ValueError("the template does not render an assistant message")
        at = plain.index(CONTENT)
        self.pre, self.end = plain[:at], plain[at + len(CONTENT) :]

    def render(self, message: dict[str, Any] | None, gen: bool = False) -> str:
        msgs = self.user + ([message] if message else [])
        return self.t.render(msgs, self.tools, add_generation_prompt=gen)[0]

    def raw(self, message: dict[str, Any]) -> str | None:
        """What follows the generation prompt in the rendered history (None if the template refuses the turn)."""
        try:
            full = self.render(message)
        except Exception:
            return None
        shared = lcp(full, self.gen)
        return full[shared if shared == len(self.gen) else boundary(full, shared) :]

    def reply(self, message: dict[str, Any]) -> str | None:
        text = self.raw(message)
        if text is None:
            return None
        if self.pre and text.startswith(self.pre):
            text = text[len(self.pre) :]
        mark = self.end.strip(WS)
        # the turn's end: the model stops there, whatever comes after; the first after the probe's own words
        # (GigaChat 3 ends the reply text with it, then writes the call as a message of its own)
        if END_MARK.fullmatch(mark) and mark in text[text.rfind("probe") + 1 :]:
            return text[: text.index(mark, text.rfind("probe") + 1)]
        cut = lcs(text, self.end)
        if not cut:
            return text
        text = text[: len(text) - cut]
        if text.rfind("<") > text.rfind(">"):  # (the shared end cut a marker: `<|call|>` and `<|return|>` share `|>`)
            text = text[: text.rfind("<")]
        return text


def turn(calls: list[tuple[str, dict[str, Any]]], content: str = "") -> dict[str, Any]:
    tool_calls = [
        {"id": IDS[k], "type": "function", "function": {"name": n, "arguments": RawJSON(json.dumps(a))}}
        for k, (n, a) in enumerate(calls)
    ]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}


def with_ids(text: str) -> str:
    for call_id in IDS:
        text = text.replace(call_id, "{id}")
    return text
