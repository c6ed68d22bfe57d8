"""OpenAI Chat Completions (`/v1/chat/completions`) and Completions (`/v1/completions`): their bodies -> protocol
`Submit`, and protocol replies -> their response bodies and stream chunks.

Bodies are checked against gateway/openai_bodies.py under gateway/fields.py's policy: a refused field, or a value
kvroute cannot serve, is a 400 naming the field (`param`); hints are served, logged and counted.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from gateway import normalise
from gateway import openai_bodies as t
from gateway.errors import RequestError
from gateway.fields import Policy, decode, validation_problem
from gateway.images import Images
from gateway.keepalive import Tick
from gateway.replies import chat_logprobs, context_shift, piece, timings_body
from protocol import (
    COMPLETIONS_MAX_TOKENS,
    ChatMessage,
    Choice,
    Defaultable,
    Delta,
    ImagePart,
    NamedTool,
    ResponseFormat,
    Result,
    Sampling,
    Submit,
    TextPart,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
    pack_tokens,
)

OPENAI_COMPLETIONS_MAX_TOKENS = COMPLETIONS_MAX_TOKENS  # the OpenAI default for /v1/completions (protocol/common.py)


def _sampling(body: t.Common, max_tokens: int | None, logprobs: int | None) -> tuple[Sampling, list[Defaultable]]:
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    return normalise.sampling(
        {
            "max_tokens": max_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "min_p": body.min_p,
            "seed": body.seed,
            "logit_bias": body.logit_bias,
            "stop": [s for s in stop if s],
            "ignore_eos": body.ignore_eos,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "repeat_penalty": body.repeat_penalty,
            "repeat_last_n": body.repeat_last_n,
            "logprobs": logprobs,
        }
    )


def _response_format(body: t.Common) -> ResponseFormat | None:
    fmt = body.response_format
    if fmt is None or isinstance(fmt, t.TextFormat):
        return None
    if isinstance(fmt, t.JsonObjectFormat):
        return ResponseFormat(type="json_object")
    if fmt.json_schema.schema is None:
        raise RequestError("response_format json_schema needs `json_schema.schema`", param="response_format.json_schema.schema")
    return ResponseFormat(type="json_schema", schema=fmt.json_schema.schema, name=fmt.json_schema.name)


def _session(body: t.Common, policy: Policy) -> dict[str, Any]:
    """The request's session and priority, as its body gives them (gateway/normalise.py; headers go on top)."""
    return {
        "session": normalise.session_of(body.prompt_cache_key, body.user, body.safety_identifier),
        "priority": normalise.priority_of(body.service_tier, normalise.OPENAI_TIERS, policy),
    }


def _stream_flags(body: t.Common) -> tuple[bool, bool]:
    stream = bool(body.stream)
    include_usage = bool(stream and body.stream_options and body.stream_options.include_usage)
    return stream, include_usage


def completion_submit(raw: dict[str, Any], request_id: str, policy: Policy | None = None) -> tuple[Submit, bool, bool]:
    """/v1/completions body -> (submit, stream?, include_usage?)."""
    policy = policy or Policy("completions")
    body: t.CompletionRequest = decode(raw, t.CompletionRequest, policy)
    prompt: Any = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    tokens = None
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 for x in prompt):
            raise RequestError(
                "`prompt` must be a string, or a list of token ids (a batch of several prompts is not supported)", param="prompt"
            )
        tokens, prompt = prompt, None
    if body.echo:
        raise RequestError("`echo` is not supported (the reply never repeats the prompt)", param="echo")
    stream, include_usage = _stream_flags(body)
    sampling, unset = _sampling(body, body.max_tokens or OPENAI_COMPLETIONS_MAX_TOKENS, body.logprobs)
    sub = normalise.submit(
        request_id,
        (sampling, unset),
        prompt=prompt,
        tokens=None if tokens is None else pack_tokens(tokens),
        deadline_ms=body.deadline_ms,
        response_format=_response_format(body),
        grammar=body.grammar,
        n=body.n,
        cache_salt=body.cache_salt,
        **_session(body, policy),
    )
    return sub, stream, include_usage


def _message(m: t.Message, i: int, images: Images) -> ChatMessage:
    content: Any = m.content
    if isinstance(content, list):
        parts: list[TextPart | ImagePart] = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(part, t.TextPart | t.RefusalPart):
                parts.append(TextPart(text=part.text if isinstance(part, t.TextPart) else part.refusal))
            elif isinstance(part, t.ImagePart) and m.role == "user":
                url = part.image_url
                parts.append(images.url(url.url, part=where, field=f"{where}.image_url.url", detail=url.detail))
            elif isinstance(part, t.ImagePart):
                raise RequestError(f"image_url content is served in user messages, not in a {m.role} message", param=where)
            else:
                kind = part.__struct_config__.tag
                raise RequestError(f"{kind} content is not supported: the served model reads text and images", param=where)
        content = parts
    if m.refusal and not content:
        content = m.refusal
    calls = None
    if m.tool_calls is not None:
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
    fields = {
        "role": m.role,
        "content": content,
        "name": m.name,
        "tool_calls": calls,
        "tool_call_id": m.tool_call_id,
        "reasoning_content": m.reasoning_content,
    }
    try:
        return msgspec.convert(fields, ChatMessage)
    except normalise.REFUSED as exc:
        _, inner, message = validation_problem(exc)
        # the protocol's flat ToolCall is OpenAI's {id, function: {name, arguments}}
        inner = re.sub(r"^(tool_calls\[\d+\])\.(name|arguments)$", r"\1.function.\2", inner)
        where = f"messages[{i}]" + ("" if not inner else inner if inner.startswith("[") else "." + inner)
        raise RequestError(f"{where}: {message}", param=where) from None


def _tools(body: t.ChatRequest) -> list[Tool] | None:
    if body.tools is None:
        return None
    return [
        normalise.tool(f.name, f.description, f.parameters or {}, where=f"tools[{i}].function", param=f"tools[{i}].function.name")
        for i, f in enumerate(tool.function for tool in body.tools)
    ]


def chat_submit(
    raw: dict[str, Any], request_id: str, policy: Policy | None = None, images: Images | None = None
) -> tuple[Submit, bool, bool]:
    """/v1/chat/completions body -> (submit, stream?, include_usage?); `images` reads its images (gateway/images.py)."""
    modalities = raw.get("modalities")
    if isinstance(modalities, list) and any(m != "text" for m in modalities):
        raise RequestError("`modalities` other than text are not supported: the served model writes text", param="modalities")
    policy = policy or Policy("chat")
    body: t.ChatRequest = decode(raw, t.ChatRequest, policy)
    images = images or Images()
    messages = [_message(m, i, images) for i, m in enumerate(body.messages)]
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    choice: Any = body.tool_choice or "auto"
    if isinstance(choice, t.NamedChoice):
        choice = NamedTool(name=choice.function.name)
    tools = _tools(body)
    if body.tool_choice is not None and body.tool_choice != "none" and not tools:
        raise RequestError("`tool_choice` needs `tools`", param="tool_choice")
    stream, include_usage = _stream_flags(body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    sampling, unset = _sampling(body, max_tokens, logprobs)
    sub = normalise.submit(
        request_id,
        (sampling, unset),
        messages=messages,
        deadline_ms=body.deadline_ms,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body),
        grammar=body.grammar,
        chat_template_kwargs=normalise.thinking_kwargs(body.chat_template_kwargs, body.reasoning_effort),
        n=body.n,
        cache_salt=body.cache_salt,
        **_session(body, policy),
    )
    return sub, stream, include_usage


# ---- replies ----------------------------------------------------------------------------------------------------


def usage_body(result: Result) -> dict[str, Any]:
    u = result.usage
    body: dict[str, Any] = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},  # (the thinking's, tags included)
    }
    return body | context_shift(result)


def finish_reason(reason: str) -> str:
    """OpenAI's finish reasons: stop, length, tool_calls (a cancelled or timed-out reply ended: stop)."""
    return reason if reason in ("length", "tool_calls") else "stop"


def choices_of(result: Result) -> list[Choice]:
    if result.choices:
        return result.choices
    return [
        Choice(
            index=0,
            finish_reason=result.finish_reason,
            text=result.text,
            tokens=result.tokens,
            reasoning=result.reasoning,
            tool_calls=result.tool_calls,
            logprobs=result.logprobs,
            stop=result.stop,
        )
    ]


def completion_logprobs(lps: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    tokens, offsets = [], []
    for lp in lps:
        tokens.append(piece(lp.piece))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{piece(x.piece): x.logprob for x in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def tool_calls_body(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def reply_id(rid: str, chat: bool) -> str:
    """A reply's `id` (each chunk of its stream has the same)."""
    return f"chatcmpl-{rid}" if chat else f"cmpl-{rid}"


def _body(
    result: Result,
    model: str,
    created: int,
    chat: bool,
    choice: Callable[[Choice], dict[str, Any]],
    service_tier: str | None = None,
) -> dict[str, Any]:
    """A Chat Completions (`chat`) or Completions reply: each choice's `index`, what `choice` gives of it and its finish
    reason, then the usage and llama-server's timings; the service tier it was served at, when the request named one
    (as OpenAI's)."""
    return {
        "id": reply_id(result.id, chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": model,
        **({"service_tier": service_tier} if service_tier is not None else {}),
        "choices": [{"index": c.index, **choice(c), "finish_reason": finish_reason(c.finish_reason)} for c in choices_of(result)],
        "usage": usage_body(result),
        "timings": timings_body(result),
    }


def completion_body(
    result: Result, model: str, created: int, logprobs: bool = False, service_tier: str | None = None
) -> dict[str, Any]:
    return _body(
        result,
        model,
        created,
        False,
        lambda c: {"text": c.text, "logprobs": completion_logprobs(c.logprobs) if logprobs else None},
        service_tier,
    )


def chat_message(c: Choice) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None}
    if c.reasoning is not None:
        msg["reasoning_content"] = c.reasoning
    if c.tool_calls:
        msg["tool_calls"] = tool_calls_body(c.tool_calls)
    return msg


def chat_body(
    result: Result, model: str, created: int, logprobs: bool = False, service_tier: str | None = None
) -> dict[str, Any]:
    return _body(
        result,
        model,
        created,
        True,
        lambda c: {"message": chat_message(c), "logprobs": chat_logprobs(c.logprobs) if logprobs else None},
        service_tier,
    )


def chat_delta(d: Delta, logprobs: bool) -> dict[str, Any] | None:
    """One stream chunk's choice for a delta, or None when it carries nothing to show."""
    delta: dict[str, Any] = {}
    if d.text:
        delta["content"] = d.text
    if d.reasoning:
        delta["reasoning_content"] = d.reasoning
    if d.tool_calls:
        delta["tool_calls"] = [call_chunk(c) for c in d.tool_calls]
    if not delta and not (logprobs and d.logprobs):
        return None
    return {"index": d.index, "delta": delta, "logprobs": chat_logprobs(d.logprobs) if logprobs else None, "finish_reason": None}


def call_chunk(c: ToolCallDelta) -> dict[str, Any]:
    """A streamed call's piece as OpenAI sends it: the first with its id, type and name, the others only with more
    of the arguments."""
    if c.name is None:
        return {"index": c.index, "function": {"arguments": c.arguments}}
    return {"index": c.index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def completion_delta(d: Delta, logprobs: bool) -> dict[str, Any] | None:
    if not d.text and not (logprobs and d.logprobs):
        return None
    return {
        "index": d.index,
        "text": d.text,
        "logprobs": completion_logprobs(d.logprobs) if logprobs else None,
        "finish_reason": None,
    }


def now() -> int:
    return int(time.time())


# ---- streams ----------------------------------------------------------------------------------------------------


KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment (gateway/keepalive.py)


def sse_chunk(body: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"  # (one per token: msgspec is ~5x json's speed)


async def openai_events(
    messages: AsyncIterator[Delta | Result | Tick],
    *,
    chat: bool,
    rid: str,
    model: str,
    created: int,
    include_usage: bool,
    logprobs: bool,
    service_tier: str | None = None,
) -> AsyncIterator[bytes]:
    """A Chat Completions (`chat`) or Completions stream: chunks per delta, a last chunk per choice with its finish
    reason, the usage chunk when asked, then `[DONE]`; each chunk names `service_tier` when given (as OpenAI's)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    cid = reply_id(rid, chat)
    tier = {"service_tier": service_tier} if service_tier is not None else {}

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None, end: Result | None = None) -> bytes:
        body: dict[str, Any] = {"id": cid, "object": obj, "created": created, "model": model, **tier, "choices": choices}
        if include_usage:
            body["usage"] = usage
        if end is not None:  # the stream's last chunk
            body["timings"] = timings_body(end)
        return sse_chunk(body)

    def opening(index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def ending(index: int, reason: str) -> dict[str, Any]:
        if chat:
            return {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason(reason)}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason(reason)}

    head, tail = chunk([{}]).rsplit(b"{}", 1)  # (before and after a one-choice chunk's choice: usage, if any, is null)
    opened: set[int] = set()  # chat choices whose first chunk (with the role) went out
    async for msg in messages:
        if isinstance(msg, Tick):
            yield KEEP_ALIVE
            continue
        if isinstance(msg, Delta):
            if chat and msg.index not in opened:
                opened.add(msg.index)
                yield chunk([opening(msg.index)])
            part = chat_delta(msg, logprobs) if chat else completion_delta(msg, logprobs)
            if part is not None:  # (chunk's bytes, its fixed fields encoded once: this is per token)
                yield head + msgspec.json.encode(part) + tail
            continue
        choices = choices_of(msg)
        for i, c in enumerate(choices):
            if chat and c.index not in opened:
                yield chunk([opening(c.index)])
            last = i == len(choices) - 1 and not include_usage
            yield chunk([ending(c.index, c.finish_reason)], end=msg if last else None)
        if include_usage:
            yield chunk([], usage_body(msg), end=msg)
    yield b"data: [DONE]\n\n"
