"""Every tool-call family by its key (`Family.key`, protocol ReplyFormat.family): what a client reading direct replies
gets from the router, made again on its side. Below the readers and the detection, which both name families here."""

from __future__ import annotations

from collections.abc import Callable

from chat.derived_family import KEY_PREFIX, DerivedFamily
from chat.families import Family, Gemma, Generic, Hermes, Llama3, Mistral, MistralArgs
from chat.harmony import Harmony
from chat.minimax_xml import MinimaxXml
from chat.muse import Muse
from chat.piece_syntax import Syntax
from chat.pythonic import Pythonic

MADE: dict[str, Callable[[], Family]] = {
    "hermes": Hermes,
    "llama3": Llama3,
    "mistral": Mistral,
    "mistral-args": lambda: MistralArgs(call_ids=False),
    "mistral-args+ids": lambda: MistralArgs(call_ids=True),
    "gemma": lambda: Gemma("gemma", "<|tool_call>", "<tool_call|>", '<|"|>'),
    "functiongemma": lambda: Gemma("functiongemma", "<start_function_call>", "<end_function_call>", "<escape>"),
    "generic": Generic,
    "harmony": Harmony,
    "pythonic": Pythonic,
    "minimax-m3": MinimaxXml,
    "muse": Muse,
}


def family_named(key: str) -> Family:
    """The family whose `key` this is. KeyError if none."""
    if key.startswith(KEY_PREFIX):
        try:
            return DerivedFamily(Syntax.from_wire(key[len(KEY_PREFIX) :]))
        except (ValueError, TypeError) as exc:
            raise KeyError(f"unreadable derived syntax: {exc}") from None
    return MADE[key]()
