"""A template's tool-call syntax and thinking tags, derived by rendering probe messages and comparing the texts (as
llama.cpp's chat-diff-analyzer does), so that a template nobody listed is read and written too.

The probes are assistant turns with known names, keys and values (one call, three calls, two parameters, none, each
JSON type); what the template writes between them are the syntax's literal pieces (chat/derived.py). A syntax is
kept only when it writes every probe exactly as the template does and reads each back to the same calls: else the
hand-written families (chat/families.py) or the generic JSON document serve the template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from chat.calls import WS
from chat.derived import TYPES, DerivedFamily, Syntax
from chat.families import Family, Gemma, Generic, Hermes, Llama3, Mistral, MistralArgs
from chat.minimax_xml import MinimaxXml
from chat.pythonic import Pythonic
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


# ---- pieces --------------------------------------------------------------------------------------------------------


def unify(texts: list[str], indices: list[int]) -> tuple[str, int] | None:
    """One piece for the texts written before or after calls `indices`: equal texts, or texts that differ only in a
    number that counts the calls (a `{index}` slot, with its base)."""
    if all(t == texts[0] for t in texts):
        return texts[0], 0
    runs = [re.split(r"(\d+)", t) for t in texts]
    if any(len(r) != len(runs[0]) for r in runs):
        return None
    out, base = [], None
    for j, chunk in enumerate(runs[0]):
        column = [r[j] for r in runs]
        if j % 2 == 0 or all(c == column[0] for c in column):
            if any(c != column[0] for c in column):
                return None
            out.append(chunk)
            continue
        offsets = {int(c) - k for c, k in zip(column, indices, strict=True)}
        if len(offsets) != 1:
            return None
        b = offsets.pop()
        if base is not None and b != base:
            return None
        base = b
        out.append("{index}")
    return "".join(out), base or 0


def with_ids(text: str) -> str:
    for call_id in IDS:
        text = text.replace(call_id, "{id}")
    return text


def fill(piece: str, k: int, base: int) -> str:
    return piece.replace("{index}", str(k + base)).replace("{id}", IDS[k])


@dataclass
class Found:
    """Where the probe names, keys and values sit in a rendered section."""

    text: str
    names: list[tuple[int, int]]  # (start, end) of each call's name


def locate(text: str, names: tuple[str, ...]) -> list[tuple[int, int]] | None:
    out, at = [], 0
    for n in names:
        i = text.find(n, at)
        if i < 0:
            return None
        out.append((i, i + len(n)))
        at = i + len(n)
    return out


def json_span(text: str, start: int, args: dict[str, Any]) -> tuple[int, int] | None:
    """The span of the JSON object `args` written after text[start]."""
    decoder = json.JSONDecoder()
    i = text.find("{", start)
    while i >= 0:
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            value, end = None, i
        if value == args:
            return i, end
        i = text.find("{", i + 1)
    return None


SLOT = re.compile(r"\{(?:id|index)\}")


def split_sep(x: str, csco: str, base: int) -> tuple[str, str, str] | None:
    """(section_open, call_sep, call_open) from the text before the first call's name and the text between calls."""
    for s in range(len(csco) + 1):
        co = csco[s:]
        if any(m.start() < s < m.end() for m in SLOT.finditer(csco)):
            continue  # (a slot is not cut)
        filled = co.replace("{index}", str(base))  # (ids are slots on both sides already)
        if x.endswith(filled):
            return x[: len(x) - len(filled)], csco[:s], co
    return None


def section_pieces(x: str, e_t: str, c: str, base: int) -> tuple[str, str, str, str, str] | None:
    """(section_open, call_open, call_close, call_sep, section_close) from: the text before the first call's name (x),
    between a call's arguments and the next call's name (e_t, slots in), after the last call's arguments (c)."""
    cc = e_t[: boundary(e_t, lcp(SLOT.split(e_t)[0], c))]
    sc, csco = c[len(cc) :], e_t[len(cc) :]
    got = split_sep(x, csco, base)
    if got is None:
        return None
    so, cs, co = got
    return so, co, cc, cs, sc


# ---- derivation ----------------------------------------------------------------------------------------------------


def derive_syntax(template: ChatTemplate) -> Syntax | None:
    """The template's call syntax, or None when the probes do not show one (no tool calls rendered, another shape)."""
    try:
        probe = Probe(template)
    except Exception:  # (a template that renders no plain assistant turn)
        return None
    three = [(NAMES[k], {KEYS[0]: VALUES[k]}) for k in range(3)]
    r3 = probe.reply(turn(three))
    if r3 is None or locate(r3, NAMES) is None:
        return _single_syntax(probe, three[0])
    r3 = with_ids(r3)
    spots = locate(r3, NAMES)
    assert spots is not None
    spans = [json_span(r3, spots[k][1], three[k][1]) for k in range(3)]
    try:
        json_args = all(spans)
        syntax = _json_syntax(r3, spots, spans) if json_args else _tagged_syntax(probe, r3, spots)  # type: ignore[arg-type]
    except (ValueError, IndexError, KeyError):
        return None
    if syntax is None or not syntax.call_open + syntax.section_open:
        return None
    if syntax.tagged:
        syntax = replace(syntax, string_wrap=string_wrap(probe, syntax))
    syntax = own_trigger(probe, syntax)
    return syntax if verified(probe, syntax) else None


def _single_syntax(probe: Probe, call: tuple[str, dict[str, Any]]) -> Syntax | None:
    """A template that writes one call per turn (GigaChat 3): a JSON call read from one probe."""
    r1 = probe.reply(turn([call]))
    if r1 is None or call[0] not in r1:
        return None
    r1 = with_ids(r1)
    at = r1.index(call[0])
    span = json_span(r1, at + len(call[0]), call[1])
    if span is None:
        return None
    syntax = own_trigger(probe, Syntax("", r1[:at], r1[at + len(call[0]) : span[0]], r1[span[1] :], "", "", single=True))
    return syntax if syntax.call_open.strip(WS) and verified(probe, syntax) else None


def own_trigger(probe: Probe, syntax: Syntax) -> Syntax:
    """A section that opens with the turn's end marker (GigaChat 3's `<|message_sep|>`, then the call's own message)
    is triggered by the marker and what follows it through its last tag: the marker alone ends every plain reply."""
    lead, mark = (syntax.section_open + syntax.call_open).lstrip(WS), probe.end.strip(WS)
    last = lead.rfind(">") + 1
    if not mark or not lead.startswith(mark) or last <= len(mark):
        return syntax
    return replace(syntax, trigger=lead[:last])


WRAP_CHARS = "<>&\n\"'"


def string_wrap(probe: Probe, syntax: Syntax) -> tuple[str, ...]:
    """(open, close, characters): the template writes a string holding one of the characters between open and close
    (MiniCPM 5's CDATA); () when it writes every string as it is."""
    wrap: tuple[str, str] | None = None
    chars = ""
    for c in WRAP_CHARS:
        value = VALUES[0] + c + VALUES[1]
        text = probe.reply(turn([(NAMES[0], {KEYS[0]: value})]))
        at = text.find(value) if text is not None else -1
        if text is None or at < 0:
            return ()
        start = text.find(syntax.key_close["string"], text.find(KEYS[0])) + len(syntax.key_close["string"])
        end = text.find(syntax.value_close, at + len(value))
        around = (text[start:at], text[at + len(value) : end])
        if around == ("", ""):
            continue
        if wrap not in (None, around) or end < 0:
            return ()
        wrap, chars = around, chars + c
    return (*wrap, chars) if wrap else ()


def _json_syntax(r3: str, spots: list[tuple[int, int]], spans: list[tuple[int, int]]) -> Syntax | None:
    x = r3[: spots[0][0]]
    ncs = unify([r3[spots[k][1] : spans[k][0]] for k in range(3)], [0, 1, 2])
    es = unify([r3[spans[k][1] : spots[k + 1][0]] for k in range(2)], [1, 2])
    if ncs is None or es is None:
        return None
    (nc, base), (e_t, base2) = ncs, es
    if "{index}" in nc and "{index}" in e_t and base != base2:
        return None
    base = base if "{index}" in nc else base2
    pieces = section_pieces(x, e_t, r3[spans[2][1] :], base)
    if pieces is None:
        return None
    so, co, cc, cs, sc = pieces
    return Syntax(so, co, nc, cc, cs, sc, index_base=base)


def _tagged_syntax(probe: Probe, r3: str, spots: list[tuple[int, int]]) -> Syntax | None:
    """Tagged parameters: the pieces around keys and values, then the section's."""
    keyed = [_key_value(r3, spots[k][1], KEYS[0], VALUES[k]) for k in range(3)]
    if any(kv is None for kv in keyed):
        return None
    kv = [k for k in keyed if k is not None]
    x = r3[: spots[0][0]]
    a = unify([r3[spots[k][1] : kv[k][0]] for k in range(3)], [0, 1, 2])  # name_close + key_open
    kc = r3[kv[0][1] : kv[0][2]]
    e = unify([r3[kv[k][3] : spots[k + 1][0]] for k in range(2)], [1, 2])  # value_close + call_close + call_sep + call_open
    c = r3[kv[2][3] :]  # value_close + call_close + section_close
    two = probe.reply(turn([(NAMES[0], {KEYS[0]: VALUES[0], KEYS[1]: VALUES[1]})]))
    zero = probe.reply(turn([(NAMES[0], {})]))
    if a is None or e is None or two is None or zero is None:
        return None
    two = with_ids(two)
    i = two.find(VALUES[0]) + len(VALUES[0])
    b = two[i : two.find(KEYS[1], i)]  # value_close + key_open
    zero = with_ids(zero)
    d = zero[zero.find(NAMES[0]) + len(NAMES[0]) :]  # name_close + call_close + section_close
    (a_t, base) = a
    (e_t, _) = e
    for n in range(lcs(a_t, b), -1, -1):
        ko, vc, nc = b[len(b) - n :], b[: len(b) - n], a_t[: len(a_t) - n]
        empty = squeeze(nc.replace("{index}", str(base)) + c[len(vc) :]) == squeeze(d)  # (a call with no parameters)
        if not vc or not c.startswith(vc) or not empty or not e_t.startswith(vc):
            continue
        pieces = section_pieces(x, e_t[len(vc) :], c[len(vc) :], base)
        if pieces is None:
            continue
        so, co, cc, cs, sc = pieces
        closes, python = _key_closes(probe, kc)
        if closes is None:
            return None
        return Syntax(so, co, nc, cc, cs, sc, index_base=base, tagged=True, key_open=ko, key_close=closes,
                      value_close=vc, python_values=python)  # fmt: skip
    return None


def _key_value(text: str, start: int, key: str, value: str) -> tuple[int, int, int, int] | None:
    """(key start, key end, value start, value end) after text[start]."""
    k = text.find(key, start)
    if k < 0:
        return None
    v = text.find(value, k + len(key))
    if v < 0:
        return None
    return k, k + len(key), v, v + len(value)


def _key_closes(probe: Probe, string_close: str) -> tuple[dict[str, str] | None, tuple[str, ...]]:
    """The key close of each JSON type, and the types the template writes as Python does."""
    closes, python = {"string": string_close}, []
    for kind in TYPES[1:]:
        sample = SAMPLES[kind]
        text = probe.reply(turn([(NAMES[0], {KEYS[0]: sample})]))
        if text is None:
            return None, ()
        k = text.find(KEYS[0]) + len(KEYS[0])
        rest = text[k:]
        for written, is_python in ((json.dumps(sample), False), (str(sample), True)):
            at = rest.find(written)
            if at >= 0:
                closes[kind] = rest[:at]
                if is_python and written != json.dumps(sample):
                    python.append(kind)
                break
        else:
            return None, ()
    return closes, tuple(python)


# ---- the check ------------------------------------------------------------------------------------------------------

CHECKS: list[list[tuple[str, dict[str, Any]]]] = [  # (a syntax of one call per turn is checked on the single ones)
    [(NAMES[0], {KEYS[0]: "a value\nwith two lines", KEYS[1]: 7}), (NAMES[1], {})],
    [(NAMES[2], {KEYS[1]: 'x <y> & "z"'})],
    [(NAMES[1], {KEYS[0]: "p"}), (NAMES[0], {KEYS[0]: "q", KEYS[1]: "r"}), (NAMES[2], {KEYS[0]: "s"})],
    [(NAMES[0], {f"keyprobe{kind}": SAMPLES[kind] for kind in TYPES})],
]


def check_spec(family: Family, calls: list[tuple[str, dict[str, Any]]]) -> Any:
    """How to read a check turn: its tools, the string parameters its values say."""
    from chat.output import OutputSpec  # (output reads families; this module makes them)

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


# ---- the family of a template ---------------------------------------------------------------------------------------


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
    from chat.harmony import Harmony
    from chat.muse import Muse

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


def family_named(key: str) -> Family:
    """The family whose `key` this is (what a client reading direct replies gets from the router). KeyError if none."""
    if key.startswith("derived:"):
        try:
            return DerivedFamily(Syntax.from_wire(key[len("derived:") :]))
        except (ValueError, TypeError) as exc:
            raise KeyError(f"unreadable derived syntax: {exc}") from None
    made: dict[str, Callable[[], Family]] = {
        "hermes": Hermes,
        "llama3": Llama3,
        "mistral": Mistral,
        "mistral-args": lambda: MistralArgs(call_ids=False),
        "mistral-args+ids": lambda: MistralArgs(call_ids=True),
        "gemma": lambda: Gemma("gemma", "<|tool_call>", "<tool_call|>", '<|"|>'),
        "functiongemma": lambda: Gemma("functiongemma", "<start_function_call>", "<end_function_call>", "<escape>"),
        "generic": Generic,
        "harmony": _harmony,
        "pythonic": Pythonic,
        "minimax-m3": MinimaxXml,
        "muse": _muse,
    }
    return made[key]()


def _muse() -> Family:
    from chat.muse import Muse

    return Muse()


def _harmony() -> Family:
    from chat.harmony import Harmony

    return Harmony()
