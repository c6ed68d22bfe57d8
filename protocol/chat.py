"""Chat pieces carried by client messages and replies: messages, tools, tool calls, output formats, logprobs."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta

from protocol.common import Struct

MAX_TOOLS = 256
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's limit)

ToolName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
"""OpenAI's rule for function names (letters, digits, `_`, `-`), plus `.` which MCP tool names use."""
CallId = Annotated[str, Meta(min_length=1, max_length=128)]


class ToolCall(Struct, kw_only=True):
    """A function call the model made: in a result, and in an assistant message of the history."""

    id: CallId
    name: ToolName
    arguments: str  # a JSON object, as text (what OpenAI's `function.arguments` holds)


class TextPart(Struct, kw_only=True, tag_field="type", tag="text"):
    """A content part of text."""

    text: str


class ImagePart(Struct, kw_only=True, tag_field="type", tag="image"):
    """A content part holding an image: the file as the client sent it (PNG, JPEG, GIF, BMP, WebP...), its bytes
    whole, base64 already decoded. Served by a model with a vision projector, read at its place among the text parts."""

    data: Annotated[bytes, Meta(min_length=1)]
    detail: Annotated[str, Meta(max_length=32)] | None = None  # OpenAI's hint: "low", "high", "auto"


class ChatMessage(Struct, kw_only=True):
    """One message of a conversation, with every field the OpenAI chat API has for it.

    `content` is a string or a list of text and image parts (images in any message but an assistant's); it may be
    null only on an assistant message that makes tool calls. `tool_calls` and `reasoning_content` belong to assistant
    messages, `tool_call_id` to tool messages (it must name a call of an earlier assistant message).
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: CallId | None = None
    reasoning_content: str | None = None

    def __post_init__(self) -> None:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry `tool_calls`, not {self.role}")
        if self.reasoning_content is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry `reasoning_content`, not {self.role}")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the `tool_call_id` of the call it answers")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"only tool messages carry `tool_call_id`, not {self.role}")
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.reasoning_content)):
            raise ValueError(f"a {self.role} message needs `content`")
        if self.role == "assistant" and self.images():
            raise ValueError("an assistant message carries no image parts (the model writes text)")

    def text(self) -> str:
        """The content's text as one string (text parts joined, image parts left out; null is empty)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[ImagePart]:
        """The content's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [p for p in self.content if isinstance(p, ImagePart)]


class Tool(Struct, kw_only=True):
    """A function the model may call. `parameters` is a JSON Schema for its arguments object."""

    name: ToolName
    description: str = ""
    parameters: dict[str, Any] = {}
    strict: bool = False  # accepted for compatibility: arguments always follow the schema when a grammar applies


class NamedTool(Struct, kw_only=True):
    """tool_choice naming the one function the model must call."""

    name: ToolName


ToolChoice = Literal["auto", "none", "required"] | NamedTool


class ResponseFormat(Struct, kw_only=True):
    """The shape of the reply: free text, any JSON object, or JSON following `schema`."""

    type: Literal["text", "json_object", "json_schema"]
    schema: dict[str, Any] | None = None  # with json_schema
    name: str | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        if self.type == "json_schema" and self.schema is None:
            raise ValueError("`response_format` json_schema needs a `schema`")
        if self.type != "json_schema" and self.schema is not None:
            raise ValueError(f"`response_format` {self.type} takes no `schema`")


class TopLogprob(Struct, kw_only=True):
    token: int
    logprob: float
    piece: bytes = b""  # the token's bytes (may be part of a UTF-8 character)


class TokenLogprob(Struct, kw_only=True):
    """The log-probability of a sampled token under the model (before penalties, biases and grammars), and the
    most likely tokens at that position, most likely first."""

    token: int
    logprob: float
    piece: bytes = b""
    top: list[TopLogprob] = []


class ToolCallDelta(Struct, kw_only=True):
    """Part of a streamed tool call: `id` and `name` come on the first piece of call `index` (and only there), then
    `arguments` arrives in pieces, as the model writes them, whose concatenation is the call's arguments text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
