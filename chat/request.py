"""A chat request, prepared for the model: the prompt text, the constraint on the reply, and how to read the reply.

The history is checked: each tool message answers a call of the assistant message before it. Calls left unanswered
are rendered as they are (llama-server does; OpenAI refuses them), since an agent whose reply was cut off in its calls
sends them back unrun (Codex after a reply that hit its cap), and a refusal would end its session for good. Call
arguments that are not a JSON object (a call cut off at max_tokens, sent back as streamed) are rendered as written.
A problem is a ChatError naming the field (`messages[3].tool_call_id`).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from chat.families import Family, Generic
from chat.family_detection import detect
from chat.grammar import ChatError, constraint
from chat.limits import MAX_NESTING, nesting
from chat.output import OutputSpec
from chat.template import ChatTemplate, RawJSON, TemplateError
from chat.thinking_derivation import derive_reasoning, empty_thinking_block, reasoning_tags
from protocol import ChatMessage, Constraint, ImagePart, Submit, TextPart, Tool

log = logging.getLogger(__name__)

MEDIA_MARKER = "<__media__>"
"""Where an image is in a rendered prompt: llama.cpp mtmd's default marker (`mtmd_default_marker()`), which the
prompt's text is split on to place each image's embeddings, in order."""


def content_text(m: ChatMessage) -> str:
    """A message's content as the template sees it. With images, as llama-server renders content parts with media
    (common/chat.cpp `to_json_oaicompat`): one string, a newline between two text parts, MEDIA_MARKER where each
    image is with nothing added before or after it. Without images, the text parts joined as they are."""
    if not isinstance(m.content, list) or not any(isinstance(p, ImagePart) for p in m.content):
        return m.text()
    out: list[str] = []
    written = after_marker = False  # (whether any text is written yet; whether the last part was an image)
    for p in m.content:
        if isinstance(p, TextPart):
            if written and not after_marker:
                out.append("\n")
            out.append(p.text)
            after_marker = False
        else:
            out.append(MEDIA_MARKER)
            after_marker = True
        written = written or bool(out[-1])
    return "".join(out)


@dataclass(frozen=True)
class Prepared:
    text: str
    add_bos: bool  # whether the tokenizer adds BOS (not when the template wrote it)
    constraint: Constraint | None
    output: OutputSpec


class ChatFormat:
    """A chat template with what it implies: the tool-call family and the thinking tags.

    A template without tool syntax (the generic family) means a model its authors did not teach to call tools: its
    requests' tools are a hint (not shown to the model, counted in `tools_not_offered`), as llama-server renders them,
    unless the request requires a call (tool_choice `required` or a named function: the grammar writes it), its
    history holds calls already, or the operator asks for the generic JSON format (`generic_tools`, `--generic-tools`)."""

    def __init__(self, template: ChatTemplate, *, generic_tools: bool = False) -> None:
        self.template = template
        self.family: Family = detect(template)
        self.generic_tools = generic_tools
        self.tools_not_offered = 0  # requests whose tools this model was not shown
        self._count_lock = threading.Lock()
        # (a family whose thinking is part of its syntax has its own pair: gpt-oss's channel, Muse's message)
        self.reasoning: tuple[str, str] | None = (
            self.family.reasoning or derive_reasoning(template, self.family.triggers) or reasoning_tags(template.source)
        )
        # a template that reads past thinking as `thinking` (gpt-oss) gets reasoning_content there too
        self.thinking_field = "message.thinking" in template.source
        # the empty thinking block the template writes before a reply without thinking, where the model opens its
        # thinking itself (Kimi K2 Thinking's `<think></think>`): a forced call writes it too, or thinks first
        self.empty_thinking = empty_thinking_block(template, self.reasoning)
        # the model's vision projector, where the router serves one (`--mmproj FILE`); None: a request with images is
        # refused (router/prepare.py)
        self.vision: object | None = None

    @property
    def name(self) -> str:
        return self.template.name

    @property
    def tool_format(self) -> str:
        """How tools reach the model: its family's syntax, or the generic JSON format (always, or only for a call the
        request requires)."""
        if not isinstance(self.family, Generic):
            return self.family.name
        return "generic" if self.generic_tools else "generic, only where a call is required (--generic-tools: always)"

    def offers(self, sub: Submit) -> bool:
        """Whether the model is shown the request's tools (False: they are a hint; `not_offered` counts them)."""
        required = sub.tool_choice not in ("auto", "none")
        if not sub.tools or not isinstance(self.family, Generic) or self.generic_tools or required:
            return True
        # (a conversation that has called tools keeps them in view, and its prompt's prefix)
        return any(m.tool_calls or m.role == "tool" for m in sub.messages or ())

    def not_offered(self) -> None:
        """Count one request whose tools this model was not shown (requests are prepared on several threads)."""
        with self._count_lock:
            self.tools_not_offered += 1

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
    ) -> tuple[str, bool]:
        """The template's text. A template that refuses the `reasoning_effort` an API's effort became (Hy3 takes
        high, low and no_think; Codex sends medium) renders without it rather than failing the request."""
        try:
            return self.template.render(messages, tools, kwargs=kwargs)
        except TemplateError:
            if "reasoning_effort" not in kwargs:
                raise
            others = {k: v for k, v in kwargs.items() if k != "reasoning_effort"}
            text = self.template.render(messages, tools, kwargs=others)
            log.info("reasoning_effort %r refused by template %s: rendered without it", kwargs["reasoning_effort"], self.name)
            return text

    def prepare(self, sub: Submit, offered: bool | None = None) -> Prepared:
        """Render `sub.messages` with its tools; the constraint and output spec its fields ask for. `offered`: whether
        the model is shown the tools, decided once for the request (None: `offers(sub)`), so that a --context-shift
        attempt that drops the turns holding calls renders as the whole did."""
        assert sub.messages is not None
        tools = (sub.tools or []) if (self.offers(sub) if offered is None else offered) else []
        use_tools = bool(tools) and sub.tool_choice != "none"
        messages = template_messages(sub.messages)
        if self.thinking_field:
            messages = [{**m, "thinking": m["reasoning_content"]} if "reasoning_content" in m else m for m in messages]
        oai_tools = [tool_json(t) for t in tools] if tools else None
        if isinstance(self.family, Generic):
            messages = polyfill(messages, oai_tools)
            oai_tools = None
        elif self.family.in_content:
            messages = calls_into_content(messages, self.family, self.reasoning)
        text, add_bos = self.render(messages, oai_tools, sub.chat_template_kwargs)
        check_markers(text, sub)
        fam = self.family if tools else None
        in_reasoning = bool(self.reasoning) and text.rstrip().endswith(self.reasoning[0]) if self.reasoning else False
        close = self.reasoning[1] if self.reasoning and in_reasoning else None
        budget = sub.chat_template_kwargs.get("thinking_budget")  # (Seed-OSS's name; 0: no thinking before a forced call)
        budget = budget if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0 else None
        block = None
        if self.reasoning and self.empty_thinking and not in_reasoning and not text.rstrip().endswith(self.reasoning[1]):
            block = (self.reasoning[0], self.reasoning[1], self.empty_thinking)
        limit = constraint(
            fam, tools, sub.tool_choice, sub.parallel_tool_calls, sub.response_format, sub.grammar, close, budget, block
        )
        # (a family whose thinking is part of its syntax, gpt-oss's or Muse's messages, reads every reply)
        reads = use_tools or (tools and isinstance(self.family, Generic)) or self.family.reasoning is not None
        spec = OutputSpec(
            family=self.family if reads else None,
            tool_names=frozenset(t.name for t in tools) if use_tools else frozenset(),
            reasoning=self.reasoning,
            in_reasoning=in_reasoning,
            strings={t.name: string_params(t) for t in tools} if use_tools else {},
        )
        return Prepared(text, add_bos, limit, spec)


def check_markers(text: str, sub: Submit) -> None:
    """A prompt with images must hold MEDIA_MARKER once per image, in their order, for each to be placed: a ChatError
    naming the text that holds the marker itself, or the messages when the template left an image out."""
    images = sum(len(m.images()) for m in sub.messages or ())
    if not images or text.count(MEDIA_MARKER) == images:
        return
    for i, m in enumerate(sub.messages or ()):
        parts = [m.content] if isinstance(m.content, str) else m.content or []
        for j, p in enumerate(parts):
            if isinstance(p, str | TextPart) and MEDIA_MARKER in (p if isinstance(p, str) else p.text):
                where = f"messages[{i}].content" + ("" if isinstance(p, str) else f"[{j}]")
                why = f"`{where}` holds the text {MEDIA_MARKER}, which marks where an image goes in a prompt with images"
                raise ChatError(why, where)
    raise ChatError(f"the chat template rendered {text.count(MEDIA_MARKER)} image markers for {images} images", "messages")


def prompt_constraint(sub: Submit) -> Constraint | None:
    """For a prompt (not chat): the constraint of `response_format` or `grammar`."""
    return constraint(None, None, "auto", True, sub.response_format, sub.grammar)


def string_params(tool: Tool) -> frozenset[str]:
    """The parameters the tool's schema says are strings (a tagged syntax writes their values raw)."""
    props = (tool.parameters or {}).get("properties") or {}
    return frozenset(k for k, v in props.items() if isinstance(v, dict) and v.get("type") == "string")


def tool_json(tool: Tool) -> dict[str, Any]:
    """A tool as templates expect it (OpenAI's shape)."""
    params = tool.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": tool.name, "description": tool.description, "parameters": params}}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI-shaped dicts with only the fields each message has; the tool history checked."""
    out: list[dict[str, Any]] = []
    open_calls: dict[str, str] = {}  # ids of the last assistant message's calls not answered yet -> function name
    open_at = -1
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if open_calls and role != "tool":
            # (rendered without results, as llama-server renders them: a client whose reply was cut off in its calls
            # sends them back unrun, and refusing that history would end its session for good)
            log.info("messages[%d]: %d tool calls have no tool message answering them", open_at, len(open_calls))
            open_calls = {}
        d: dict[str, Any] = {"role": role, "content": content_text(m)}
        if m.name is not None:
            d["name"] = m.name
        if role == "assistant":
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                d["tool_calls"] = []
                for j, call in enumerate(m.tool_calls):
                    where = f"messages[{i}].tool_calls[{j}].function.arguments"
                    try:
                        args = RawJSON(call.arguments or "{}")
                    except RecursionError:  # (json.loads recurses: 10,000 levels pass its limit)
                        raise ChatError(f"{where} nests more than {MAX_NESTING} levels deep", where) from None
                    except ValueError:  # a call cut off at max_tokens, sent back as it was streamed: kept as written
                        args = RawJSON.cut(call.arguments)
                    if nesting(args) > MAX_NESTING:
                        raise ChatError(f"{where} nests more than {MAX_NESTING} levels deep", where)
                    d["tool_calls"].append(
                        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": args}}
                    )
                open_calls, open_at = {c.id: c.name for c in m.tool_calls}, i
        elif role == "tool":
            name = open_calls.pop(m.tool_call_id or "", None)
            if name is None:
                raise ChatError(
                    f"messages[{i}] is a tool message for call {m.tool_call_id!r}, which no unanswered call of the assistant"
                    " message before it has",
                    f"messages[{i}].tool_call_id",
                )
            d["tool_call_id"] = m.tool_call_id
            d.setdefault("name", name)
        out.append(d)
    return out


def polyfill(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """For templates without tool syntax (the generic family): tools described in a system message, and calls,
    tool results and (with tools) replies rendered as the JSON documents the grammar makes the model write."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and (m.get("tool_calls") or tools):
            out.append({"role": "assistant", "content": generic_reply(m)})
        elif m["role"] == "tool":
            body = {"tool_response": {"name": m["name"], "content": m["content"]}}
            out.append({"role": "user", "content": json.dumps(body, ensure_ascii=False)})
        else:
            out.append({k: v for k, v in m.items() if k in ("role", "content")})
    if tools:
        note = Generic.system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def calls_into_content(
    messages: list[dict[str, Any]], family: Family, thinking: tuple[str, str] | None = None
) -> list[dict[str, Any]]:
    """For a template that renders no tool calls but whose model writes them (LFM2-8B-A1B, LFM2.5-Instruct): an
    assistant message's calls written into its content, after its text, as the model wrote them; its thinking before
    them, between the `thinking` tags (LFM2.5-Instruct keeps the last turn's, as the model wrote it)."""
    out = []
    for m in messages:
        reasoning = m.get("reasoning_content") if thinking else None
        if m["role"] == "assistant" and (m.get("tool_calls") or reasoning):
            calls = [(c["function"]["name"], dict(c["function"]["arguments"])) for c in m.get("tool_calls") or []]
            thought = thinking[0] + reasoning + thinking[1] if thinking and reasoning else ""
            m = {k: v for k, v in m.items() if k not in ("tool_calls", "reasoning_content")}
            m["content"] = thought + (m.get("content") or "") + (family.write(calls) if calls else "")
        out.append(m)
    return out


def generic_reply(m: dict[str, Any]) -> str:
    """An assistant message as the generic family's grammar writes it: the calls (arguments as the model wrote
    them), or the reply text as {"response": ...}."""
    calls = m.get("tool_calls")
    if calls:
        items = ", ".join(
            '{"name": ' + json.dumps(c["function"]["name"]) + ', "arguments": ' + c["function"]["arguments"].raw + "}"
            for c in calls
        )
        return '{"tool_calls": [' + items + "]}"
    return json.dumps({"response": m["content"]}, ensure_ascii=False)


SYSTEM_ROLES = ("system", "developer")


def shift_points(messages: list[ChatMessage]) -> list[int]:
    """Where `--context-shift` may resume a history too long for a slot, fewest messages dropped first (see
    `shifted`). The leading system messages and the last user message always stay; before that user message the
    history resumes only at a user message (templates that want user and assistant turns to alternate stay
    happy), after it at any message but a tool result (which stays with the call it answers)."""
    head, n = leading_system(messages), len(messages)
    last_user = _last_user(messages)
    if last_user is None:  # no user message: keep at least the last message (and the tool results after it)
        return [i for i in range(head + 1, n) if messages[i].role != "tool"]
    before = [i for i in range(head + 1, last_user + 1) if messages[i].role == "user"]
    # from last_user + 2 on: resuming at last_user + 1 keeps what resuming at last_user does
    after = [i for i in range(last_user + 2, n + 1) if i == n or messages[i].role != "tool"]
    return before + after


def shifted(messages: list[ChatMessage], at: int) -> list[ChatMessage]:
    """The history resumed at `at` (one of `shift_points`): the leading system messages, the last user message when
    `at` is past it, then messages[at:]."""
    head = leading_system(messages)
    last_user = _last_user(messages)
    kept_user = [messages[last_user]] if last_user is not None and at > last_user else []
    return messages[:head] + kept_user + messages[at:]


def _last_user(messages: list[ChatMessage]) -> int | None:
    return next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "user"), None)


def leading_system(messages: list[ChatMessage]) -> int:
    """How many messages at the start are system (or developer) messages."""
    n = 0
    while n < len(messages) and messages[n].role in SYSTEM_ROLES:
        n += 1
    return n
