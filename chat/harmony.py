"""gpt-oss's harmony format: the reply is a sequence of messages, each a header and a body, on channels.

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>final<|message|>REPLY                          (<|return|> ends it: a stop token)
    <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}   (<|call|>: a stop token)
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}

The prompt ends with `<|start|>assistant`, so the first header has no `<|start|>` (chat/message_parser.py reads the
messages). A message to `functions.NAME` is a call (its body the arguments, streamed as written), the analysis
channel is thinking, the others are reply text.
The template writes calls back with the recipient before the channel, one call per message.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from chat.calls import Head
from chat.families import EMPTY, Family
from chat.message_parser import START, MessageParser
from chat.output_parser import OpenCall, OutputParser, Piece, ReadSpec
from protocol import Tool

OPEN, CLOSE = "<|channel|>analysis<|message|>", "<|end|>"  # (as a reasoning pair, for the spec on the wire)
RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.\-]+)")
CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class Harmony(Family):
    name = "harmony"
    triggers = ("to=functions.",)  # (auto: free text, thinking included, until a message to a function begins)
    reasoning = (OPEN, CLOSE)  # (its thinking is a channel)

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        """One call, as the template writes it back (the prompt ends with `<|start|>assistant`; lazily, from the
        recipient on, after the model's own `<|start|>assistant`)."""
        head = '"to=functions."' if lazy else '" to=functions."'
        rules = f"calls: {head} fn\n"
        return rules + self._named(tools, '"{name}<|channel|>commentary json<|message|>" {args}')

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        return i  # (read by HarmonyParser, not through the section machinery)

    def parser(self, spec: ReadSpec) -> OutputParser:
        return HarmonyParser(spec)


class HarmonyParser(MessageParser):
    """Reads a harmony reply as it streams: a message to a function is a call, its body the arguments as written."""

    ENDS = ("<|end|>", "<|call|>", "<|return|>", START)

    def _recipient(self, header: str) -> str | None:
        recipient = RECIPIENT.search(header)
        return recipient.group(1) if recipient else None

    def _thinking(self, header: str) -> bool:
        channel = CHANNEL.search(header)
        return bool(channel and channel.group(1) == "analysis")

    def _call_text(self, out: Piece, call: OpenCall, text: str, final: bool) -> None:
        if text:
            call.arguments += text
            self._args(out, call.index, text)

    def _end_message(self, cut: bool) -> None:
        if self.call is not None:
            self.call.done = not cut
        self.call = None
        self.kind = "content"
