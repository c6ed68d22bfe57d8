"""OpenAI Responses (`/v1/responses`) on the one protocol `submit`.

Honoured: `model`, `input` (a string, or items: messages with `input_text` / `output_text` parts, any role where it
stands, `input_image` parts (a data URL in `image_url`, or an http(s) one with --image-fetch: gateway/images.py) in
input messages and in a `function_call_output`'s `output`, `function_call`, `function_call_output`, `reasoning`),
`instructions`, function `tools`, `namespace` tools (their functions offered as `NAMESPACE__NAME`, as Codex flattens
them; a call comes back with `name` and `namespace` apart), `tool_choice`, `parallel_tool_calls`, `text.format`
(`text`, `json_object`, `json_schema`),
`max_output_tokens`, `temperature`, `top_p`, `top_logprobs`, `stream`, `reasoning.effort` (the template's
`reasoning_effort`; `none`: its `enable_thinking` off), llama.cpp's `top_k`, `min_p`, `chat_template_kwargs` and
kvroute's `deadline_ms`; `prompt_cache_key` (Codex's conversation id), `user`, `safety_identifier` and `service_tier`
give the request's session and priority (gateway/normalise.py), and the reply names the tier applied.

Stateless, as llama-server is: a response is not kept, so `previous_response_id` and `conversation` are refused
(send the whole conversation in `input`, which kvroute serves from cache anyway) and `store`, the API's default,
is a hint (nothing is stored). Hosted tools (`web_search`, `file_search`, `code_interpreter`, `mcp`, ...) are
hints: the model is not offered them. Every hint is in gateway/fields.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from gateway import normalise
from gateway.blocks import Blocks, Event, Kind
from gateway.errors import RequestError
from gateway.fields import Policy, Strict, decode, undated
from gateway.images import Images
from gateway.keepalive import Tick
from gateway.replies import chat_logprobs, context_shift, sse, timings_body
from protocol import (
    MAX_DEADLINE_MS,
    MAX_LOGPROBS,
    ChatMessage,
    Delta,
    FinishReason,
    ImagePart,
    MaxTokens,
    MinP,
    NamedTool,
    ResponseFormat,
    Result,
    Submit,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    TopK,
    TopP,
    Usage,
)


class InputText(Strict, tag_field="type", tag="input_text"):
    text: str


class OutputText(Strict, tag_field="type", tag="output_text"):
    text: str
    annotations: Any = None
    logprobs: Any = None


class Refusal(Strict, tag_field="type", tag="refusal"):
    refusal: str


class InputImage(Strict, tag_field="type", tag="input_image"):
    image_url: str | None = None  # a data URL (data:image/png;base64,...) or bare base64; http(s) with --image-fetch
    file_id: str | None = None  # refused: kvroute keeps no files
    detail: Annotated[str, Meta(max_length=32)] | None = None


class InputFile(Strict, tag_field="type", tag="input_file"):
    file_id: Any = None
    file_data: Any = None
    file_url: Any = None
    filename: Any = None


Part = InputText | OutputText | Refusal | InputImage | InputFile


class MessageItem(Strict, tag_field="type", tag="message"):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Strict, tag_field="type", tag="function_call"):
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict, tag_field="type", tag="function_call_output"):
    output: str | list[InputText | InputImage | InputFile]
    call_id: str | None = None  # (Codex writes its goal's objective as an output of no call: `name`, `namespace`)
    name: str | None = None
    namespace: str | None = None
    id: str | None = None
    status: str | None = None


class ReasoningText(Strict, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningItem(Strict, tag_field="type", tag="reasoning"):
    id: str | None = None
    summary: list[Any] = []
    content: list[ReasoningText] | None = None
    encrypted_content: Any = None
    status: str | None = None


class EasyMessage(Strict):
    """A message item without `type` (the API's "easy input message")."""

    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None


class NamespaceTool(Strict):
    """Codex's group of functions (an MCP server's tools, say) under one name."""

    type: Literal["namespace"]
    name: str
    tools: list[dict[str, Any]]
    description: str | None = None


class NamedFunction(Strict):
    type: Literal["function"]
    name: str


class Format(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(Strict):
    format: Format | None = None


class Reasoning(Strict):
    effort: str | None = None


class ResponsesRequest(Strict):
    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # each decoded on its own (`function_tools`): hosted tools are hints
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: TopP | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    stream: bool = False
    reasoning: Reasoning | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    deadline_ms: Annotated[int, Meta(ge=1, le=MAX_DEADLINE_MS)] | None = None
    # the request's session and priority (gateway/normalise.py), read leniently (gateway/fields.py LENIENT)
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None


def flat_name(namespace: str, name: str) -> str:
    """A namespaced function's name as offered to the model: Codex's own flattening (`ns__name`)."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


def function_tools(raw: list[dict[str, Any]] | None, policy: Policy) -> tuple[list[Tool] | None, dict[str, tuple[str, str]]]:
    """(the functions offered to the model, flat name -> (namespace, name) of the namespaced ones). Hosted tools
    (`web_search`, ...) are hints: the model is not offered them."""
    if raw is None:
        return None, {}
    tools: list[Tool] = []
    names: dict[str, tuple[str, str]] = {}
    for i, item in enumerate(raw):
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "namespace":
            ns: NamespaceTool = decode(item, NamespaceTool, policy, at=f"tools[{i}]")
            for j, inner in enumerate(ns.tools):
                f: FunctionTool = decode(inner, FunctionTool, policy, at=f"tools[{i}].tools[{j}]")
                tools.append(_tool(flat_name(ns.name, f.name), f, f"tools[{i}].tools[{j}]"))
                names[tools[-1].name] = (ns.name, f.name)
        elif kind == "function":
            f = decode(item, FunctionTool, policy, at=f"tools[{i}]")
            tools.append(_tool(f.name, f, f"tools[{i}]"))
        elif isinstance(kind, str):
            policy.hint(f"tools[].type={undated(kind)}")
        else:
            raise RequestError(f"`tools[{i}].type` is missing", param=f"tools[{i}].type")
    return tools, names


def _tool(name: str, f: FunctionTool, where: str) -> Tool:
    return normalise.tool(name, f.description or "", f.parameters or {}, where=f"{where}.name", param=f"{where}.name")


def _items(raw: list[Any], policy: Policy) -> list[Any]:
    """Each input item typed; an item without `type` is a message."""
    out = []
    for i, item in enumerate(raw):
        kind = EasyMessage if isinstance(item, dict) and "type" not in item else Item
        out.append(decode(item, kind, policy, at=f"input[{i}]"))
    return out


def _parts(content: str | list[Any], where: str, images: Images | None) -> list[TextPart | ImagePart]:
    """A message's content (`where`: the field holding it) as protocol parts; `images` reads its images, None where
    none may be (an assistant's output)."""
    if isinstance(content, str):
        return [TextPart(text=content)]
    parts: list[TextPart | ImagePart] = []
    for j, p in enumerate(content):
        at = f"{where}[{j}]"
        if isinstance(p, InputText | OutputText):
            parts.append(TextPart(text=p.text))
        elif isinstance(p, Refusal):
            parts.append(TextPart(text=p.refusal))
        elif isinstance(p, InputImage) and images is not None:
            if p.file_id is not None:
                raise RequestError(
                    f"`{at}.file_id` is not served: kvroute keeps no files; send the image as a data URL in `image_url`",
                    param=f"{at}.file_id",
                )
            if p.image_url is None:
                raise RequestError(f"`{at}` needs `image_url` (a data URL)", param=f"{at}.image_url")
            parts.append(images.url(p.image_url, part=at, field=f"{at}.image_url", detail=p.detail))
        elif isinstance(p, InputImage):
            raise RequestError("input_image content is served in input messages, not in an assistant's output", param=at)
        else:
            kind = p.__struct_config__.tag
            raise RequestError(f"{kind} content is not supported: the served model reads text and images", param=at)
    return parts


def to_messages(
    instructions: str | None, input_: str | list[Any], policy: Policy | None = None, images: Images | None = None
) -> list[ChatMessage]:
    """Items as chat messages: consecutive assistant output (text, calls, reasoning) is one assistant message."""
    images = images or Images()
    out: list[ChatMessage] = []
    if instructions is not None:
        out.append(ChatMessage(role="system", content=instructions))
    if isinstance(input_, str):
        out.append(ChatMessage(role="user", content=input_))
        return out
    for i, item in enumerate(_items(input_, policy or Policy("responses"))):
        where = f"input[{i}]"
        last = out[-1] if out and out[-1].role == "assistant" else None
        if isinstance(item, MessageItem | EasyMessage) and item.role != "assistant":
            out.append(ChatMessage(role=item.role, content=_parts(item.content, f"{where}.content", images)))
        elif isinstance(item, MessageItem | EasyMessage):
            parts = _parts(item.content, f"{where}.content", None)
            if last is not None:  # (text after the same turn's calls too: their outputs follow it, Codex's order)
                last.content = [*(last.content if isinstance(last.content, list) else []), *parts]
            else:
                out.append(ChatMessage(role="assistant", content=parts))
        elif isinstance(item, FunctionCallItem):
            name = item.name if item.namespace is None else flat_name(item.namespace, item.name)
            call = ToolCall(id=item.call_id, name=name, arguments=item.arguments)
            if last is not None:
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            output = _parts(item.output, f"{where}.output", images)
            has_images = any(isinstance(p, ImagePart) for p in output)
            body = output if has_images else "".join(p.text for p in output if isinstance(p, TextPart))
            if item.call_id is None:  # an output that answers no call: context the client adds, read as a user turn
                if policy is not None:
                    policy.hint("input[].function_call_output without call_id")
                out.append(ChatMessage(role="user", content=body))
            else:
                out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=body))
        elif isinstance(item, ReasoningItem):
            text = "".join(c.text for c in item.content or [])
            if not text:  # only a summary or encrypted content (OpenAI's own items): nothing this model wrote
                continue
            if last is not None and not last.tool_calls and not last.content:
                last.reasoning_content = (last.reasoning_content or "") + text
            else:
                out.append(ChatMessage(role="assistant", content=None, reasoning_content=text))
    return out


@dataclass(frozen=True)
class Asked:
    """What the reply echoes of a request: its typed body, and its namespaced functions (flat name -> parts)."""

    body: ResponsesRequest
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def call_names(self, flat: str) -> dict[str, str]:
        """A call's `name` (and `namespace`) fields as the client offered the function."""
        parts = self.namespaced.get(flat)
        return {"name": flat} if parts is None else {"name": parts[1], "namespace": parts[0]}


def responses_submit(
    raw: dict[str, Any], request_id: str, policy: Policy | None = None, images: Images | None = None
) -> tuple[Submit, bool, Asked]:
    """/v1/responses body -> (submit, stream?, what the reply echoes); `images` reads its images (gateway/images.py)."""
    policy = policy or Policy("responses")
    body: ResponsesRequest = decode(raw, ResponsesRequest, policy)
    tools, namespaced = function_tools(body.tools, policy)
    kwargs = normalise.thinking_kwargs(body.chat_template_kwargs, body.reasoning.effort if body.reasoning is not None else None)
    choice: Any = body.tool_choice or "auto"
    if isinstance(choice, NamedFunction):
        choice = NamedTool(name=choice.name)
    if body.tool_choice not in (None, "none") and not tools:
        raise RequestError("`tool_choice` needs `tools`", param="tool_choice")
    fmt = None
    f = body.text.format if body.text else None
    if f is not None and f.type == "json_object":
        fmt = ResponseFormat(type="json_object")
    elif f is not None and f.type == "json_schema":
        if f.schema is None:
            raise RequestError("text.format json_schema needs `schema`", param="text.format.schema")
        fmt = ResponseFormat(type="json_schema", schema=f.schema, name=f.name)
    sampling = normalise.sampling(
        {
            "max_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "logprobs": body.top_logprobs,
        }
    )
    with normalise.refused():
        messages = to_messages(body.instructions, body.input, policy, images)
    sub = normalise.submit(
        request_id,
        sampling,
        messages=messages,
        deadline_ms=body.deadline_ms,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=fmt,
        chat_template_kwargs=kwargs,
        session=normalise.session_of(body.prompt_cache_key, body.user, body.safety_identifier),
        priority=normalise.priority_of(body.service_tier, normalise.OPENAI_TIERS, policy),
    )
    return sub, body.stream, Asked(body, namespaced)


# ---- replies ----------------------------------------------------------------------------------------------------


def _usage(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def _tool_choice(body: ResponsesRequest) -> Any:
    tc = body.tool_choice
    return msgspec.to_builtins(tc) if tc is not None else "auto"


def envelope(rid: str, model: str, asked: Asked, created: float, service_tier: str | None = None) -> dict[str, Any]:
    """A response object without its output (status `in_progress`); the service tier it is served at, when the
    request named one (as OpenAI's)."""
    body = asked.body
    fmt = body.text.format if body.text and body.text.format else None
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": created,
        "model": model,
        "status": "in_progress",
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        "previous_response_id": None,
        "store": False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": msgspec.to_builtins(fmt) if fmt else {"type": "text"}},
        "tool_choice": _tool_choice(body),
        "tools": body.tools or [],
        "truncation": "disabled",
        "usage": None,
        "metadata": {},
        **({"service_tier": service_tier} if service_tier is not None else {}),
    }


def _item(block: Any, rid: str, asked: Asked, done: bool, logprobs: list[Any] | None = None) -> dict[str, Any]:
    """The output item of a block (`done`: completed, with its text; else in progress and empty)."""
    status = "completed" if done else "in_progress"
    if block.kind is Kind.TOOL:
        c = block.call
        return {"type": "function_call", "id": f"fc_{rid}_{block.index}", "call_id": c.id, **asked.call_names(c.name),
                "arguments": block.text if done else "", "status": status}  # fmt: skip
    if block.kind is Kind.THINKING:
        content = [{"type": "reasoning_text", "text": block.text}] if done else []
        return {"type": "reasoning", "id": f"rs_{rid}_{block.index}", "summary": [], "content": content, "status": status}
    part = _part(block.text if done else "", logprobs if done else [])
    return {"type": "message", "id": f"msg_{rid}_{block.index}", "role": "assistant", "status": status,
            "content": [part] if done else []}  # fmt: skip


def _part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def finish(result: Result, asked: Asked) -> tuple[str, dict[str, Any] | None]:
    """(status, incomplete_details). `incomplete` answers the request's own `max_output_tokens`; a reply the server
    ended (its `--max-tokens` cap, when the request set no limit) is `completed`, as llama-server reports every
    reply: a client that never limits output (Codex) takes `incomplete` for a failed turn."""
    if result.finish_reason == FinishReason.LENGTH and asked.body.max_output_tokens is not None:
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def response_body(
    result: Result, rid: str, model: str, asked: Asked, created: float, logprobs: bool, service_tier: str | None = None
) -> dict[str, Any]:
    blocks = Blocks()
    delta = Delta(id=rid, text=result.text, tokens=b"", reasoning=result.reasoning or "")
    delta.tool_calls = [_call_delta(i, c) for i, c in enumerate(result.tool_calls)]
    events = list(blocks.feed(delta)) + list(blocks.finish())
    lps = chat_logprobs(result.logprobs)["content"] if logprobs else None
    out = envelope(rid, model, asked, created, service_tier)
    status, incomplete = finish(result, asked)
    u = result.usage
    out.update(
        status=status,
        incomplete_details=incomplete,
        output=[_item(ev.block, rid, asked, True, lps) for ev in events if ev.what == "close"],
        usage=_usage(u) | context_shift(result),
    )
    return out


def _call_delta(i: int, c: ToolCall) -> ToolCallDelta:
    return ToolCallDelta(index=i, id=c.id, name=c.name, arguments=c.arguments)


async def response_events(
    messages: AsyncIterator[Delta | Result | Tick],
    rid: str,
    model: str,
    asked: Asked,
    created: float,
    service_tier: str | None = None,
) -> AsyncIterator[bytes]:
    """The documented event sequence: response.created, response.in_progress, then per output item
    output_item.added, (content_part.added, output_text.delta..., output_text.done, content_part.done |
    function_call_arguments.delta, .done | reasoning_text.delta..., .done), output_item.done; response.completed."""
    seq = 0
    blocks = Blocks()
    done_items: list[dict[str, Any]] = []

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        data = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return sse(kind, data)

    base = envelope(rid, model, asked, created, service_tier)
    yield event("response.created", response=base)
    yield event("response.in_progress", response=base)

    def emit(ev: Event) -> list[bytes]:
        b, out = ev.block, []
        item_id = _item(b, rid, asked, False)["id"]
        where = {"item_id": item_id, "output_index": b.index}
        if ev.what == "open":
            out.append(event("response.output_item.added", output_index=b.index, item=_item(b, rid, asked, False)))
            if b.kind is Kind.TEXT:
                out.append(event("response.content_part.added", **where, content_index=0, part=_part("", [])))
        elif ev.what == "delta":
            if b.kind is Kind.TEXT:
                out.append(event("response.output_text.delta", **where, content_index=0, delta=ev.text, logprobs=[]))
            elif b.kind is Kind.THINKING:
                out.append(event("response.reasoning_text.delta", **where, content_index=0, delta=ev.text))
            else:
                out.append(event("response.function_call_arguments.delta", **where, delta=ev.text))
        else:
            if b.kind is Kind.TEXT:
                out.append(event("response.output_text.done", **where, content_index=0, text=b.text, logprobs=[]))
                out.append(event("response.content_part.done", **where, content_index=0, part=_part(b.text, [])))
            elif b.kind is Kind.THINKING:
                out.append(event("response.reasoning_text.done", **where, content_index=0, text=b.text))
            else:
                assert b.call is not None
                name = asked.call_names(b.call.name)["name"]
                out.append(event("response.function_call_arguments.done", **where, name=name, arguments=b.text))
            item = _item(b, rid, asked, True)
            done_items.append(item)
            out.append(event("response.output_item.done", output_index=b.index, item=item))
        return out

    async for msg in messages:
        if isinstance(msg, Tick):  # (what OpenAI's API sends on a long stream: gateway/keepalive.py)
            yield event("keepalive")
            continue
        if isinstance(msg, Delta):
            for ev in blocks.feed(msg):
                for chunk in emit(ev):
                    yield chunk
            continue
        for ev in blocks.finish():
            for chunk in emit(ev):
                yield chunk
        status, incomplete = finish(msg, asked)
        u = msg.usage
        final = {**base, "status": status, "incomplete_details": incomplete, "output": done_items,
                 "usage": _usage(u) | context_shift(msg)}  # fmt: skip
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield event(kind, response=final, timings=timings_body(msg))  # (llama-server's, beside the response)


def failed_events(
    rid: str, model: str, asked: Asked, created: float, code: str, message: str, service_tier: str | None = None
) -> bytes:
    """A stream that failed before its first token: response.created, then response.failed with the error (how
    OpenAI's Codex backend reports a context overflow, `context_length_exceeded`, which Codex answers by compacting;
    an HTTP 400 it takes for a request it must not send again)."""
    base = envelope(rid, model, asked, created, service_tier)
    failed = {**base, "status": "failed", "error": {"code": code, "message": message}}
    events = [("response.created", base), ("response.failed", failed)]
    return b"".join(sse(kind, {"type": kind, "sequence_number": i, "response": r}) for i, (kind, r) in enumerate(events))


def now() -> float:
    return time.time()
