"""A family checked against a template's own renderings: the check turns (calls of every shape: several, none,
each JSON type) written as the template writes them and read back to the same calls."""

from __future__ import annotations

import json
import re
from typing import Any

from chat.derived_family import DerivedFamily
from chat.families import Family
from chat.output import OutputSpec
from chat.piece_syntax import TYPES, Syntax
from chat.template_probes import IDS, KEYS, NAMES, SAMPLES, Probe, squeeze, turn, with_ids

CHECKS: list[list[tuple[str, dict[str, Any]]]] = [  # (a syntax of one call per turn is checked on the single ones)
    [(NAMES[0], {KEYS[0]: "a value\nwith two lines", KEYS[1]: 7}), (NAMES[1], {})],
    [(NAMES[2], {KEYS[1]: 'x <y> & "z"'})],
    [(NAMES[1], {KEYS[0]: "p"}), (NAMES[0], {KEYS[0]: "q", KEYS[1]: "r"}), (NAMES[2], {KEYS[0]: "s"})],
    [(NAMES[0], {f"keyprobe{kind}": SAMPLES[kind] for kind in TYPES})],
]


def check_spec(family: Family, calls: list[tuple[str, dict[str, Any]]]) -> OutputSpec:
    """How to read a check turn: its tools, the string parameters its values say."""
    strings: dict[str, set[str]] = {}
    for name, args in calls:
        strings.setdefault(name, set()).update(k for k, v in args.items() if isinstance(v, str))
    frozen = {n: frozenset(v) for n, v in strings.items()}
    return OutputSpec(family=family, tool_names=frozenset(NAMES), strings=frozen)


def verified(probe: Probe, syntax: Syntax) -> bool:
    """The syntax writes each check turn as the template does, and reads it back to the same calls."""
    family = DerivedFamily(syntax)
    for calls in CHECKS:
        if syntax.single and len(calls) > 1:
            calls = calls[:1]
        text = probe.reply(turn(calls))
        if text is None:
            return False
        written = with_ids(syntax.write([(n, a, IDS[k]) for k, (n, a) in enumerate(calls)]))
        if squeeze(with_ids(text)) != squeeze(written):  # (whitespace may differ: it is read either way)
            return False
        parser = check_spec(family, calls).parser()
        parser.feed(text)
        parser.finish()
        if not same_calls(parser.tool_calls, calls) or not turn_end(parser.text):
            return False
    return True


def turn_end(text: str) -> bool:
    """Whether what is left after the calls is nothing, or one marker the template ends such a turn with (Gemma 4's
    `<|tool_response>`, which the model writes as its stop)."""
    return re.fullmatch(r"\s*(<[^<>\s]+>|\[[^\[\]\s]+\])?\s*", text) is not None


def same_calls(got: list[Any], calls: list[tuple[str, dict[str, Any]]]) -> bool:
    try:
        return [(c.name, json.loads(c.arguments)) for c in got] == list(calls)
    except ValueError:
        return False


def reads_back(probe: Probe, family: Family) -> bool:
    """The family reads the calls of the check turns the template renders (at least one) back exactly."""
    read = 0
    for calls in CHECKS:
        text = probe.reply(turn(calls))
        if text is None:
            continue  # (Llama 3 takes one call per turn)
        if any(n not in text for n, _ in calls[1:]):
            calls = calls[:1]  # (a template that writes the first call of a turn only: gpt-oss)
        parser = check_spec(family, calls).parser()
        parser.feed(text)
        parser.finish()
        if not same_calls(parser.tool_calls, calls) or not turn_end(parser.text):
            return False
        read += 1
    return read > 0
