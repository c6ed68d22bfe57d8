"""Tool-call syntaxes of the model families people run locally, detected from the chat template.

Each family knows three things about its syntax: the text that opens a tool-call section (its trigger), a grammar
(llguidance Lark) for that section built from the request's tools, and how to read calls out of the model's text
while they are written (`head`, an arguments reader from chat/calls.py, `tail`). The grammars write the section
exactly as the family's template renders an assistant message's `tool_calls`, so a call the model made renders back
to the same text when the agent sends it in the history.

| family | syntax (one call) | templates |
| --- | --- | --- |
| hermes | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` | Qwen 2.5 / 3, Hermes 2 / 3, QwQ |
| llama3 | `{"name": "f", "parameters": {...}}` as the whole reply | Llama 3.1 / 3.2 / 3.3 |
| mistral | `[TOOL_CALLS][{"name": "f", "arguments": {...}, "id": "abcDEF123"}]` | Mistral Nemo |
| mistral-args | `[TOOL_CALLS]f[ARGS]{...}`, `[CALL_ID]id` before `[ARGS]` if the template has it | Mistral Small 3.2, Devstral |
| gemma | `<\\|tool_call>call:f{key:<\\|"\\|>text<\\|"\\|>,n:3}<tool_call\\|>` | Gemma 4 |
| functiongemma | `<start_function_call>call:f{key:<escape>text<escape>}<end_function_call>` | FunctionGemma |
| pythonic | `<\\|tool_call_start\\|>[f(key='text', n=3)]<\\|tool_call_end\\|>` (chat/pythonic.py) | LFM2, LFM2.5 |
| minimax-m3 | `]<]minimax[>[<invoke name="f">`, an element per key, every tag behind that token (minimax_xml.py) | MiniMax-M3 |
| muse | a message per call, ` to=f<\\|message\\|><atem:function_calls>...` (chat/muse.py) | Muse Glimmer |
| generic | the reply is `{"tool_calls": [{"name": "f", "arguments": {...}}]}` or `{"response": "..."}` | the others |

`generic` is for templates without tool syntax (the built-in ones too), as llama-server does. The template knows
nothing of tools there: tools are described in a system message, and calls and tool results are rendered into
the history as the JSON above (chat/request.py `polyfill`).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Mapping
from typing import Any, Literal

from chat.calls import Call, Head, JsonArgs, Pattern, WholeArgs, call_from_object, decode_at, match_literal, skip_ws
from chat.gemma_args import GemmaArgs, gemma_grammar
from chat.schema import for_grammar
from chat.value_grammar import lit
from protocol import Tool

ALNUM = string.ascii_letters + string.digits
EMPTY: Mapping[str, frozenset[str]] = {}
__all__ = ["Call", "Family", "Generic"]


def object_schema(tool: Tool) -> dict[str, Any]:
    """The tool's parameters as the JSON Schema of an arguments object, ready for a grammar."""
    schema: dict[str, Any] = dict(tool.parameters) if tool.parameters else {"type": "object", "properties": {}}
    schema.setdefault("type", "object")
    return for_grammar(schema)


def json_args_rule(name: str, tool: Tool) -> str:
    return f"{name}: %json {json.dumps(object_schema(tool), ensure_ascii=False)}\n"


def head_of(pattern: Pattern, section: str, i: int) -> Head | Literal[False] | None:
    """A head whose arguments are a JSON object right after `pattern`; None while undecided, False if not one."""
    got = pattern.match(section, i)
    if got is None or got is False:
        return got
    slots, at = got
    return Head(slots["name"], JsonArgs(at), slots.get("id"))


class Family:
    """A tool-call syntax. Subclasses set the class attributes and implement `calls_rules`, `head` and `tail`.

    Reading: the parser (chat/section_parser.py) gives the tool-call section (the text from the trigger on) to `head` at
    the start of each call; the head's reader follows the arguments; `tail` reads what closes the call. So a call
    is given out while it is written: its name as soon as the head is read, its arguments as they come."""

    name = "base"
    triggers: tuple[str, ...] = ()
    at_start = False  # the section can only open the reply
    native = True  # the template renders tools, tool calls and tool results itself
    id_alphabet = ""  # tool call ids the template accepts: "" = any (ours: call_ + 24 hex)
    id_length = 0
    reasoning: tuple[str, str] | None = None  # the thinking's open and close, where the syntax has its own
    in_content = False  # the template renders no tool calls: `write` puts them into the assistant's content

    @property
    def key(self) -> str:
        """Its name on the wire (protocol ReplyFormat.family); `family_named` makes it again."""
        return self.name

    def new_id(self) -> str:
        if self.id_alphabet:
            return "".join(secrets.choice(self.id_alphabet) for _ in range(self.id_length))
        return "call_" + secrets.token_hex(12)

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        """Lark rules defining `calls`: the whole tool-call section, trigger included (`lazy`: from the trigger on)."""
        raise NotImplementedError

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        """The head of call `k` (0: the section's first) at section[i] (after the previous call's tail): a Head; an
        index when no call follows (the section's closing text ends there, and the rest is reply text); None while
        the text could still become either. `strings`: each tool's parameters that its schema says are strings."""
        raise NotImplementedError

    def tail(self, section: str, i: int) -> int | None:
        """The index after the closing text of a call whose arguments end at section[i]; None while incomplete. A
        tail that is not the syntax's ends the call where its arguments end (the section ends there too)."""
        return i

    def request_triggers(self, tools: list[Tool]) -> tuple[str, ...]:
        """The triggers of a lazy grammar for these tools (a syntax whose section opens with a tool's name)."""
        return self.triggers

    def parser(self, spec: Any) -> Any:
        """A reader of its own for replies (chat/output_parser.py's OutputParser), or None: the section machinery."""
        return None

    def write(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """The section for these calls (name, arguments) as the model writes it (for `in_content` families)."""
        raise NotImplementedError

    def _named(self, tools: list[Tool], fmt: str) -> str:
        """`fn` alternatives, one per tool: `fmt` with {name} (the name, inside a Lark literal) and {args}."""
        alts, rules = [], []
        for i, tool in enumerate(tools):
            alts.append(fmt.replace("{name}", tool.name).replace("{args}", f"args{i}"))
            rules.append(json_args_rule(f"args{i}", tool))
        return "fn: " + "\n  | ".join(alts) + "\n" + "".join(rules)


def closing(section: str, i: int, text: str) -> int | None:
    """The index after `text` (whitespace flexible) at section[i]; None while it may still come; `i` if it does not."""
    got = match_literal(section, i, text)
    if got is None:
        return None
    return i if got is False else got


def listed_head(
    first: Pattern, more: Pattern, close: str, section: str, i: int, k: int
) -> tuple[dict[str, str], int] | int | None:
    """The head of call `k` in a section that lists its calls: `first` matched for the first call, `more` for one after
    a call. (slots, index after) when it is there; else the index after the section's `close` (`i` when that is not
    there either: the rest is reply text); None while undecided."""
    got = (more if k else first).match(section, i)
    if got is not False:
        return got
    return closing(section, i, close) if k else i


class Hermes(Family):
    name = "hermes"
    triggers = ("<tool_call>",)
    HEAD = Pattern('<tool_call>\n{"name": "{name}", "arguments": ')

    def __init__(self, sep: str = "\n") -> None:
        self.sep = sep  # what the template writes between two calls (Qwen: a newline; Reka Edge: nothing)

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        head = f"calls: call ({lit(self.sep)} call)*\n" if parallel else "calls: call\n"
        call = 'call: "<tool_call>\\n{\\"name\\": \\"" fn "}\\n</tool_call>"\n'
        return head + call + self._named(tools, '"{name}\\", \\"arguments\\": " {args}')

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        got = head_of(self.HEAD, section, i)
        if got is not False:
            return got
        # another shape of the object (its members in another order): read once the call is complete
        j = skip_ws(section, i)
        if not section.startswith("<tool_call>", j):
            return None if "<tool_call>".startswith(section[j:]) else i
        close = section.find("</tool_call>", j)
        if close < 0:
            return None
        body = section[j + len("<tool_call>") : close]
        try:
            call, after = call_from_object(body, 0)
        except (ValueError, KeyError, IndexError):
            return i
        if body[after:].strip():
            return i
        end = close + len("</tool_call>")
        return Head(call.name, WholeArgs(j, call.arguments, end), whole=True)

    def tail(self, section: str, i: int) -> int | None:
        return closing(section, i, "}\n</tool_call>")


class Llama3(Family):
    name = "llama3"
    triggers = ('{"name": "',)
    at_start = True
    HEAD = Pattern('{"name": "{name}", "parameters": ')
    HEAD_ARGS = Pattern('{"name": "{name}", "arguments": ')

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        # the template takes one call per message (it raises on more)
        return 'calls: "{\\"name\\": \\"" fn "}"\n' + self._named(tools, '"{name}\\", \\"parameters\\": " {args}')

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        if k:
            return i
        got = head_of(self.HEAD, section, i)
        return head_of(self.HEAD_ARGS, section, i) if got is False else got

    def tail(self, section: str, i: int) -> int | None:
        return closing(section, i, "}")


class Mistral(Family):
    """Mistral Nemo: a JSON list after [TOOL_CALLS]; ids are 9 letters or digits (the template checks). The id
    follows the arguments, and a call's id opens it on every API: so a call is given out once complete."""

    name = "mistral"
    triggers = ("[TOOL_CALLS]",)
    id_alphabet, id_length = ALNUM, 9

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        more = ' (", " call)*' if parallel else ""
        head = f'calls: "[TOOL_CALLS][" call{more} "]"\n'
        call = 'call: "{\\"name\\": \\"" fn ", \\"id\\": \\"" /[a-zA-Z0-9]{9}/ "\\"}"\n'
        return head + call + self._named(tools, '"{name}\\", \\"arguments\\": " {args}')

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        at = match_literal(section, i, "[TOOL_CALLS][" if k == 0 else ",")
        if at is False and k:
            return closing(section, i, "]")
        if at is None or at is False:
            return None if at is None else i
        if JsonArgs(at).read(section, False)[1] is None:
            return None  # the object is not complete yet
        try:
            call, end = call_from_object(section, at)
        except (ValueError, KeyError, IndexError):
            return i
        return Head(call.name, WholeArgs(at, call.arguments, end), call.id, whole=True)


class MistralArgs(Family):
    """Mistral Small 3.2, Devstral, Ministral 3: `[TOOL_CALLS]name[ARGS]{...}` per call, `[CALL_ID]id` in between
    where the template has it."""

    name = "mistral-args"
    triggers = ("[TOOL_CALLS]",)
    id_alphabet, id_length = ALNUM, 9
    HEAD = Pattern("[TOOL_CALLS]{name}[ARGS]")
    HEAD_ID = Pattern("[TOOL_CALLS]{name}[CALL_ID]{id}[ARGS]")

    def __init__(self, call_ids: bool) -> None:
        self.call_ids = call_ids

    @property
    def key(self) -> str:
        return "mistral-args+ids" if self.call_ids else "mistral-args"

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        head = "calls: call+\n" if parallel else "calls: call\n"
        mid = '"[CALL_ID]" /[a-zA-Z0-9]{9}/ "[ARGS]"' if self.call_ids else '"[ARGS]"'
        return head + 'call: "[TOOL_CALLS]" fn\n' + self._named(tools, '"{name}" ' + mid + " {args}")

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        with_id, plain = head_of(self.HEAD_ID, section, i), head_of(self.HEAD, section, i)
        for got in (with_id, plain):
            if isinstance(got, Head):
                return got
        return None if with_id is None or plain is None else i


class Gemma(Family):
    """Gemma 4 and FunctionGemma: `call:name{key:value,...}` between the family's markers, strings between its
    quote tokens, keys in sorted order (the templates sort them)."""

    def __init__(self, name: str, open_: str, close: str, quote: str) -> None:
        self.name, self.open, self.close, self.quote = name, open_, close, quote
        self.triggers = (open_,)
        self.pattern = Pattern(open_ + "call:{name}")

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        head = "calls: call+\n" if parallel else "calls: call\n"
        alts, rules = [], []
        for i, tool in enumerate(tools):
            alts.append(f'"{tool.name}" args{i}')
            rules.append(gemma_grammar(f"args{i}", tool.parameters, self.quote))
        call = f"call: {lit(self.open + 'call:')} fn {lit(self.close)}\n"
        return head + call + "fn: " + "\n  | ".join(alts) + "\n" + "".join(rules)

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        got = self.pattern.match(section, i)
        if got is None or got is False:
            return None if got is None else i
        slots, at = got
        if at == len(section):
            return None
        if section[at] != "{":
            return i
        return Head(slots["name"], GemmaArgs(at, self.quote))

    def tail(self, section: str, i: int) -> int | None:
        return closing(section, i, self.close)


class Generic(Family):
    """Templates without tool syntax: the reply is one JSON document, a call list or a response."""

    name = "generic"
    native = False
    FIRST = Pattern('{"tool_calls": [{"name": "{name}", "arguments": ')
    NEXT = Pattern(', {"name": "{name}", "arguments": ')

    def calls_rules(self, tools: list[Tool], parallel: bool, lazy: bool = False) -> str:
        more = ' (", " call)*' if parallel else ""
        head = f'calls: "{{\\"tool_calls\\": [" call{more} "]}}"\n'
        call = 'call: "{\\"name\\": \\"" fn "}"\n'
        return head + call + self._named(tools, '"{name}\\", \\"arguments\\": " {args}')

    def head(self, section: str, i: int, k: int, strings: Mapping[str, frozenset[str]] = EMPTY) -> Head | int | None:
        got = listed_head(self.FIRST, self.NEXT, "]}", section, i, k)
        if not isinstance(got, tuple):
            return got
        slots, at = got
        return Head(slots["name"], JsonArgs(at), slots.get("id"))

    def tail(self, section: str, i: int) -> int | None:
        return closing(section, i, "}")

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
