"""Messages between clients and the router's client socket (ROUTER, bound; clients connect DEALER)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from protocol.chat import MAX_TOOLS, ChatMessage, ResponseFormat, TokenLogprob, Tool, ToolCall, ToolCallDelta, ToolChoice
from protocol.common import (
    DeadlineMs,
    Defaultable,
    Message,
    NonNeg,
    Overflow,
    Priority,
    Sampling,
    SessionId,
    Struct,
    Timings,
    TokenBytes,
    Usage,
)
from protocol.tokens import check_token_bytes

RequestId = Annotated[str, Meta(min_length=1, max_length=128)]
ModelName = Annotated[str, Meta(min_length=1, max_length=256)]
MAX_CHOICES = 16
MAX_GRAMMAR_CHARS = 256 * 1024


# ---- client -> router -------------------------------------------------------------------------


class Submit(Message, tag="submit", kw_only=True):
    """Start a generation. Exactly one of `prompt`, `messages`, `tokens` is set.

    Tools, tool_choice, parallel_tool_calls and chat_template_kwargs go with `messages` only. At most one of
    `response_format` (other than text), `grammar` and a forcing tool_choice (`required`, a named function)
    shapes the output.
    """

    id: RequestId | None = None  # client's id, echoed on every reply; the router assigns one if absent
    prompt: str | None = None  # raw text, tokenized as is (BOS added by the model's rule)
    messages: list[ChatMessage] | None = None  # chat, rendered with the router's chat template
    tokens: TokenBytes | None = None  # token ids, used as given
    sampling: Sampling = msgspec.field(default_factory=Sampling)
    # the sampling fields the client left to the server (`Sampling` names of DEFAULTABLE): the router gives them the
    # model's defaults (the operator's flags, else the GGUF's general.sampling.*, else llama-server's)
    sampling_unset: list[Defaultable] = []
    stream: bool = True  # send `delta` messages; the `result` comes either way
    deadline_ms: DeadlineMs | None = None  # relative to the router's receipt
    tools: list[Tool] | None = None  # functions the model may call (rendered by the template)
    tool_choice: ToolChoice = "auto"  # "required" and a named function are enforced with a grammar
    parallel_tool_calls: bool = True  # False: at most one call per reply
    response_format: ResponseFormat | None = None  # JSON output, enforced with a grammar
    grammar: Annotated[str, Meta(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None  # GBNF or Lark
    chat_template_kwargs: dict[str, Any] = {}  # extra variables for the chat template (enable_thinking ...)
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] = 1  # choices; they share the prompt's KV
    # the tenant: cached prefixes are shared only between requests with the same salt (vLLM's name)
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    batch_deltas: bool = False  # this client reads `deltas`: its requests' deltas of one moment in one message
    # direct replies (PROTOCOL.md 4.3): an endpoint this client bound (PULL) where the worker sends the job's output
    reply_to: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    reply_key: Annotated[str, Meta(min_length=40, max_length=40)] | None = None  # its CURVE public key (Z85), if any
    # which served model (a name or alias, PROTOCOL.md 3.8); None: the router's default model
    model: ModelName | None = None
    # how long the model stays loaded after this request (Ollama's keep_alive): 0 unloads it once idle, -1 keeps it
    keep_alive_s: Annotated[float, Meta(ge=-1)] | None = None
    # whose share of the queue it counts against (an HTTP front: a digest of the API key it came with)
    owner: Annotated[str, Meta(min_length=1, max_length=64)] | None = None
    # hints (never required): the conversation or agent session this request continues (an HTTP front reads the
    # clients' own signals: Claude Code's session id, OpenAI's prompt_cache_key, ...), the session of the agent that
    # started it when it is a sub-agent's, and its priority: 1 interactive, 0 normal, -1 background (service_tier)
    session: SessionId | None = None
    parent_session: SessionId | None = None
    priority: Priority = 0

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.prompt, self.messages, self.tokens))
        if given != 1:
            raise ValueError(f"exactly one of prompt, messages, tokens must be set, got {given}")
        check_token_bytes("tokens", self.tokens, empty_ok=False)
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        if self.reply_key is not None and self.reply_to is None:
            raise ValueError("`reply_key` needs `reply_to`")
        if self.messages is None and (self.tools is not None or self.chat_template_kwargs or self.tool_choice != "auto"):
            raise ValueError("`tools`, `tool_choice` and `chat_template_kwargs` need `messages`")
        if self.tools is not None and len(self.tools) > MAX_TOOLS:
            raise ValueError(f"at most {MAX_TOOLS} `tools`, got {len(self.tools)}")
        if self.tool_choice != "auto" and not self.tools and self.tool_choice != "none":
            raise ValueError("`tool_choice` requires `tools`")
        forcing = (self.tools and not isinstance(self.tool_choice, str)) or self.tool_choice == "required"
        shaped = self.response_format is not None and self.response_format.type != "text"
        if sum((bool(forcing), shaped, self.grammar is not None)) > 1:
            raise ValueError("at most one of `response_format`, `grammar` and a forced `tool_choice` can shape the output")


class Cancel(Message, tag="cancel", kw_only=True):
    """Stop a request this client submitted. Its `result` follows with finish_reason `cancelled`."""

    id: RequestId


class StatusRequest(Message, tag="status", kw_only=True):
    """Ask for the router's view of workers and slots."""

    id: RequestId | None = None
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None  # whose slots show in full


class Tokenize(Message, tag="tokenize", kw_only=True):
    """Tokens of a text, or of chat messages rendered as a `submit` would render them (with its tools and
    chat_template_kwargs); nothing is generated. Exactly one of `prompt`, `messages`."""

    id: RequestId | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] = {}
    add_special: bool = True  # add BOS as the model's vocabulary says (for messages: unless the template wrote it)
    parse_special: bool = True  # text such as `<start_of_turn>` becomes its special token
    with_pieces: bool = False  # also each token's bytes
    # which served model (a name or alias, PROTOCOL.md 3.8); None: the router's default model
    model: ModelName | None = None
    # whose share of the router's preparing threads it counts against (an HTTP front: a digest of the API key)
    owner: Annotated[str, Meta(min_length=1, max_length=64)] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of `prompt`, `messages` must be set")
        if self.messages is not None and not self.messages:
            raise ValueError("`messages` must not be empty")
        if self.messages is None and (self.tools is not None or self.chat_template_kwargs):
            raise ValueError("`tools` and `chat_template_kwargs` need `messages`")


class Detokenize(Message, tag="detokenize", kw_only=True):
    """The text of token ids."""

    id: RequestId | None = None
    tokens: TokenBytes
    # which served model (a name or alias, PROTOCOL.md 3.8); None: the router's default model
    model: ModelName | None = None
    # whose share of the router's preparing threads it counts against (an HTTP front: a digest of the API key)
    owner: Annotated[str, Meta(min_length=1, max_length=64)] | None = None

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class MetricsRequest(Message, tag="metrics", kw_only=True):
    """Ask for the router's and its workers' metrics."""

    id: RequestId | None = None


MAX_EMBED_INPUTS = 2048
Pooling = Literal["mean", "last", "cls"]


class Embed(Message, tag="embed", kw_only=True):
    """The vectors of whole inputs (an embeddings API): exactly one of `input` (texts, tokenized as a prompt is) and
    `tokens`. Computed by a worker in a context of its own, with `pooling` over each input's tokens."""

    id: RequestId | None = None
    input: list[str] | None = None
    tokens: list[TokenBytes] | None = None
    pooling: Pooling | None = None  # None: the model's own (the pooling its GGUF declares, if one of these), else mean
    normalize: bool = True  # each vector to unit length (Euclidean), as OpenAI's and llama-server's are
    # which served model (a name or alias, PROTOCOL.md 3.8); None: the router's default model
    model: ModelName | None = None
    deadline_ms: DeadlineMs | None = None  # relative to the router's receipt of the inputs (tokenized)
    # whose share of the queue it counts against (an HTTP front: a digest of the API key it came with)
    owner: Annotated[str, Meta(min_length=1, max_length=64)] | None = None

    def __post_init__(self) -> None:
        if (self.input is None) == (self.tokens is None):
            raise ValueError("exactly one of `input`, `tokens` must be set")
        name, given = ("input", self.input) if self.input is not None else ("tokens", self.tokens)
        assert given is not None
        if not 1 <= len(given) <= MAX_EMBED_INPUTS:
            raise ValueError(f"`{name}` must hold between 1 and {MAX_EMBED_INPUTS} inputs, got {len(given)}")
        for i, t in enumerate(self.tokens or []):
            check_token_bytes(f"`tokens[{i}]`", t, empty_ok=False)
        if self.input is not None and any(not text for text in self.input):
            raise ValueError("an `input` text must not be empty")


class Rerank(Message, tag="rerank", kw_only=True):
    """Score each document's relevance to `query` with a reranker: a model whose GGUF declares `rank` pooling (a
    cross-encoder such as bge-reranker or jina-reranker, or Qwen3-Reranker); any other model answers `bad_request`
    naming `model`. Each (query, document) pair is one input, made as llama-server makes it (the GGUF's `rerank`
    template, else [BOS] query [EOS] [SEP] document [EOS]) and computed like an `embed` input."""

    id: RequestId | None = None
    query: str
    documents: list[str]
    # which served model (a name or alias, PROTOCOL.md 3.8); None: the router's default model
    model: ModelName | None = None
    deadline_ms: DeadlineMs | None = None  # as `Embed.deadline_ms`
    # whose share of the queue it counts against (an HTTP front: a digest of the API key it came with)
    owner: Annotated[str, Meta(min_length=1, max_length=64)] | None = None

    def __post_init__(self) -> None:
        if not 1 <= len(self.documents) <= MAX_EMBED_INPUTS:
            raise ValueError(f"`documents` must hold between 1 and {MAX_EMBED_INPUTS} documents, got {len(self.documents)}")


ClientRequest = Submit | Cancel | StatusRequest | Tokenize | Detokenize | MetricsRequest | Embed | Rerank


# ---- router -> client -------------------------------------------------------------------------


class Delta(Message, tag="delta", kw_only=True):
    """New output of choice `index`. `text` is reply text (valid UTF-8; tool-call syntax and reasoning are
    taken out of it and sent as `tool_calls` and `reasoning`); a token may carry no text until its bytes
    complete, or while the router is deciding whether it starts a tool call."""

    id: RequestId
    text: str
    tokens: TokenBytes
    index: int = 0
    reasoning: str = ""  # text of the model's thinking (`<think>`), for templates that have it
    tool_calls: list[ToolCallDelta] = []
    logprobs: list[TokenLogprob] = []  # one per token in `tokens`, when sampling.logprobs is set
    usage: Usage | None = None  # on the first delta of each choice: the prompt's tokens and how many were cached

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class Deltas(Message, tag="deltas", kw_only=True):
    """Several `delta`s for one client, in the order they were made: sent instead of each one alone to a client whose
    `submit` said `batch_deltas` (a gateway streams many requests; the cost is per message more than per token)."""

    items: list[Delta]


class ReplyFormat(Struct, kw_only=True):
    """How to read a job's raw output (chat/output.py's OutputSpec): the tool-call syntax, the thinking tags."""

    family: str = ""  # tool-call syntax to look for ("": none): hermes, llama3, mistral, mistral-args, gemma, derived:{...}
    tool_names: list[str] = []
    reasoning: list[str] = []  # the template's thinking tags, [open, close], if it has them
    in_reasoning: bool = False  # the prompt ended inside an open thinking tag
    # [tool, parameter] for each string parameter of the tools (syntaxes that write values untyped, as Qwen3-Coder's)
    string_args: list[list[str]] = []


class Placed(Message, tag="placed", kw_only=True):
    """To a client whose submit gave `reply_to`: the request runs as `job` on `worker`, whose output comes from that
    worker straight to reply_to (`job_start`, `job_delta`s, `job_done`; PROTOCOL.md 4.3). A request placed again
    (its worker died before any output) gets another `placed`."""

    id: RequestId
    job: str
    worker: str
    slot: int
    format: ReplyFormat
    prompt_tokens: NonNeg
    queue_ms: float = 0.0  # time it waited in the router
    dropped_messages: NonNeg = 0  # as in Result
    dropped_tokens: NonNeg = 0


class Choice(Struct, kw_only=True):
    """One of the n replies of a request with n > 1."""

    index: int
    finish_reason: str
    text: str
    tokens: TokenBytes
    reasoning: str | None = None
    tool_calls: list[ToolCall] = []
    logprobs: list[TokenLogprob] = []
    stop: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens this choice did not compute (copied from the choice that did)


class Result(Message, tag="result", kw_only=True):
    """The end of a request: always the last message for its id (unless an `error` is)."""

    id: RequestId
    finish_reason: str
    text: str  # the reply text (stop string, tool-call syntax and reasoning excluded)
    tokens: TokenBytes  # every generated token id
    usage: Usage
    timings: Timings
    worker: str = ""
    slot: int = -1
    stop: str | None = None  # the stop string that ended it, if any
    reasoning: str | None = None  # the model's thinking, split from `text` (templates with `<think>`)
    tool_calls: list[ToolCall] = []  # parsed from the output; finish_reason is then `tool_calls`
    logprobs: list[TokenLogprob] = []  # one per generated token, when sampling.logprobs is set
    choices: list[Choice] = []  # n > 1: every choice in index order (the fields above repeat choice 0)
    # the router's --context-shift dropped this many of the oldest messages (and so many prompt tokens) to fit a slot
    dropped_messages: NonNeg = 0
    dropped_tokens: NonNeg = 0

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class Error(Message, tag="error", kw_only=True):
    """A request failed, or a frame could not be served. `id` is null when no id could be read."""

    id: str | None = None
    code: str
    message: str
    error_id: str | None = None  # unique id for `internal` errors, also in the logs
    retry_after_ms: int | None = None  # set with `queue_full`
    param: str | None = None  # the request field to blame, when one is (`tools[0].function.parameters` ...)
    overflow: Overflow | None = None  # with `context_overflow`: the numbers


class SlotStatus(Struct, kw_only=True):
    slot: int
    busy: bool
    n_tokens: int  # tokens whose KV the slot holds
    request_id: str | None = None
    reused_total: int = 0  # tokens reused on this slot so far
    last_used_s: float = 0.0  # seconds since the slot last finished a job
    other_tenant: bool = False  # it holds another tenant's prompt: its length, request and reuse are not shown
    session: str | None = None  # the session (Submit.session) of the request it last ran (not shown to another tenant)
    awaited_s: float = 0.0  # seconds its session is still expected back for this KV (0: not awaited)


class WorkerStatus(Struct, kw_only=True):
    worker: str
    incarnation: int
    device: str
    state: str  # "ready", "draining"
    queue: int
    slots: list[SlotStatus]
    restarts: int = 0
    ctx_per_slot: int = 0  # tokens one slot holds at most
    kv_bytes_per_slot: int = 0  # bytes of KV cache one slot takes (its --cache-type-k/-v)


class FailedWorker(Struct, kw_only=True):
    """A local worker that will not be started again, and why (it crashed at start too often)."""

    worker: str
    reason: str


class ModelStatus(Struct, kw_only=True):
    """A model the router serves, and where it is loaded."""

    name: str
    aliases: list[str] = []
    state: str  # "loaded" (a worker is ready), "loading", "unloaded" (started on demand), "failed"
    workers: list[str] = []  # the workers connected for it
    pinned: bool = False  # never unloaded to make room
    keep_alive_s: float = -1.0  # unloaded after this long unused (-1: never)
    reason: str = ""  # why it failed to load
    memory_mb: float = 0.0  # what one of its workers takes, as the memory budget counts it (0: not known)
    # what a request that leaves a sampling field to the server gets (by `Sampling` field), where each value comes from
    # ("models file", "flag", "gguf", "llama-server"), and the GGUF's sampling keys kvroute does not run (key: value)
    sampling: dict[str, int | float] = {}
    sampling_from: dict[str, str] = {}
    sampling_not_applied: dict[str, str] = {}
    default_max_tokens: NonNeg = 0  # the output cap of a request that sets none (0: the slot's context)
    # how tools reach the model: its template's tool-call family ("hermes", ...), or "generic" (a JSON format
    # described in a system message; for a template without tool syntax, only where a call is required unless the
    # operator said --generic-tools); "" not known
    tool_format: str = ""


class StatusReply(Message, tag="status_reply", kw_only=True):
    id: str | None = None
    model: str  # the default model's name
    policy: str
    queued: int
    workers: list[WorkerStatus]
    failed: list[FailedWorker] = []
    models: list[ModelStatus] = []  # every served model (one with a single model)


class Tokens(Message, tag="tokens", kw_only=True):
    """The answer to `tokenize` and `detokenize`."""

    id: str | None = None
    tokens: TokenBytes
    text: str  # the text tokenized (for messages: the rendered prompt), or the text of the tokens
    pieces: list[bytes] = []  # with_pieces: each token's bytes (a piece may be part of a UTF-8 character)

    def __post_init__(self) -> None:
        check_token_bytes("tokens", self.tokens)


class MetricsReply(Message, tag="metrics_reply", kw_only=True):
    """The answer to `metrics`: Prometheus' text exposition format (what an HTTP front serves at /metrics)."""

    id: str | None = None
    text: str


class Embeddings(Message, tag="embeddings", kw_only=True):
    """The answer to `embed`: one vector per input, in order."""

    id: str | None = None
    vectors: list[bytes]  # each `dims` float32, little-endian
    dims: NonNeg
    prompt_tokens: NonNeg  # the inputs' tokens, all together
    worker: str = ""
    cached_tokens: NonNeg = 0  # of those, tokens whose KV was reused, not computed (last-token pooling)


class Ranked(Message, tag="ranked", kw_only=True):
    """The answer to `rerank`: one score per document, in the documents' order, higher for more relevant, on the
    model's own scale (llama.cpp's rank output: a logit for a cross-encoder, the probability of "yes" for
    Qwen3-Reranker), as llama-server answers."""

    id: str | None = None
    scores: list[float]
    prompt_tokens: NonNeg  # the inputs' tokens, all together
    worker: str = ""
    cached_tokens: NonNeg = 0  # of those, tokens whose KV was reused, not computed (a causal reranker's shared head)


RouterReply = Delta | Deltas | Result | Error | Placed | StatusReply | Tokens | MetricsReply | Embeddings | Ranked
