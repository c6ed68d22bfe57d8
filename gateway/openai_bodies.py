"""The OpenAI request bodies kvroute serves, as typed structs: decoding checks them, and /openapi.json is made
from them, so the two cannot disagree.

The fields here are the honoured ones: they change the reply as OpenAI documents (plus llama.cpp's extensions
`top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`, `grammar`, `chat_template_kwargs`, and kvroute's `ignore_eos`,
`deadline_ms`, `cache_salt`); `prompt_cache_key`, `user`, `safety_identifier` and `service_tier` give the request's
session and priority (gateway/normalise.py). Hints and refusals are gateway/fields.py's policy, applied before these types see
a body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta

from gateway.fields import Strict
from protocol import (
    MAX_CHOICES,
    MAX_DEADLINE_MS,
    MAX_LOGPROBS,
    LogitBias,
    MaxTokens,
    MinP,
    Penalty,
    RepeatLastN,
    RepeatPenalty,
    Seed,
    TopK,
    TopP,
)

# ---- messages ---------------------------------------------------------------------------------------------------


class TextPart(Strict, tag_field="type", tag="text"):
    text: str


Detail = Annotated[str, Meta(max_length=32)]  # OpenAI's "auto", "low", "high": passed on to the model's projector


class ImageURL(Strict):
    url: str  # a data URL (data:image/png;base64,...) or bare base64; an http(s) one is fetched with --image-fetch
    detail: Detail | None = None


class ImagePart(Strict, tag_field="type", tag="image_url"):
    image_url: ImageURL


class AudioPart(Strict, tag_field="type", tag="input_audio"):
    input_audio: Any


class FilePart(Strict, tag_field="type", tag="file"):
    file: Any


class RefusalPart(Strict, tag_field="type", tag="refusal"):
    refusal: str


Part = TextPart | ImagePart | AudioPart | FilePart | RefusalPart


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # llama-server's and DeepSeek's field for a thinking model's reasoning
    refusal: str | None = None  # an assistant's refusal, kept in the history as its text


# ---- tools and formats ------------------------------------------------------------------------------------------


class FunctionDef(Strict):
    name: str
    description: str = ""
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Strict):
    type: Literal["function"]
    function: FunctionDef


class ChoiceFunction(Strict):
    name: str


class NamedChoice(Strict):
    type: Literal["function"]
    function: ChoiceFunction


class TextFormat(Strict, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(Strict, tag_field="type", tag="json_object"):
    pass


class JsonSchemaSpec(Strict):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class JsonSchemaFormat(Strict, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StreamOptions(Strict):
    include_usage: bool = False


# ---- the bodies -------------------------------------------------------------------------------------------------

Stop = str | Annotated[list[str], Meta(max_length=16)] | None
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]


class Common(Strict):
    """Fields both endpoints take."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    stop: Stop = None
    seed: Seed | None = None
    logit_bias: LogitBias | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    response_format: ResponseFormat | None = None
    # llama.cpp's extensions
    top_k: TopK | None = None
    min_p: MinP | None = None
    repeat_penalty: RepeatPenalty | None = None
    repeat_last_n: RepeatLastN | None = None
    grammar: str | None = None
    # kvroute's extensions
    ignore_eos: bool | None = None
    deadline_ms: Annotated[int, Meta(ge=1, le=MAX_DEADLINE_MS)] | None = None
    # vLLM's: cached prefixes are shared only between requests with the same salt (a tenant)
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    # the request's session and priority (gateway/normalise.py), read leniently (gateway/fields.py LENIENT)
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None


class ChatRequest(Common, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # the template's `reasoning_effort` (gpt-oss), and its `enable_thinking` off for "none" (llama-server's reading)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


Prompt = str | Annotated[list[Any], Meta(min_length=1)]  # text, token ids, or a batch of one of either


class CompletionRequest(Common, kw_only=True):
    prompt: Prompt
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None  # served only as false
    best_of: Annotated[int, Meta(ge=1, le=1)] | None = None  # served only as 1
    suffix: Annotated[str, Meta(max_length=0)] | None = None  # served only empty
