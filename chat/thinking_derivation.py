"""A template's thinking tags, derived by rendering an assistant turn with `reasoning_content` (chat/template_probes.py)
and reading back what the template writes around it; the empty thinking block a turn without thinking opens with;
the usual tags where a template says no more than their close (`reasoning_tags`)."""

from __future__ import annotations

import re
from typing import Any

from chat.calls import WS
from chat.output import OutputSpec
from chat.template import ChatTemplate
from chat.template_probes import CONTENT, KEYS, NAMES, REASONING, VALUES, Probe, boundary, lcp, turn

REASONING_TAGS = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))
THINKING_ON: list[dict[str, Any]] = [{}, {"enable_thinking": True, "thinking": True, "reasoning_effort": "high"}]


def reasoning_tags(source: str) -> tuple[str, str] | None:
    """The thinking tags a template uses, if it has any."""
    for open_, close in REASONING_TAGS:
        if close in source:
            return open_, close
    return None


def derive_reasoning(template: ChatTemplate, triggers: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """The thinking tags (open, close) of the template: from an assistant turn it renders with `reasoning_content`
    (a plain reply, or one with a call: some templates keep the thinking only there; `triggers` open the call
    section), read back from the text the template writes; else from the tag its generation prompt opens when
    thinking is switched on (DeepSeek V3.1 renders no past thinking)."""
    try:
        probe = Probe(template)
    except Exception:
        return None
    call = turn([(NAMES[0], {KEYS[0]: VALUES[0]})], CONTENT)
    for kwargs in THINKING_ON:
        for message in ({"role": "assistant", "content": CONTENT}, call):
            try:
                full = template.render([*probe.user, {**message, "reasoning_content": REASONING}], probe.tools,
                                       add_generation_prompt=False, kwargs=kwargs)[0]  # fmt: skip
                gen = template.render(probe.user, probe.tools, add_generation_prompt=True, kwargs=kwargs)[0]
            except Exception:
                continue
            tags = _tags_around(full, gen, triggers)
            if tags is not None and _reads_back(full, gen, tags):
                return tags
    try:
        plain = template.render(probe.user, probe.tools, add_generation_prompt=True)[0]
        on = template.render(probe.user, probe.tools, add_generation_prompt=True, kwargs=THINKING_ON[1])[0]
    except Exception:
        return None
    if on != plain:
        opened = _prompt_tag(on)
        close = _close_of(opened)
        if opened and close and close in template.source:
            return opened, close
    return None


def empty_thinking_block(template: ChatTemplate, tags: tuple[str, str] | None) -> str:
    """The empty thinking block the template writes before a plain reply (`<think></think>`, or MiniMax-M3's bare
    `</mm:think>`), when the reply (not the prompt) opens it; "" for none."""
    if tags is None:
        return ""
    try:
        pre = Probe(template).pre
    except Exception:
        return ""
    block = pre.strip(WS)
    if block == tags[1]:
        return block
    if block.startswith(tags[0]) and block.endswith(tags[1]) and not block[len(tags[0]) : -len(tags[1])].strip(WS):
        return pre.lstrip(WS) if pre.lstrip(WS).startswith(tags[0]) else block
    return ""


def _reads_back(full: str, gen: str, tags: tuple[str, str]) -> bool:
    """The thinking of the rendered turn is read back from the text the model writes after the prompt."""
    shared = lcp(full, gen)
    text = full[shared if shared == len(gen) else boundary(full, shared) :]
    spec = OutputSpec(reasoning=tags, in_reasoning=gen.rstrip(WS).endswith(tags[0]))
    parser = spec.parser()
    parser.feed(text)
    parser.finish()
    return (parser.reasoning_text or "").strip(WS) == REASONING


def _tags_around(full: str, gen: str, triggers: tuple[str, ...]) -> tuple[str, str] | None:
    if REASONING not in full:
        return None
    i = full.index(REASONING) + len(REASONING)
    ends = [full.find(m, i) for m in (CONTENT, *triggers) if m and full.find(m, i) >= 0]
    if not ends:
        return None
    close = full[i : min(ends)].strip(WS)
    if not close:
        return None
    before = full[: i - len(REASONING)]
    shared = lcp(before, gen)
    written = before[shared if shared == len(gen) else boundary(before, shared) :].strip(WS)
    head = before.rstrip(WS)
    opened = _open_of(close)
    if opened and opened in head[-200:]:
        return head[head.rindex(opened) :], close  # (`<|channel>thought`: the open tag and what follows it)
    if written:
        return written, close
    if gen.startswith(before) and gen[len(before) :].strip(WS):  # (the prompt opens it: Apriel's "Here are my ...")
        return gen[len(before) :].strip(WS), close
    opened = _prompt_tag(gen)
    return (opened, close) if opened else None


TAG = re.compile(r"<\|[^|<>]*\|>|<[^<>]*>|\[[^\[\]]*\]")
SWAPS = (("</", "<"), ("[/", "["), ("close", "open"), ("END", "START"), ("end", "begin"), ("End", "Begin"))
PIPE_SWAP = re.compile(r"^<([^|<>]+)\|>$")  # Gemma 4's `<channel|>` closes `<|channel>`


def _open_of(close: str) -> str:
    """The open tag a close tag answers (`</think>`, `[/THINK]`, `<|END_THINKING|>`, `<|close|>think<|sep|>`): its
    first tag, or first tags up to the next tag, with the closing word made an opening one."""
    m = TAG.match(close)
    if not m:
        return ""
    head = close[: m.end()]
    rest = TAG.search(close, m.end())
    if rest and close[m.end() : rest.start()].strip(WS) and "close" in head:  # `<|close|>think<|sep|>`
        head = close[: rest.end()]
    for old, new in SWAPS:
        if old in head:
            return head.replace(old, new, 1)
    m = PIPE_SWAP.match(head)
    return f"<|{m.group(1)}>" if m else ""


def _close_of(opened: str) -> str:
    if opened.startswith("<") and not opened.startswith("</") and not opened.startswith("<|"):
        return "</" + opened[1:]
    if opened.startswith("[") and not opened.startswith("[/"):
        return "[/" + opened[1:]
    return ""


def _prompt_tag(gen: str) -> str:
    """The tag the generation prompt ends with (a template that opens the thinking itself)."""
    m = re.search(r"(<[^<>\n]+>|\[[^\[\]\n]+\])\s*$", gen)
    return m.group(1) if m else ""
