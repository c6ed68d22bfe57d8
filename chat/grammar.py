"""The constraint a request puts on its output, as an llguidance grammar (Lark syntax), checked before it is sent.

llguidance compiles JSON Schemas itself (`%json {...}` inside Lark) and converts GBNF, so kvroute writes no
schema converter; it computes a token mask in tens of microseconds where llama.cpp's grammar sampler takes tens
of milliseconds over Gemma's 262k-token vocabulary (docs/models.md, "Tool calls and structured output").

| request | grammar | when it starts |
| --- | --- | --- |
| `grammar` (GBNF or Lark) | as given | first token |
| `response_format` json_object / json_schema | `%json` of the schema | first token |
| tools, `tool_choice` auto | the family's tool-call section | lazily, at the family's trigger |
| tools, `required` / a named function | the section (one function's) | first token |
| generic family (no tool syntax) | `{"tool_calls": ...}` or `{"response": "..."}` | first token |
"""

from __future__ import annotations

import collections
import json
import threading
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from chat.families import Family, Generic
from chat.limits import Deadline
from chat.schema import SchemaError, for_grammar
from protocol import Constraint, NamedTool, ResponseFormat, Tool, ToolChoice

LIMITS = llguidance.LLParserLimits()


class ChatError(ValueError):
    """A request we cannot serve; `param` names the field (OpenAI's error `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CheckedGrammars:
    """What llguidance said of the grammars checked lately (an error, or "" for one that compiles), by their text, so
    that a grammar many requests repeat (an agent's tools, a schema) is compiled once here, as each worker compiles it
    once (worker/guide.py): least recently used out past `max_chars` characters of grammar. Thread safe (the
    router's preparing threads share it)."""

    def __init__(self, max_chars: int = 4 << 20) -> None:
        self.max_chars = max_chars
        self._said: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.compiles = 0

    def error(self, lark: str) -> str:
        with self._lock:
            said = self._said.get(lark)
            if said is not None:
                self._said.move_to_end(lark)
                return said
        said = (llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark), limits=LIMITS) or "").strip()
        with self._lock:
            self.compiles += 1
            if lark not in self._said and len(lark) <= self.max_chars:
                self._said[lark] = said
                self._chars += len(lark)
                while self._chars > self.max_chars:
                    self._chars -= len(self._said.popitem(last=False)[0])
        return said


CHECKED = CheckedGrammars()


def check(lark: str, param: str) -> None:
    """Raise ChatError naming `param` when llguidance cannot compile the grammar (first the running deadline, if any:
    a compile takes milliseconds to a second; a grammar checked lately is not compiled again)."""
    Deadline.check_running(param)
    error = CHECKED.error(lark)
    if error:
        raise ChatError(f"`{param}` cannot be compiled to a grammar: {error}", param)


def json_rule(name: str, schema: dict[str, Any], param: str | None = None) -> str:
    """The Lark rule `name` for JSON following `schema`; a schema that cannot be read is a ChatError naming `param`."""
    try:
        return f"{name}: %json {json.dumps(for_grammar(schema), ensure_ascii=False)}\n"
    except SchemaError as exc:
        raise ChatError(f"`{param}`: {exc}", param) from None


def user_grammar(text: str) -> Constraint:
    """The `grammar` field: GBNF (llama.cpp's) or Lark."""
    try:
        lark = any_to_lark(text)
    except Exception as exc:  # the converter raises plain exceptions on text it cannot read
        raise ChatError(f"`grammar` is neither GBNF nor Lark: {exc}", "grammar") from None
    check(lark, "grammar")
    return Constraint(grammar=lark)


def response_rule(fmt: ResponseFormat) -> str | None:
    """Lark rules for `body`, the reply `response_format` asks for (None for text)."""
    if fmt.type == "json_object":
        return json_rule("body", {"type": "object"})
    if fmt.type == "json_schema":
        assert fmt.schema is not None
        rule = json_rule("body", fmt.schema, "response_format")
        check("start: body\n" + rule, "response_format")
        return rule
    return None


def chosen_tools(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    if isinstance(choice, NamedTool):
        named = [t for t in tools if t.name == choice.name]
        if not named:
            known = ", ".join(t.name for t in tools)
            raise ChatError(f"tool_choice names function {choice.name!r}, which is not among the tools ({known})", "tool_choice")
        return named
    return tools


def check_tools(tools: list[Tool], *, compile_each: bool = False) -> None:
    """Each tool's parameters are an object schema kvroute can read; with `compile_each`, each compiles on its own too
    (to name the tool whose schema spoils a grammar of all of them: one compile per tool is the slow path)."""
    for i, tool in enumerate(tools):
        params = tool.parameters or {"type": "object"}
        where = f"tools[{i}].function.parameters"
        if params.get("type", "object") != "object":
            raise ChatError(f"{where} must describe an object, got type {params.get('type')!r}", where)
        rule = json_rule("a", params, where)
        if compile_each:
            check("start: a\n" + rule, where)


def check_calls(lark: str, tools: list[Tool]) -> None:
    """The grammar of the tool calls compiles; if it does not, the error names the first tool whose own schema does
    not compile, else the tools as a whole (one compile for all the tools, however many)."""
    try:
        check(lark, "tools")
    except ChatError:
        check_tools(tools, compile_each=True)
        raise


def constraint(
    family: Family | None,
    tools: list[Tool] | None,
    choice: ToolChoice,
    parallel: bool,
    fmt: ResponseFormat | None,
    grammar: str | None,
    thinking_close: str | None = None,
    thinking_budget: int | None = None,
    thinking_block: tuple[str, str, str] | None = None,
) -> Constraint | None:
    """The constraint for a request (family None: a prompt, not chat). Raises ChatError naming the field.
    `thinking_close`: the prompt opened the model's thinking, which a forced call may finish first (with this tag);
    a `thinking_budget` of 0 ends it at once (llguidance's max_tokens would cut it without writing the tag).
    `thinking_block`: (open tag, close tag, the empty block the template writes for a turn without thinking) where the model
    opens its thinking itself (Kimi K2 Thinking): a forced call may think first, or (budget 0) writes that block."""
    if grammar is not None:
        return user_grammar(grammar)
    body = response_rule(fmt) if fmt is not None else None
    if family is None or not tools:
        return Constraint(grammar="start: body\n" + body) if body else None
    generic = isinstance(family, Generic)
    if choice == "none":
        if generic:  # the reply is still the JSON document the system message asks for, a response
            return Constraint(grammar="start: response\n" + _response_rules(body))
        return Constraint(grammar="start: body\n" + body) if body else None
    check_tools(tools)
    forced = choice != "auto"
    single = isinstance(choice, NamedTool)  # "call this function": one call, as OpenAI does
    calls = family.calls_rules(chosen_tools(tools, choice), parallel and not single)
    if forced and thinking_close:  # the thinking the prompt opened, ended, then the calls
        close = json.dumps(thinking_close, ensure_ascii=False)
        lark = "start: thought thought_ws? calls\n" + calls + "thought_ws: /[ \\t\\r\\n]+/\n"
        if thinking_budget == 0:  # (no thinking: the tag that ends it, at once)
            lark += f"thought: {close}\n"
        else:
            lark += f"thought[suffix={close}]: /(?s:.*)/\n"
    elif forced and thinking_block:
        opened, close, empty = (json.dumps(t, ensure_ascii=False) for t in thinking_block)
        if thinking_budget == 0:
            lark = f"start: {empty} calls\n" + calls
        else:
            # (the empty block too: MiniMax-M3's is its close alone)
            lark = f"start: ({opened} thought thought_ws? | {empty} thought_ws?)? calls\n" + calls
            lark += "thought_ws: /[ \\t\\r\\n]+/\n"
            lark += f"thought[suffix={close}]: /(?s:.*)/\n"
    elif forced:
        lark = "start: calls\n" + calls
    elif generic:
        lark = "start: calls | response\n" + calls + _response_rules(body)
    elif body:
        lark = "start: calls | body\n" + calls + body
    else:  # lazy: free text until the family's trigger, then a tool-call section (from the trigger on)
        lark = "start: calls\n" + family.calls_rules(chosen_tools(tools, choice), parallel and not single, lazy=True)
        check_calls(lark, tools)
        triggers = list(family.request_triggers(chosen_tools(tools, choice)))
        return Constraint(grammar=lark, triggers=triggers, at_start=family.at_start)
    check_calls(lark, tools)
    return Constraint(grammar=lark)


def _response_rules(body: str | None) -> str:
    """The generic family's reply: `{"response": "text"}`, or the response_format's JSON as it is."""
    if body:
        return "response: body\n" + body
    return 'response: "{\\"response\\": " text "}"\n' + json_rule("text", {"type": "string"})
