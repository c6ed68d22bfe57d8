"""OpenAI request bodies -> protocol `Submit`, and protocol results -> OpenAI response bodies.

Unknown fields are ignored, as OpenAI servers do; a supported field with a value we cannot serve is a
400 naming the field.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from protocol import MAX_DEADLINE_MS, ChatMessage, Result, Sampling, Submit, pack_tokens

OPENAI_COMPLETIONS_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


class RequestError(Exception):
    """A request body we cannot serve: HTTP status, OpenAI error type, param name."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = message, param, status, code, type_


def _get(body: dict[str, Any], name: str, types: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise RequestError(f"`{name}` must be {' or '.join(t.__name__ for t in types)}, got a boolean", param=name)
    if not isinstance(value, types):
        raise RequestError(f"`{name}` must be {' or '.join(t.__name__ for t in types)}, got {type(value).__name__}", param=name)
    return value


def _sampling(body: dict[str, Any], default_max_tokens: int | None) -> Sampling:
    n = _get(body, "n", (int,), 1)
    if n != 1:
        raise RequestError("only n=1 is supported", param="n")
    max_tokens = _get(body, "max_completion_tokens", (int,))
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), default_max_tokens)
    stop = _get(body, "stop", (str, list), [])
    if isinstance(stop, str):
        stop = [stop]
    if not all(isinstance(s, str) for s in stop):
        raise RequestError("`stop` must be a string or a list of strings", param="stop")
    bias = _get(body, "logit_bias", (dict,), {})
    fields = {
        "max_tokens": max_tokens,
        "temperature": _get(body, "temperature", (int, float), 1.0),
        "top_p": _get(body, "top_p", (int, float), 1.0),
        "top_k": _get(body, "top_k", (int,), 0),
        "min_p": _get(body, "min_p", (int, float), 0.0),
        "seed": _get(body, "seed", (int,)),
        "logit_bias": {str(k): v for k, v in bias.items()},
        "stop": [s for s in stop if s],
        "ignore_eos": _get(body, "ignore_eos", (bool,), False),
    }
    try:
        return msgspec.convert(fields, Sampling)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("$.", 1)[-1].split(".")[0].strip("`[]0123456789") if "$." in text else None
        raise RequestError(f"invalid sampling parameter: {text}", param=param) from None


def _deadline_ms(body: dict[str, Any]) -> int | None:
    """kvroute extension: `deadline_ms`, the most milliseconds the request may take (504 past it)."""
    value = _get(body, "deadline_ms", (int,))
    if value is not None and not 1 <= value <= MAX_DEADLINE_MS:
        raise RequestError(f"`deadline_ms` must be an integer from 1 to {MAX_DEADLINE_MS}", param="deadline_ms")
    return value


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _get(body, "stream", (bool,), False)
    opts = _get(body, "stream_options", (dict,), {})
    include_usage = bool(opts.get("include_usage", False)) if stream else False
    return stream, include_usage


def completion_submit(body: dict[str, Any], request_id: str) -> tuple[Submit, bool, bool]:
    """/v1/completions body -> (submit, stream?, include_usage?)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    tokens = None
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in prompt):
            raise RequestError(
                "`prompt` must be a string, or a list of token ids (a batch of several prompts is not supported)", param="prompt"
            )
        tokens, prompt = prompt, None
    elif not isinstance(prompt, str):
        raise RequestError("`prompt` is required and must be a string or a list of token ids", param="prompt")
    stream, include_usage = _stream_flags(body)
    sampling = _sampling(body, OPENAI_COMPLETIONS_MAX_TOKENS)
    packed = None if tokens is None else pack_tokens(tokens)
    sub = Submit(id=request_id, prompt=prompt, tokens=packed, sampling=sampling, stream=True, deadline_ms=_deadline_ms(body))
    return sub, stream, include_usage


def _content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError("only text content parts are supported", param=f"messages[{i}].content")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError("`content` must be a string or a list of text parts", param=f"messages[{i}].content")


def chat_submit(body: dict[str, Any], request_id: str) -> tuple[Submit, bool, bool]:
    """/v1/chat/completions body -> (submit, stream?, include_usage?)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("`messages` is required and must be a non-empty list", param="messages")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError("each message must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"unsupported role {role!r}", param=f"messages[{i}].role")
        chat.append(ChatMessage(role=role, content=_content(m, i)))
    stream, include_usage = _stream_flags(body)
    sampling = _sampling(body, None)
    sub = Submit(id=request_id, messages=chat, sampling=sampling, stream=True, deadline_ms=_deadline_ms(body))
    return sub, stream, include_usage


def usage_body(result: Result) -> dict[str, Any]:
    u = result.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def finish_reason(result: Result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def completion_body(result: Result, model: str, created: int) -> dict[str, Any]:
    return {
        "id": f"cmpl-{result.id}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason(result)}],
        "usage": usage_body(result),
    }


def chat_body(result: Result, model: str, created: int) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-{result.id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "logprobs": None,
                "finish_reason": finish_reason(result),
            }
        ],
        "usage": usage_body(result),
    }


def now() -> int:
    return int(time.time())
