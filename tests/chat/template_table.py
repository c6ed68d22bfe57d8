"""What kvroute makes of each chat template llama.cpp vendors (tests/fixtures/templates, copied from the pinned sdist):
one row per template, computed with no model. `python tests/chat/template_table.py` writes the table to
tests/fixtures/templates/TABLE.md (which tests/chat/test_template_table.py holds the code to).

For each template: the family detected; whether it renders tool calls, and whether the parser reads them back from the
text the template writes for the assistant's turn (two calls, or one where the template takes one); whether the
arguments stream (a call's head goes out before its arguments end); whether it renders `reasoning_content`, and whether
the parser reads that back; and whether the next turn's prompt (the turn as read, then the tool results) starts with
this turn's prompt and the model's text, which is what lets the slot reuse its KV whole.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from chat.output_parser import OutputParser  # noqa: E402
from chat.request import ChatFormat, calls_into_content  # noqa: E402
from chat.template import ChatTemplate  # noqa: E402
from chat.template_probes import CONTENT, IDS, NAMES, REASONING, Probe, boundary, lcp, turn  # noqa: E402
from protocol import ChatMessage, Submit, Tool, ToolCall  # noqa: E402

TEMPLATES = ROOT / "tests" / "fixtures" / "templates"
THINKING = {"enable_thinking": True, "thinking": True, "reasoning_effort": "high"}  # (Qwen 3, GLM, DeepSeek V3.1, Hy3)
TOOL_ARGS = [{"path": "a.py", "content": "print('hi')\nprint(2)", "lines": 2}, {"query": "kv cache"}]
TOOLS = [
    Tool(name=NAMES[0], parameters={"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                                                     "lines": {"type": "integer"}}}),
    Tool(name=NAMES[1], parameters={"type": "object", "properties": {"query": {"type": "string"}}}),
]  # fmt: skip


@dataclass
class Row:
    name: str
    family: str = ""
    renders: bool = False
    calls: str = "-"  # "-": the template writes no calls; "read" | "not read"
    streamed: str = "-"
    reasoning: str = "-"  # "-": the template writes no reasoning; "read" | "not read"
    reuse: str = "-"  # the next turn's prompt extends this turn's prompt and the model's text: "yes" | "no"
    note: str = ""

    def cells(self) -> list[str]:
        return [self.name, self.family, "yes" if self.renders else "NO", self.calls, self.streamed, self.reasoning, self.reuse]


def names() -> list[str]:
    return sorted(p.stem for p in TEMPLATES.glob("*.jinja"))


def template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), name, bos_text="<s>", eos_text="</s>")


def family_label(fmt: ChatFormat) -> str:
    key = fmt.family.key
    if key.startswith("derived:"):
        s = json.loads(key[len("derived:") :])
        lead = (s["section_open"] + s["call_open"]).strip()
        lead = lead.replace("\n", "\\n").replace("|", "\\|")
        return f"derived{' tagged' if s['tagged'] else ''} `{lead[:30]}`"
    return key


def row(name: str) -> Row:
    r = Row(name)
    try:
        fmt = ChatFormat(template(name))
        fmt.prepare(Submit(messages=[ChatMessage(role="user", content="hi")]))
    except Exception as exc:
        r.note = f"{type(exc).__name__}: {exc}"[:120]
        return r
    r.renders, r.family = True, family_label(fmt)
    user = [ChatMessage(role="user", content="userprobe")]
    first = fmt.prepare(Submit(messages=user, tools=TOOLS))
    probe = Probe(fmt.template)

    calls = [(NAMES[0], TOOL_ARGS[0]), (NAMES[1], TOOL_ARGS[1])]
    text = model_text(probe, first.text, turn(calls), first.output)
    if text is None or NAMES[1] not in text:  # (a template that takes, or writes, one call per turn)
        calls = calls[:1]
        text = model_text(probe, first.text, turn(calls), first.output)
    if text is not None and NAMES[0] in text:
        parser = first.output.parser()
        pieces = [d for ch in text for d in parser.feed(ch).calls] + parser.finish().calls
        got = parser.tool_calls
        ok = [(c.name, _loads(c.arguments)) for c in got] == calls
        r.calls = "read" if ok else "not read"
        heads = [i for i, d in enumerate(pieces) if d.name is not None]
        r.streamed = "yes" if ok and len(pieces) > len(heads) + 2 else "no"
        if ok:
            r.reuse = "yes" if extends(fmt, user, first.text, text, parser) else "no"

    thinking = fmt.prepare(Submit(messages=user, tools=TOOLS, chat_template_kwargs=THINKING))  # (switched on)
    thought = {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING}
    if fmt.thinking_field:  # (gpt-oss reads past thinking as `thinking`, as ChatFormat gives it)
        thought["thinking"] = REASONING
    plain = model_text(probe, thinking.text, thought, thinking.output, THINKING)
    with_call = model_text(probe, thinking.text, {**turn(calls[:1], CONTENT), "reasoning_content": REASONING},
                           thinking.output, THINKING)  # fmt: skip
    said = next((t for t in (plain, with_call) if t is not None and REASONING in t), None)
    if said is not None:
        parser = thinking.output.parser()
        parser.feed(said)
        parser.finish()
        ok = (parser.reasoning_text or "").strip() == REASONING and (CONTENT in parser.text or bool(parser.tool_calls))
        r.reasoning = "read" if ok else "not read"
    return r


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def model_text(
    probe: Probe, prompt: str, message: dict[str, Any], spec: Any = None, kwargs: dict[str, Any] | None = None
) -> str | None:
    """What the model writes for `message` after `prompt`: the template's rendering of the turn past what the prompt
    already holds, without the turn's end (None when the template refuses the turn). Where the prompt opened the
    thinking and the rendered turn has none (the template drops it), the model's text starts by closing it. Where the
    template renders no calls (LFM2-8B-A1B), they are in the content, as kvroute writes them there."""
    tools = probe_tools() if probe.tools is not None else None
    if spec is not None and spec.family is not None and spec.family.in_content:
        message = calls_into_content([message], spec.family, spec.reasoning)[0]
    try:
        full = probe.t.render([*probe.user, message], tools, add_generation_prompt=False, kwargs=kwargs)[0]
    except Exception:
        return None
    if full.startswith(prompt):
        text = full[len(prompt) :]
    else:
        shared = boundary(full, lcp(full, prompt))
        text = full[shared:]
        close = spec.reasoning[1] if spec is not None and spec.reasoning else None
        if close and prompt.rstrip().endswith(close) and text.lstrip().startswith(close):
            text = text.lstrip()[len(close) :]  # (the prompt closed the thinking already)
    if probe.end and text.endswith(probe.end):
        text = text[: -len(probe.end)]
    if spec is not None and spec.in_reasoning and spec.reasoning and spec.reasoning[1] not in text:
        text = spec.reasoning[1] + "\n\n" + text  # (the template keeps no thinking: the model ends its own)
    return text


def probe_tools() -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": t.name, "description": "", "parameters": t.parameters}} for t in TOOLS]


def extends(fmt: ChatFormat, user: list[ChatMessage], prompt: str, text: str, parser: OutputParser) -> bool:
    """Whether the next turn (the calls as read, their results) starts with this prompt and the model's text."""
    calls = [ToolCall(id=c.id or IDS[k], name=c.name, arguments=c.arguments) for k, c in enumerate(parser.tool_calls)]
    reply = ChatMessage(role="assistant", content=parser.text or None, tool_calls=calls,
                        reasoning_content=parser.reasoning_text)  # fmt: skip
    results = [ChatMessage(role="tool", tool_call_id=c.id, content="ok") for c in calls]
    try:
        following = fmt.prepare(Submit(messages=[*user, reply, *results], tools=TOOLS)).text
    except Exception:
        return False
    return following.startswith(prompt + text.rstrip()) or following.startswith(prompt + text)


def table() -> list[Row]:
    return [row(n) for n in names()]


def markdown(rows: list[Row]) -> str:
    head = ["template", "family", "renders", "calls", "args streamed", "reasoning", "turn 2 extends turn 1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(lines)


TABLE = TEMPLATES / "TABLE.md"
HEADER = """# What kvroute makes of each vendored chat template

Written by `.venv/bin/python tests/chat/template_table.py` (no model); tests/chat/test_template_table.py checks it is
current. One row per template of llama.cpp's `models/templates/` in the pinned sdist: the tool-call family detected
(hand-written, `derived` from renderings of probe calls, or `generic`: no tool syntax, so tools are shown only where a
call is required or with `--generic-tools`, described in a system message, the reply a JSON document); whether the
template renders (`renders`); for templates that write calls, whether kvroute reads back the calls the template writes
(two, or one where it takes one) and streams their arguments while they are written; for templates that write
`reasoning_content` (thinking switched on), whether it reads that back; and whether the next turn's prompt (the calls
as read, then their results) starts with this turn's prompt and the model's text, so that the slot reuses its KV whole
(`no` where the template writes the turn otherwise in the history than the model wrote it, such as dropping the
thinking it opened).

"""


def write() -> str:
    return HEADER + markdown(table()) + "\n"


if __name__ == "__main__":
    TABLE.write_text(write())
    print(TABLE)
