"""Chat templates: the model's Jinja template rendered the way llama-server's `--jinja` does, or a built-in one.

A template sees `messages` (OpenAI-shaped dicts: only the fields a message has, `tool_calls` as
`{id, type: "function", function: {name, arguments}}` with the arguments as an object), `tools` (OpenAI-shaped
function tools, or undefined), `add_generation_prompt`, `bos_token`, `eos_token`, today as `date_string`
("23 Nov 2026") and `datetime` ("Nov 23 2026") as llama-server passes them, the functions
`raise_exception(message)` and `strftime_now(format)`, and the request's `chat_template_kwargs` (which win).

`tojson` writes what Python's `json.dumps` writes (`", "` and `": "`, non-ASCII kept), as the templates
expect, except that a tool call's arguments are written exactly as the model wrote them (`RawJSON`): the
history an agent sends back then renders to the very text the model produced, and the next turn reuses
its KV whole.

What the vendored templates need beyond plain Jinja, as Hugging Face's and llama-server's renderers give it: HF's
`{% generation %}` block (rendered as its body), the list and dict methods templates call (`list.append`,
`dict.update`: a sandbox that lets a template change its own values, not the host's), `functions` (the tools as
JSON text, which FireFunction's template reads), and a call's arguments as a JSON string for the templates that
write them as text (functionary's `'...' + arguments`), found by rendering a probe call once.
"""

from __future__ import annotations

import datetime
import json
import re
import types
import uuid
from pathlib import Path
from typing import Any

from chat.limits import Deadline, DeadlinePassed

BUILTIN: dict[str, str] = {
    # Gemma's turns; Gemma has no system role: system text opens the next user turn. Tool results are user turns.
    "gemma": (
        "{%- set ns = namespace(system='') -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}{%- set ns.system = ns.system + m.content + '\\n\\n' -%}"
        "{%- else -%}"
        "{%- set role = 'model' if m.role == 'assistant' else 'user' -%}"
        "{%- set content = m.content -%}"
        "{%- if role == 'user' and ns.system -%}{%- set content = ns.system + content -%}{%- set ns.system = '' -%}{%- endif -%}"
        "{{- '<start_of_turn>' + role + '\\n' + content + '<end_of_turn>\\n' -}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if ns.system -%}{{- '<start_of_turn>user\\n' + ns.system.rstrip() + '<end_of_turn>\\n' -}}{%- endif -%}"
        "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
    ),
    "chatml": (
        "{%- for m in messages -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
    ),
}


class TemplateError(ValueError):
    """The messages cannot be rendered: the template raised (its message is quoted) or failed."""


class RawJSON(dict[str, Any]):
    """A JSON object that remembers its text: templates read it as a mapping, `tojson` writes the text."""

    def __init__(self, raw: str) -> None:
        value = json.loads(raw)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        super().__init__(value)
        self.raw = raw

    @classmethod
    def cut(cls, raw: str) -> RawJSON:
        """Arguments that are not a JSON object, as a client sends back a call cut off at max_tokens: an empty mapping
        for templates that read them, the text as written for `tojson` (so the prompt holds what the model wrote)."""
        obj = cls("{}")
        obj.raw = raw
        return obj


def tojson(
    value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False, ensure_ascii: bool = False
) -> str:
    """Jinja's `tojson` as chat templates expect it (no HTML escaping); RawJSON objects keep their own text."""
    raws: dict[str, str] = {}

    def mark(v: Any) -> Any:
        if isinstance(v, RawJSON):
            key = f"\x00raw{uuid.uuid4().hex}\x00"
            raws[json.dumps(key)] = v.raw
            return key
        if isinstance(v, dict):
            return {k: mark(x) for k, x in v.items()}
        if isinstance(v, list | tuple | types.GeneratorType):  # (`map` and `select` filters give generators)
            return [mark(x) for x in v]
        return v

    marked = mark(value)
    text = json.dumps(marked, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    if not raws:
        return text
    # one pass for all of them (a replace per object was quadratic in a history of many tool calls)
    return RAW_MARK.sub(lambda m: raws.get(m.group(0), m.group(0)), text)


RAW_MARK = re.compile(r'"\\u0000raw[0-9a-f]{32}\\u0000"')  # a marked RawJSON's key as json.dumps writes it


def _generation_tag() -> Any:
    """HF's `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for training): its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


def _environment() -> Any:
    from jinja2.ext import do, loopcontrols
    from jinja2.sandbox import SandboxedEnvironment

    class Environment(SandboxedEnvironment):
        """Every value a template reads checks the running deadline now and then (chat/limits.py)."""

        def getattr(self, obj: Any, attribute: str) -> Any:
            Deadline.read()
            return super().getattr(obj, attribute)

        def getitem(self, obj: Any, argument: Any) -> Any:
            Deadline.read()
            return super().getitem(obj, argument)

    extensions = [loopcontrols, do, _generation_tag()]
    env = Environment(trim_blocks=True, lstrip_blocks=True, extensions=extensions)

    def raise_exception(message: str) -> None:
        raise TemplateError(str(message))

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """One compiled chat template. `source` is its Jinja text; `name` says where it came from."""

    def __init__(self, source: str, name: str, *, bos_text: str = "", eos_text: str = "") -> None:
        self.source, self.name = source, name
        self.bos_text, self.eos_text = bos_text, eos_text
        try:
            self._jinja = _environment().from_string(source)
        except Exception as exc:  # a syntax error: the template (a flag, or the GGUF) cannot be used at all
            raise ValueError(f"chat template {name} does not compile: {type(exc).__name__}: {exc}") from None
        self.system_role = self._takes_system()
        self.late_system = self.system_role and self._takes_late_system()
        self.several_system = self.system_role and self._takes_several_system()
        self.string_arguments = self._takes_string_arguments()

    @classmethod
    def choose(
        cls, gguf: str | None, override: str | None, fallback: str, *, bos_text: str = "", eos_text: str = ""
    ) -> ChatTemplate:
        """The template to use: `override` (a built-in name or a file), else the GGUF's, else built-in `fallback`.
        Raises ValueError naming what cannot be used."""
        if override:
            if override in BUILTIN:
                return cls(BUILTIN[override], override, bos_text=bos_text, eos_text=eos_text)
            path = Path(override)
            try:
                source = path.read_text(encoding="utf-8")
            except OSError as exc:
                raise ValueError(
                    f"--chat-template {override!r} is neither a built-in ({', '.join(sorted(BUILTIN))}) nor a readable file:"
                    f" {exc.strerror}"
                ) from None
            except UnicodeDecodeError:
                raise ValueError(f"--chat-template {override!r} is not UTF-8 text") from None
            return cls(source, f"file:{path.name}", bos_text=bos_text, eos_text=eos_text)
        if gguf:
            return cls(gguf, "gguf", bos_text=bos_text, eos_text=eos_text)
        if fallback not in BUILTIN:
            raise ValueError(f"unknown chat format {fallback!r}; built-in: {sorted(BUILTIN)}")
        return cls(BUILTIN[fallback], fallback, bos_text=bos_text, eos_text=eos_text)

    def _takes_system(self) -> bool:
        """Whether the template renders a system message (Gemma 2's raises, some drop it): probed once."""
        probe = "\x01system-probe\x01"
        try:
            text = self._render([{"role": "system", "content": probe}, {"role": "user", "content": "u"}], None, True, {})
        except Exception:
            return False
        return probe in text

    def _takes_late_system(self) -> bool:
        """Whether the template renders a system message after the conversation began where it stands (Gemma's and
        others raise on it, or drop it): probed once. One that holds it back for the next user message (kvroute's
        built-in gemma) is folded too: Claude Code sends one after its first user message, and held back it would
        render after the model's reply on the next request, so no request of a turn could reuse the one before."""
        probe, reply = "\x01late-system-probe\x01", "\x01reply-probe\x01"
        msgs = [{"role": "user", "content": "u"}, {"role": "system", "content": probe},
                {"role": "assistant", "content": reply}, {"role": "user", "content": "v"}]  # fmt: skip
        try:
            text = self._render(msgs, None, True, {})
        except Exception:
            return False
        return probe in text and reply in text and text.index(probe) < text.index(reply)

    def _takes_several_system(self) -> bool:
        """Whether the template renders two system messages at the start (Qwen 3.5's raises "System message must be at
        the beginning." at the second; Codex sends two developer messages): probed once."""
        probes = "\x01first-system-probe\x01", "\x01second-system-probe\x01"
        msgs = [{"role": "system", "content": p} for p in probes] + [{"role": "user", "content": "u"}]
        try:
            text = self._render(msgs, None, True, {})
        except Exception:
            return False
        return all(p in text for p in probes)

    def _takes_string_arguments(self) -> bool:
        """Whether the template writes a call's arguments as text (`'...' + arguments`) and fails on an object, where
        it renders the same call given its arguments as a JSON string: probed once."""
        probe = '{"probe_arg": "args-probe-value"}'

        def call(arguments: Any) -> list[dict[str, Any]]:
            c = {"id": "call00001", "type": "function", "function": {"name": "probe_tool", "arguments": arguments}}
            return [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [c]}]

        tools = [{"type": "function", "function": {"name": "probe_tool", "description": "", "parameters": {"type": "object"}}}]
        try:
            self._render(call(RawJSON(probe)), tools, False, {})
            return False
        except Exception:
            pass
        try:
            return "args-probe" in self._render(call(probe), tools, False, {})
        except Exception:
            return False

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool, kwargs: dict[str, Any]
    ) -> str:
        today = datetime.datetime.now()
        context: dict[str, Any] = {"date_string": today.strftime("%d %b %Y"), "datetime": today.strftime("%b %d %Y")}
        context.update(kwargs)
        context.update(messages=messages, add_generation_prompt=gen)
        context.setdefault("bos_token", self.bos_text)
        context.setdefault("eos_token", self.eos_text)
        if tools is not None:
            context["tools"] = tools
        functions = json.dumps([t.get("function", t) for t in tools], indent=2, ensure_ascii=False) if tools else ""
        context.setdefault("functions", functions)
        return str(self._jinja.render(**context))

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, bool]:
        """(prompt text, whether the tokenizer should add BOS: not when the template wrote it).

        System messages are folded into the first user message when the template does not take them (as
        llama-server does), and those after the first non-system message when it takes them only first (Claude Code
        and Codex put some there); the ones at the start become one where the template takes a single one (Codex's
        two developer messages). Raises TemplateError quoting the template's own message."""
        if self.string_arguments:
            messages = string_arguments(messages)
        if not self.system_role:
            messages = fold_system(messages)
        else:
            if not self.several_system:
                messages = merge_leading_system(messages)
            if not self.late_system:
                messages = fold_late_system(messages)
        try:
            text = self._render(messages, tools, add_generation_prompt, kwargs or {})
        except (TemplateError, DeadlinePassed):
            raise
        except Exception as exc:  # a template error is the request's problem, not the router's
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        starts_with_bos = bool(self.bos_text) and text.startswith(self.bos_text)
        return text, not starts_with_bos


def string_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every call's arguments as the JSON text the model wrote (for templates that write them as text)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                args = c["function"]["arguments"]
                calls.append({**c, "function": {**c["function"], "arguments": getattr(args, "raw", args)}})
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages prepended (blank line between) to the next user message's content."""
    out: list[dict[str, Any]] = []
    pending = ""
    for m in messages:
        if m["role"] == "system":
            pending += str(m.get("content") or "") + "\n\n"
            continue
        if pending and m["role"] == "user":
            m = {**m, "content": pending + str(m.get("content") or "")}
            pending = ""
        out.append(m)
    if pending:
        out.append({"role": "user", "content": pending.rstrip()})
    return out


def merge_leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The system messages before the conversation's first other message, as one (their texts joined by a blank line)."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    if head < 2:
        return messages
    text = "\n\n".join(str(m.get("content") or "") for m in messages[:head])
    return [{**messages[0], "content": text}, *messages[head:]]


def fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System messages after the conversation began, folded in order into a neighbouring user message: the one just
    before when it is a user message (appended), else the next one (prepended); a user message of their own where
    neither is."""
    head = 0
    while head < len(messages) and messages[head]["role"] == "system":
        head += 1
    out: list[dict[str, Any]] = list(messages[:head])
    pending = ""
    for m in messages[head:]:
        if m["role"] == "system":
            text = str(m.get("content") or "")
            if not pending and out and out[-1]["role"] == "user" and len(out) > head:
                out[-1] = {**out[-1], "content": f"{out[-1].get('content') or ''}\n\n{text}"}
            else:
                pending += text + "\n\n"
            continue
        if pending and m["role"] == "user":
            m = {**m, "content": pending + str(m.get("content") or "")}
            pending = ""
        elif pending:
            out.append({"role": "user", "content": pending.rstrip()})
            pending = ""
        out.append(m)
    if pending:
        out.append({"role": "user", "content": pending.rstrip()})
    return out
