"""The tool-call family of a chat template (`detect`): the hand-written families whose markers the template has
(`hand_families`), checked against its own renderings (chat/syntax_check.py); else the syntax derived from them
(chat/syntax_derivation.py); else the generic JSON document."""

from __future__ import annotations

from chat.calls import WS
from chat.derived_family import DerivedFamily
from chat.families import Family, Generic, Hermes, Llama3, Mistral, MistralArgs
from chat.family_registry import family_named
from chat.harmony import Harmony
from chat.minimax_xml import MinimaxXml
from chat.muse import Muse
from chat.pythonic import Pythonic
from chat.syntax_check import CHECKS, reads_back
from chat.syntax_derivation import derive_syntax
from chat.template import ChatTemplate
from chat.template_probes import KEYS, NAMES, VALUES, Probe, turn


def detect(template: ChatTemplate) -> Family:
    """The tool-call family of a chat template: a hand-written one where its markers say so and it reads the template's
    own probe calls back, else the syntax derived from renderings, else the generic JSON document (tools described
    in a system message)."""
    try:
        probe: Probe | None = Probe(template)
    except Exception:
        probe = None
    if probe is not None and probe.tools is None:
        return Generic()  # (tools given as OpenAI's break it: they go in the generic family's system message)
    for family in hand_families(template.source):
        if probe is not None and reads_back(probe, family):
            return hermes_sep(probe, family)
        if probe is not None and isinstance(family, Pythonic) and writes_no_calls(probe):
            return Pythonic(in_content=True)  # (LFM2-8B-A1B, LFM2.5-Instruct: the calls go into the content)
    syntax = derive_syntax(template)
    if syntax is not None:
        return DerivedFamily(syntax)
    return Generic()


def hand_families(source: str) -> list[Family]:
    """The families written by hand whose markers the template source has."""
    out: list[Family] = []
    if all(m in source for m in ("<|channel|>", "<|message|>", "<|call|>", "functions.")):
        out.append(Harmony())
    if "<atem:function_calls>" in source and "<|eom|>" in source:
        out.append(Muse())
    if "]<]minimax[>[" in source and "<invoke name=" in source:
        out.append(MinimaxXml())
    if "<|tool_list_start|>" in source or "List of tools: [" in source:  # (LFM2, LFM2.5: as llama.cpp tells them)
        out.append(Pythonic())
    if "[TOOL_CALLS]" in source:
        out.append(MistralArgs(call_ids="[CALL_ID]" in source) if "[ARGS]" in source else Mistral())
    if "<|tool_call>call:" in source:
        out.append(family_named("gemma"))
    if "<start_function_call>" in source:
        out.append(family_named("functiongemma"))
    if "<tool_call>" in source:
        out.append(Hermes())
    if "<|start_header_id|>" in source and ("ipython" in source or '"parameters"' in source):
        out.append(Llama3())
    return out


def hermes_sep(probe: Probe, family: Family) -> Family:
    """A Hermes family writing between two calls what its template writes there (Reka Edge: nothing), so that the
    grammar's calls render back as written."""
    text = probe.reply(turn(CHECKS[0])) if isinstance(family, Hermes) else None
    close = text.find("</tool_call>") if text is not None else -1
    if text is None or close < 0 or "<tool_call>" not in text[close:]:
        return family
    sep = text[close + len("</tool_call>") : text.index("<tool_call>", close)]
    return Hermes(sep) if not sep.strip(WS) else family


def writes_no_calls(probe: Probe) -> bool:
    """The template renders an assistant message's calls nowhere (the model's own text must carry them)."""
    text = probe.reply(turn([(NAMES[0], {KEYS[0]: VALUES[0]})]))
    return text is not None and NAMES[0] not in text and VALUES[0] not in text
