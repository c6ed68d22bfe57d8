"""Tool-call syntaxes of the model families people run locally, detected from the chat template.

Each family knows three things about its syntax: the text that opens a tool-call section (its trigger), a grammar
(llguidance Lark) for that section built from the request's tools, and how to take complete calls out of the
model's text. The grammars write the section exactly as the family's template renders an assistant message's
`tool_calls`, so a call the model made renders back to the same text when the agent sends it in the history.

| family | syntax (one call) | templates |
| --- | --- | --- |
| hermes | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` | Qwen 2.5 / 3, Hermes 2 / 3, QwQ |
| llama3 | `{"name": "f", "parameters": {...}}` as the whole reply | Llama 3.1 / 3.2 / 3.3 |
| mistral | `[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "abcDEF123"}]` | Mistral Nemo |
| mistral-args | `[TOOL_CALLS]f[ARGS]{...}`, `[CALL_ID]id` before `[ARGS]` if the template has it | Mistral Small 3.2, Devstral |
| gemma | `<\\|tool_call>call:f{key:<\\|"\\|>text<\\|"\\|>,n:3}<tool_call\\|>` | Gemma 4 |
| functiongemma | `<start_function_call>call:f{key:<escape>text<escape>}<end_function_call>` | FunctionGemma |
| generic | the reply is `{"tool_calls": [{"name": "f", "arguments": {...}}]}` or `{"response": "..."}` | the others |

`generic` is for templates without tool syntax (the built-in ones too), as llama-server does. The template knows
nothing of tools there: tools are described in a system message, and calls and tool results are rendered into
the history as the JSON above (chat/request.py `polyfill`).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chat.gemma_args import gemma_grammar, parse_gemma_args
from chat.schema import for_grammar
from protocol import Tool

ALNUM = string.ascii_letters + string.digits
_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the JSON object, as the model wrote it
    id: str | None = None  # where the syntax carries one


def lit(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


def object_schema(tool: Tool) -> dict[str, Any]:
    """The tool's parameters as the JSON Schema of an arguments object, ready for a grammar."""
    schema: dict[str, Any] = dict(tool.parameters) if tool.parameters else {"type": "object", "properties": {}}
    schema.setdefault("type", "object")
    return for_grammar(schema)


def json_args_rule(name: str, tool: Tool) -> str:
    return f"{name}: %json {json.dumps(object_schema(tool), ensure_ascii=False)}\n"


def decode_at(text: str, i: int) -> tuple[Any, int]:
    """The JSON value starting at text[i] (leading whitespace skipped) and the index after it; ValueError if none."""
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return _decoder.raw_decode(text, i)


def object_members(text: str, i: int) -> tuple[dict[str, str], int]:
    """The members of the JSON object at text[i] as raw value texts (exactly as written), and the index after it."""
    value, end = decode_at(text, i)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    raw: dict[str, str] = {}
    j = text.index("{", i) + 1
    for _ in value:
        key, j = decode_at(text, j)
        j = text.index(":", j) + 1
        while text[j] in " \t\r\n":
            j += 1
        _, k = _decoder.raw_decode(text, j)
        raw[key] = text[j:k]
        j = k
        while text[j] in " \t\r\n,":
            j += 1
    return raw, end


def arguments_text(raw: str | None) -> str | None:
    """An arguments value as the text of a JSON object: an object as written, or a string that holds one."""
    if raw is None:
        return None
    value = json.loads(raw)
    if isinstance(value, dict):
        return raw
    if isinstance(value, str):
        inner = json.loads(value)
        return value if isinstance(inner, dict) else None
    return None


def call_from_object(text: str, i: int, args_key: str = "arguments") -> tuple[Call, int]:
    """A `{"name": ..., "arguments": {...}}` object at text[i]. Raises ValueError when it is not one."""
    members, end = object_members(text, i)
    name = json.loads(members["name"]) if "name" in members else None
    args = arguments_text(members.get(args_key, members.get("arguments", members.get("parameters"))))
    if not isinstance(name, str) or args is None:
        raise ValueError("not a call object")
    call_id = json.loads(members["id"]) if "id" in members else None
    return Call(name, args, call_id if isinstance(call_id, str) else None), end


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


class Family:
    """A tool-call syntax. Subclasses set the class attributes and implement `calls_rules` and `split`."""

    name = "base"
    triggers: tuple[str, ...] = ()
    at_start = False  # the section can only open the reply
    native = True  # the template renders tools, tool calls and tool results itself
    id_alphabet = ""  # tool call ids the template accepts: "" = any (ours: call_ + 24 hex)
    id_length = 0

    @property
    def key(self) -> str:
        """Its name on the wire (protocol ReplyFormat.family); `family_named` makes it again."""
        return self.name

    def new_id(self) -> str:
        if self.id_alphabet:
            return "".join(secrets.choice(self.id_alphabet) for _ in range(self.id_length))
        return "call_" + secrets.token_hex(12)

    def calls_rules(self, tools: list[Tool], parallel: bool) -> str:
        """Lark rules defining `calls`: the whole tool-call section, trigger included."""
        raise NotImplementedError

    def split(self, section: str) -> list[tuple[Call, int]]:
        """The complete calls at the start of `section` (which starts with a trigger), each with the index after it
        and its separators; none while the first call is incomplete or the text is no call at all."""
        raise NotImplementedError

    def _named(self, tools: list[Tool], fmt: str) -> str:
        """`fn` alternatives, one per tool: `fmt` with {name} (the name, inside a Lark literal) and {args}."""
        alts, rules = [], []
        for i, tool in enumerate(tools):
            alts.append(fmt.replace("{name}", tool.name).replace("{args}", f"args{i}"))
            rules.append(json_args_rule(f"args{i}", tool))
        return "fn: " + "\n  | ".join(alts) + "\n" + "".join(rules)


class Hermes(Family):
    name = "hermes"
    triggers = ("<tool_call>",)

    def calls_rules(self, tools: list[Tool], parallel: bool) -> str:
        head = 'calls: call ("\\n" call)*\n' if parallel else "calls: call\n"
        call = 'call: "<tool_call>\\n{\\"name\\": \\"" fn "}\\n</tool_call>"\n'
        return head + call + self._named(tools, '"{name}\\", \\"arguments\\": " {args}')

    def split(self, section: str) -> list[tuple[Call, int]]:
        calls: list[tuple[Call, int]] = []
        i = 0
        while True:
            i = skip_ws(section, i)
            if not section.startswith("<tool_call>", i):
                return calls
            close = section.find("</tool_call>", i)
            if close < 0:
                return calls
            body = section[i + len("<tool_call>") : close]
            try:
                call, after = call_from_object(body, 0)
            except (ValueError, KeyError, IndexError):
                return calls
            if body[after:].strip():
                return calls
            i = close + len("</tool_call>")
            calls.append((call, i))


class Llama3(Family):
    name = "llama3"
    triggers = ('{"name": "',)
    at_start = True

    def calls_rules(self, tools: list[Tool], parallel: bool) -> str:
        # the template takes one call per message (it raises on more)
        return 'calls: "{\\"name\\": \\"" fn "}"\n' + self._named(tools, '"{name}\\", \\"parameters\\": " {args}')

    def split(self, section: str) -> list[tuple[Call, int]]:
        try:
            return [call_from_object(section, 0, "parameters")]
        except (ValueError, KeyError, IndexError):
            return []


class Mistral(Family):
    """Mistral Nemo: a JSON list after [TOOL_CALLS]; ids are 9 letters or digits (the template checks)."""

    name = "mistral"
    triggers = ("[TOOL_CALLS]",)
    id_alphabet, id_length = ALNUM, 9

    def calls_rules(self, tools: list[Tool], parallel: bool) -> str:
        more = ' (", " call)*' if parallel else ""
        head = f'calls: "[TOOL_CALLS][" call{more} "]"\n'
        call = 'call: "{\\"name\\": \\"" fn ", \\"id\\": \\"" /[a-zA-Z0-9]{9}/ "\\"}"\n'
        return head + call + self._named(tools, '"{name}\\", \\"arguments\\": " {args}')

    def split(self, section: str) -> list[tuple[Call, int]]:
        calls: list[tuple[Call, int]] = []
        i = skip_ws(section, len("[TOOL_CALLS]"))
        if not section.startswith("[", i):
            return []
        i += 1
        while True:
            try:
                call, i = call_from_object(section, i)
            except (ValueError, KeyError, IndexError):
                return calls
            i = skip_ws(section, i)
            if section.startswith("]", i):
                return [*calls, (call, i + 1)]
            if not section.startswith(",", i):
                return calls  # the list is not closed yet: the call is complete only once its separator is seen
            i += 1
            calls.append((call, i))


class MistralArgs(Family):
    """Mistral Small 3.2, Devstral, Ministral 3: `[TOOL_CALLS]name[ARGS]{...}` per call, `[CALL_ID]id` in between
    where the template has it."""

    name = "mistral-args"
    triggers = ("[TOOL_CALLS]",)
    id_alphabet, id_length = ALNUM, 9

    def __init__(self, call_ids: bool) -> None:
        self.call_ids = call_ids

    @property
    def key(self) -> str:
        return "mistral-args+ids" if self.call_ids else "mistral-args"

    def calls_rules(self, tools: list[Tool], parallel: bool) -> str:
        head = "calls: call+\n" if parallel else "calls: call\n"
        mid = '"[CALL_ID]" /[a-zA-Z0-9]{9}/ "[ARGS]"' if self.call_ids else '"[ARGS]"'
        return head + 'call: "[TOOL_CALLS]" fn\n' + self._named(tools, '"{name}" ' + mid + " {args}")

    def split(self, section: str) -> list[tuple[Call, int]]:
        calls: list[tuple[Call, int]] = []
        i = 0
        while section.startswith("[TOOL_CALLS]", i):
            i += len("[TOOL_CALLS]")
            a = section.find("[ARGS]", i)
            if a < 0:
                return calls
            name, call_id = section[i:a], None
            if "[CALL_ID]" in name:
                name, call_id = name.split("[CALL_ID]", 1)
            try:
                value, j = decode_at(section, a + len("[ARGS]"))
            except ValueError:
                return calls
            if not isinstance(value, dict):
                return calls
            start = skip_ws(section, a + len("[ARGS]"))
            calls.append((Call(name.strip(), section[start:j], call_id), j))
            i = j
        return calls


class Gemma(Family):
    """Gemma 4 and FunctionGemma: `call:name{key:value,...}` between the family's markers, strings between its
    quote tokens, keys in sorted order (the templates sort them)."""

    def __init__(self, name: str, open_: str, close: str, quote: str) -> None:
        self.name, self.open, self.close, self.quote = name, open_, close, quote
        self.triggers = (open_,)

    def calls_rules(self, tools: list[Tool], parallel: bool) -> str:
        head = "calls: call+\n" if parallel else "calls: call\n"
        alts, rules = [], []
        for i, tool in enumerate(tools):
            alts.append(f'"{tool.name}" args{i}')
            rules.append(gemma_grammar(f"args{i}", tool.parameters, self.quote))
        call = f"call: {lit(self.open + 'call:')} fn {lit(self.close)}\n"
        return head + call + "fn: " + "\n  | ".join(alts) + "\n" + "".join(rules)

    def split(self, section: str) -> list[tuple[Call, int]]:
        calls: list[tuple[Call, int]] = []
        i = 0
        head = self.open + "call:"
        while section.startswith(head, i):
            i += len(head)
            brace = section.find("{", i)
            if brace < 0:
                return calls
            try:
                args, j = parse_gemma_args(section, brace, self.quote)
            except ValueError:
                return calls
            if not section.startswith(self.close, j):
                return calls
            calls.append((Call(section[i:brace], json.dumps(args, ensure_ascii=False)), j + len(self.close)))
            i = j + len(self.close)
        return calls


class Generic(Family):
    """Templates without tool syntax: the reply is one JSON document, a call list or a response."""

    name = "generic"
    native = False

    def calls_rules(self, tools: list[Tool], parallel: bool) -> str:
        more = ' (", " call)*' if parallel else ""
        head = f'calls: "{{\\"tool_calls\\": [" call{more} "]}}"\n'
        call = 'call: "{\\"name\\": \\"" fn "}"\n'
        return head + call + self._named(tools, '"{name}\\", \\"arguments\\": " {args}')

    def split(self, section: str) -> list[tuple[Call, int]]:
        """All the calls at once, when the document is complete (a call is known good only then)."""
        try:
            value, end = decode_at(section, 0)
        except ValueError:
            return []
        if not isinstance(value, dict) or set(value) != {"tool_calls"} or not isinstance(value["tool_calls"], list):
            return []
        calls = []
        j = section.index("[", section.index('"tool_calls"')) + 1
        for k in range(len(value["tool_calls"])):
            try:
                call, j = call_from_object(section, j)
            except (ValueError, KeyError, IndexError):
                return []
            calls.append(call)
            if k + 1 < len(value["tool_calls"]):
                j = section.index(",", j) + 1
        return [(c, end) for c in calls]

    @staticmethod
    def response(text: str) -> str | None:
        """The reply of `{"response": "..."}`, or None when the text is not that document."""
        try:
            value, end = decode_at(text, 0)
        except ValueError:
            return None
        if (
            isinstance(value, dict)
            and set(value) == {"response"}
            and isinstance(value["response"], str)
            and not text[end:].strip()
        ):
            return value["response"]
        return None

    @staticmethod
    def system_text(tools: list[dict[str, Any]]) -> str:
        lines = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        return (
            f"You can call these tools:\n{lines}\n\n"
            'Reply with one JSON object: {"tool_calls": [{"name": <tool name>, "arguments": <arguments object>}]} to call'
            ' tools, or {"response": <your reply, a string>} to answer the user.'
        )


def family_named(key: str) -> Family:
    """The family whose `key` this is (what a client reading direct replies gets from the router). KeyError if none."""
    made: dict[str, Callable[[], Family]] = {
        "hermes": Hermes,
        "llama3": Llama3,
        "mistral": Mistral,
        "mistral-args": lambda: MistralArgs(call_ids=False),
        "mistral-args+ids": lambda: MistralArgs(call_ids=True),
        "gemma": lambda: Gemma("gemma", "<|tool_call>", "<tool_call|>", '<|"|>'),
        "functiongemma": lambda: Gemma("functiongemma", "<start_function_call>", "<end_function_call>", "<escape>"),
        "generic": Generic,
    }
    return made[key]()


def detect(source: str) -> Family:
    """The tool-call family of a chat template, from the markers in its source."""
    if "[TOOL_CALLS]" in source:
        if "[ARGS]" in source:
            return MistralArgs(call_ids="[CALL_ID]" in source)
        return Mistral()
    if "<|tool_call>call:" in source:
        return family_named("gemma")
    if "<start_function_call>" in source:
        return family_named("functiongemma")
    if "<tool_call>" in source and "<function=" not in source:  # (Qwen3-Coder's XML calls are another syntax)
        return Hermes()
    if "<|start_header_id|>" in source and ("ipython" in source or '"parameters"' in source):
        return Llama3()
    return Generic()
