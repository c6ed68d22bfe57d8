"""Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`) on the one protocol `submit`.

Honoured: `model`, `max_tokens` (required), `messages` (roles user and assistant, and system where a client puts
one in the conversation: rendered where it stands; content a string or blocks: `text`, `tool_use`, `tool_result`,
`thinking`, and `image` with a base64 `source` (or a `url` one, with --image-fetch) in user turns and inside
`tool_result` content: gateway/images.py), `system` (a string or text blocks), `stop_sequences`, `stream`,
`temperature`, `top_k`, `top_p`,
`tools` (custom tools: `name`, `description`, `input_schema`), `tool_choice` (`auto`, `any`, `tool`, `none`,
`disable_parallel_tool_use`), `thinking` (`enabled` / `disabled`: the template's `enable_thinking`; `adaptive`:
the template's default; `display: "omitted"`: the model thinks, and its thinking blocks come with no text, the
signature carrying it, as Anthropic's do: a block sent back so renders the thinking the model wrote),
`output_config.format` (a JSON Schema), llama.cpp's `chat_template_kwargs` and kvroute's `deadline_ms`;
`metadata.user_id` (Claude Code's names its session) and `service_tier` give the request's session and priority
(gateway/normalise.py). Hints (gateway/fields.py): `cache_control` anywhere (kvroute caches every prefix anyway),
`context_management`, `output_config.effort`, `thinking.budget_tokens`, `tools[].defer_loading`, server tools the
hosted API runs (`web_search_*`, `web_fetch_*`, `code_execution_*`, ...), `anthropic-beta` headers,
`redacted_thinking` blocks (opaque provider data). Refused with a 400 in Anthropic's error shape naming the field:
document blocks, images by `file` source (kvroute keeps no files) or `url` source without --image-fetch, and
Anthropic-schema client tools (`bash_*`, `text_editor_*`, `computer_*`, `memory_*`) whose schema the model has never
seen.

Claude Code's system prompt opens with an `x-anthropic-billing-header` whose stamps change: `cch=` on every request
(older versions), the fingerprint after `cc_version=X.Y.Z.` with each session's first message. Each stamp is written
as f's (llama-server does so for `cch=`), or no prefix would be reused from one request, or one session (a sub-agent's
included), to the next: the ~12k tokens of system prompt and tools that follow the header are the same in all of them.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from msgspec import Meta

from gateway import normalise
from gateway.blocks import Blocks, Kind
from gateway.errors import RequestError
from gateway.fields import Policy, Strict, decode, undated
from gateway.images import Images
from gateway.keepalive import Tick
from gateway.replies import context_shift, sse
from protocol import (
    MAX_DEADLINE_MS,
    ChatMessage,
    Delta,
    FinishReason,
    ImagePart,
    MaxTokens,
    NamedTool,
    ResponseFormat,
    Result,
    Submit,
    TextPart,
    Tokenize,
    Tool,
    ToolCall,
    TopK,
    TopP,
)


class Text(Strict, tag_field="type", tag="text"):
    text: str


class ToolUse(Strict, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ImageSource(Strict):
    type: Literal["base64", "url", "file"]
    media_type: str | None = None  # with base64
    data: str | None = None  # with base64
    url: str | None = None  # with url: fetched with --image-fetch (gateway/image_fetch.py), else refused
    file_id: str | None = None  # refused: kvroute keeps no files


class Image(Strict, tag_field="type", tag="image"):
    source: ImageSource


class ToolResult(Strict, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[Text | Image] | None = None
    is_error: bool = False


class Thinking(Strict, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class RedactedThinking(Strict, tag_field="type", tag="redacted_thinking"):
    data: str


class Document(Strict, tag_field="type", tag="document"):
    source: Any
    cache_control: Any = None
    title: Any = None
    context: Any = None
    citations: Any = None


Block = Text | ToolUse | ToolResult | Thinking | RedactedThinking | Image | Document


class Message(Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ToolDef(Strict):
    name: str
    input_schema: dict[str, Any]
    description: str = ""
    type: Literal["custom"] | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks without their text


class JsonFormat(Strict):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Strict):
    format: JsonFormat | None = None


class Metadata(Strict):
    user_id: str | None = None  # Claude Code's names its session (gateway/normalise.py `claude_user_id`)


class MessagesRequest(Strict):
    max_tokens: MaxTokens
    messages: Annotated[list[Message], Meta(min_length=1)]
    model: str | None = None
    system: str | list[Text] | None = None
    stop_sequences: Annotated[list[str], Meta(max_length=16)] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: TopK | None = None
    top_p: TopP | None = None
    tools: list[dict[str, Any]] | None = None  # each decoded on its own (`tool_defs`): server tools are hints
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    deadline_ms: Annotated[int, Meta(ge=1, le=MAX_DEADLINE_MS)] | None = None
    # the request's session and priority (gateway/normalise.py), read leniently (gateway/fields.py LENIENT)
    metadata: Metadata | None = None
    service_tier: str | None = None


class CountTokensRequest(Strict):
    messages: Annotated[list[Message], Meta(min_length=1)]
    model: str | None = None
    system: str | list[Text] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    metadata: Metadata | None = None  # (as a message's: nothing is generated, nothing to do with it)


SERVER_TOOLS = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_", "mcp_toolset")
CLIENT_SCHEMA_TOOLS = ("bash_", "text_editor_", "computer_", "memory_")


def tool_defs(tools: list[dict[str, Any]] | None, policy: Policy) -> list[ToolDef] | None:
    """The custom tools; server tools (the hosted API runs them) are hints; Anthropic-schema tools are refused."""
    if tools is None:
        return None
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if isinstance(kind, str) and kind != "custom":
            if kind.startswith(SERVER_TOOLS):
                policy.hint(f"tools[].type={undated(kind)}")
                continue
            if kind.startswith(CLIENT_SCHEMA_TOOLS):
                raise RequestError(
                    f"tools[{i}].type: {kind!r} tools are not supported: the served model does not know their schema;"
                    " describe the tool as a custom tool with an input_schema",
                    param=f"tools[{i}].type",
                )
        out.append(decode(raw, ToolDef, policy, at=f"tools[{i}]"))
    return out


BILLING_HEADER = "x-anthropic-billing-header:"
_STAMPS = re.compile(r"(cch=)([0-9a-f]{5});|(cc_version=\d+\.\d+\.\d+\.)([0-9a-f]{1,8});")


def unstamped(header: str) -> str:
    """Claude Code's billing header with its per-request and per-session stamps written as f's (module docstring)."""
    return _STAMPS.sub(lambda m: f"{m[1] or m[3]}{'f' * len(m[2] or m[4])};", header)


def _system_text(system: str | list[Text] | None) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        if not system.startswith(BILLING_HEADER):
            return system
        line, nl, rest = system.partition("\n")
        return unstamped(line[:4096]) + line[4096:] + nl + rest
    texts = [b.text for b in system]
    if texts and texts[0].startswith(BILLING_HEADER):  # (the header is a block of its own)
        texts[0] = unstamped(texts[0][:4096]) + texts[0][4096:]
    return "".join(texts)


def _refuse(block: Any, where: str) -> None:
    kind = block.__struct_config__.tag
    raise RequestError(f"{where}: {kind} blocks are not supported: the served model reads text and images", param=where)


def image_part(b: Image, where: str, images: Images) -> ImagePart:
    """An image block's image (`where`: the block): base64 decoded and checked; a URL fetched with --image-fetch (else
    refused); a file refused."""
    src = b.source
    if src.type == "url" and images.limits.fetch:
        if src.url is None:
            raise RequestError(f"{where}.source.url: a url image needs its `url`", param=f"{where}.source.url")
        return images.by_url(src.url, part=where, field=f"{where}.source.url")
    if src.type != "base64":
        what = "this server does not fetch URLs: --image-fetch is off" if src.type == "url" else "kvroute keeps no files"
        raise RequestError(
            f"{where}.source.type: {src.type!r} images are not served ({what}); send the image as base64: "
            '{"type": "base64", "media_type": "image/png", "data": ...}',
            param=f"{where}.source.type",
        )
    if src.data is None:
        raise RequestError(f"{where}.source.data: a base64 image needs its `data`", param=f"{where}.source.data")
    if src.media_type is not None and not src.media_type.lower().startswith("image/"):
        field = f"{where}.source.media_type"
        raise RequestError(f"{field}: {src.media_type[:64]!r} is not an image", param=field)
    return images.base64(src.data, src.media_type, part=where, field=f"{where}.source.data")


def _tool_result(b: ToolResult, where: str, images: Images) -> ChatMessage:
    """A tool_result block as a tool message: its text (after "Error: " for an error), and its images where they
    stand (Claude Code's Read tool sends an image file so)."""
    if isinstance(b.content, str) or not any(isinstance(x, Image) for x in b.content or []):
        body = b.content if isinstance(b.content, str) else "".join(x.text for x in b.content or [] if isinstance(x, Text))
        return ChatMessage(role="tool", tool_call_id=b.tool_use_id, content="Error: " + body if b.is_error else body)
    parts: list[TextPart | ImagePart] = [
        TextPart(text=x.text) if isinstance(x, Text) else image_part(x, f"{where}.content[{k}]", images)
        for k, x in enumerate(b.content or [])
    ]
    if b.is_error:
        first = parts[0]
        parts[0:1] = [TextPart(text="Error: " + first.text)] if isinstance(first, TextPart) else [TextPart(text="Error: "), first]
    return ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=parts)


def to_messages(
    system: str | list[Text] | None, messages: list[Message], policy: Policy | None = None, images: Images | None = None
) -> list[ChatMessage]:
    """Anthropic's turns as chat messages: a user turn's tool results become tool messages (first, right after
    the calls they answer), its text and images a user message; an assistant turn's tool_use blocks become its tool
    calls; a system turn (Claude Code puts some in the conversation) stays a system message where it stands."""
    images = images or Images()
    out: list[ChatMessage] = []
    sys_text = _system_text(system)
    if sys_text is not None:
        out.append(ChatMessage(role="system", content=sys_text))
    for i, m in enumerate(messages):
        blocks = [Text(text=m.content)] if isinstance(m.content, str) else m.content
        parts: list[TextPart | ImagePart] = []
        calls: list[ToolCall] = []
        thinking: list[str] = []
        for j, b in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            if isinstance(b, Text):
                parts.append(TextPart(text=b.text))
            elif isinstance(b, Image) and m.role == "user":
                parts.append(image_part(b, where, images))
            elif isinstance(b, ToolResult) and m.role == "user":
                out.append(_tool_result(b, where, images))
            elif isinstance(b, ToolUse) and m.role == "assistant":
                # written as the grammar writes arguments (", " and ": "), so the call renders as the model wrote it
                calls.append(ToolCall(id=b.id, name=b.name, arguments=json.dumps(b.input, ensure_ascii=False)))
            elif isinstance(b, Thinking) and m.role == "assistant":
                thinking.append(b.thinking or signed_thinking(b.signature) or "")
            elif isinstance(b, RedactedThinking):
                if policy is not None:
                    policy.hint("messages[].content[].type=redacted_thinking")
            elif isinstance(b, Document):
                _refuse(b, where)
            elif isinstance(b, Image):
                why = f"{where}: image blocks are served in user turns and tool results, not in a {m.role} turn"
                raise RequestError(why, param=where)
            else:
                raise RequestError(f"{where}: a {b.__struct_config__.tag} block cannot be in a {m.role} turn", param=where)
        if m.role in ("user", "system") and parts:
            out.append(ChatMessage(role=m.role, content=parts))
        elif m.role == "assistant" and (parts or calls or thinking):
            out.append(
                ChatMessage(
                    role="assistant",
                    content=parts or None,
                    tool_calls=calls or None,
                    reasoning_content="".join(thinking) if thinking else None,
                )
            )
    return out


def _tools(raw: list[dict[str, Any]] | None, policy: Policy) -> list[Tool] | None:
    tools = tool_defs(raw, policy)
    if tools is None:
        return None
    return [
        normalise.tool(t.name, t.description, t.input_schema, where=f"tools[{i}].name", param=f"tools[{i}].name")
        for i, t in enumerate(tools)
    ]


def _tool_choice(tc: ToolChoice | None) -> tuple[Any, bool]:
    """(protocol tool_choice, parallel calls allowed)."""
    if tc is None:
        return "auto", True
    parallel = not tc.disable_parallel_tool_use
    if tc.type == "tool":
        if not tc.name:
            raise RequestError("tool_choice of type tool needs `name`", param="tool_choice.name")
        return NamedTool(name=tc.name), parallel
    return {"auto": "auto", "any": "required", "none": "none"}[tc.type], parallel


def _kwargs(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.thinking is not None and body.thinking.type != "adaptive":
        kwargs.setdefault("enable_thinking", body.thinking.type == "enabled")
    return kwargs


@dataclass(frozen=True)
class Asked:
    """What a Messages request asked of its reply beyond the submit."""

    stream: bool = False
    omit_thinking: bool = False  # thinking.display "omitted": thinking blocks carry no text, their signature does


def messages_submit(
    raw: dict[str, Any], request_id: str, policy: Policy | None = None, images: Images | None = None
) -> tuple[Submit, bool]:
    """/v1/messages body -> (submit, stream?)."""
    sub, asked = messages_request(raw, request_id, policy, images)
    return sub, asked.stream


def messages_request(
    raw: dict[str, Any], request_id: str, policy: Policy | None = None, images: Images | None = None
) -> tuple[Submit, Asked]:
    """/v1/messages body -> (submit, what its reply is to be); `images` reads its images (gateway/images.py)."""
    policy = policy or Policy("messages")
    body: MessagesRequest = decode(raw, MessagesRequest, policy)
    choice, parallel = _tool_choice(body.tool_choice)
    tools = _tools(body.tools, policy)
    if body.tool_choice is not None and body.tool_choice.type != "none" and not tools:
        raise RequestError("tool_choice needs tools", param="tool_choice")
    fmt = None
    if body.output_config is not None and body.output_config.format is not None:
        fmt = ResponseFormat(type="json_schema", schema=body.output_config.format.schema)
    sampling = normalise.sampling(
        {
            "max_tokens": body.max_tokens,
            "temperature": body.temperature,
            "top_k": body.top_k,
            "top_p": body.top_p,
            "stop": [s for s in body.stop_sequences or [] if s],
        }
    )
    with normalise.refused():
        messages = to_messages(body.system, body.messages, policy, images)
    sub = normalise.submit(
        request_id,
        sampling,
        messages=messages,
        deadline_ms=body.deadline_ms,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=fmt,
        chat_template_kwargs=_kwargs(body),
        session=_session(body.metadata),
        priority=normalise.priority_of(body.service_tier, normalise.ANTHROPIC_TIERS, policy),
    )
    omit = body.thinking is not None and body.thinking.display == "omitted"
    return sub, Asked(stream=body.stream, omit_thinking=omit)


def _session(metadata: Metadata | None) -> str | None:
    user_id = metadata.user_id if metadata is not None else None
    return normalise.session_of(None if user_id is None else normalise.claude_user_id(user_id))


def count_tokens_request(raw: dict[str, Any], policy: Policy | None = None, images: Images | None = None) -> Tokenize:
    """/v1/messages/count_tokens body -> the `tokenize` of the same rendering a message would get."""
    policy = policy or Policy("messages")
    body: CountTokensRequest = decode(raw, CountTokensRequest, policy)
    with normalise.refused():
        return Tokenize(
            messages=to_messages(body.system, body.messages, policy, images),
            tools=_tools(body.tools, policy),
            chat_template_kwargs=_kwargs(body),
        )


# ---- replies ----------------------------------------------------------------------------------------------------

STOP_REASONS = {FinishReason.LENGTH: "max_tokens", FinishReason.TOOL_CALLS: "tool_use"}


def stop_reason(result: Result) -> str:
    if result.stop:
        return "stop_sequence"
    return STOP_REASONS.get(result.finish_reason, "end_turn")  # type: ignore[call-overload]


def usage_body(prompt: int, cached: int, output: int) -> dict[str, Any]:
    """Anthropic counts input tokens that were not cached; cached ones are `cache_read_input_tokens`."""
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


SIGNED = "kvroute-thinking:"  # (a signature of ours: the thinking itself, base64)


def signature(thinking: str) -> str:
    """The signature of a thinking block whose text is omitted: its text, so that the block sent back in the next
    turn renders the thinking the model wrote, as Anthropic's signature carries it (the next turn's prompt then
    extends this one's and its reply, and is served from cache)."""
    return SIGNED + base64.b64encode(thinking.encode()).decode("ascii")


def signed_thinking(sig: str) -> str | None:
    """The thinking a signature of ours carries (None for any other signature)."""
    if not sig.startswith(SIGNED):
        return None
    try:
        return base64.b64decode(sig[len(SIGNED) :], validate=True).decode()
    except (binascii.Error, ValueError):
        return None


def thinking_block(thinking: str, omit: bool) -> dict[str, Any]:
    if omit:
        return {"type": "thinking", "thinking": "", "signature": signature(thinking)}
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def message_body(result: Result, model: str, omit_thinking: bool = False) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append(thinking_block(result.reasoning, omit_thinking))
    if result.text or not result.tool_calls:
        content.append({"type": "text", "text": result.text})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c.arguments)} for c in result.tool_calls]
    u = result.usage
    return {
        "id": f"msg_{result.id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(result),
        "stop_sequence": result.stop,
        "usage": usage_body(u.prompt_tokens, u.cached_tokens, u.completion_tokens) | context_shift(result),
    }


def tool_input(arguments: str) -> Any:
    """A call's `input`: its arguments object; `{}` for a call cut off (max_tokens) before its arguments were whole
    (`stop_reason` is then `max_tokens`; a stream gave out the arguments as far as they were written)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return {}


async def message_events(
    messages: AsyncIterator[Delta | Result | Tick], rid: str, model: str, omit_thinking: bool = False
) -> AsyncIterator[bytes]:
    """The stream in Anthropic's order: message_start, content blocks (start, deltas, stop), message_delta,
    message_stop. With `omit_thinking` a thinking block streams no text: its signature comes before its stop."""
    blocks = Blocks()
    started = False
    prompt = cached = 0

    def start() -> bytes:
        message: dict[str, Any] = {"id": f"msg_{rid}", "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": usage_body(prompt, cached, 0)}  # fmt: skip
        return sse("message_start", {"type": "message_start", "message": message})

    async for msg in messages:
        if isinstance(msg, Tick):  # (Anthropic's keep-alive: gateway/keepalive.py)
            if not started:
                started = True
                yield start()
            yield sse("ping", {"type": "ping"})
            continue
        if isinstance(msg, Delta):
            if not started:
                if msg.usage is not None:
                    prompt, cached = msg.usage.prompt_tokens, msg.usage.cached_tokens
                started = True
                yield start()
            for ev in blocks.feed(msg):
                for chunk in _block_events(ev, omit_thinking):
                    yield chunk
            continue
        if not started:
            prompt, cached = msg.usage.prompt_tokens, msg.usage.cached_tokens
            yield start()
        for ev in blocks.finish():
            for chunk in _block_events(ev, omit_thinking):
                yield chunk
        u = msg.usage
        delta = {"stop_reason": stop_reason(msg), "stop_sequence": msg.stop}
        yield sse("message_delta", {"type": "message_delta", "delta": delta,
                                    "usage": usage_body(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
                                    | context_shift(msg)})  # fmt: skip
        yield sse("message_stop", {"type": "message_stop"})


def _block_events(ev: Any, omit_thinking: bool) -> Iterator[bytes]:
    """A block event's stream events: as `_block_event`, except that an omitted thinking block gives no text and its
    signature at its end."""
    b = ev.block
    if omit_thinking and b.kind is Kind.THINKING:
        if ev.what == "delta":
            return
        if ev.what == "close":
            delta = {"type": "signature_delta", "signature": signature(b.text)}
            yield sse("content_block_delta", {"type": "content_block_delta", "index": b.index, "delta": delta})
    yield _block_event(ev)


def _block_event(ev: Any) -> bytes:
    b = ev.block
    if ev.what == "open":
        if b.kind is Kind.TOOL:
            block: dict[str, Any] = {"type": "tool_use", "id": b.call.id, "name": b.call.name, "input": {}}
        elif b.kind is Kind.THINKING:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            block = {"type": "text", "text": ""}
        return sse("content_block_start", {"type": "content_block_start", "index": b.index, "content_block": block})
    if ev.what == "delta":
        if b.kind is Kind.TOOL:
            delta = {"type": "input_json_delta", "partial_json": ev.text}
        elif b.kind is Kind.THINKING:
            delta = {"type": "thinking_delta", "thinking": ev.text}
        else:
            delta = {"type": "text_delta", "text": ev.text}
        return sse("content_block_delta", {"type": "content_block_delta", "index": b.index, "delta": delta})
    return sse("content_block_stop", {"type": "content_block_stop", "index": b.index})
