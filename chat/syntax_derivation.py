"""A template's tool-call syntax, derived by rendering probe turns (chat/template_probes.py) and comparing the texts,
so that a template nobody listed is read and written too.

What the template writes between the probes' names, keys and values are the syntax's literal pieces
(chat/piece_syntax.py). A syntax is kept only when it writes every check turn exactly as the template does and reads
each back to the same calls (chat/syntax_check.py): else the hand-written families (chat/families.py) or the generic
JSON document serve the template (chat/family_detection.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Any

from chat.calls import WS
from chat.piece_syntax import SLOT, TYPES, Syntax
from chat.syntax_check import verified
from chat.template import ChatTemplate
from chat.template_probes import KEYS, NAMES, SAMPLES, VALUES, Probe, boundary, lcp, lcs, squeeze, turn, with_ids

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
