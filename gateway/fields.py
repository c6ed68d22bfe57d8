"""The field policy of every HTTP API, in one place: each request field is honoured, accepted as a hint, or refused.

- *honoured*: the field is in the API's request type (gateway/openai_bodies.py, responses.py, anthropic.py) and
  changes what is computed or returned. The fields that give a request's session and priority (`prompt_cache_key`,
  `user`, `safety_identifier`, Anthropic's `metadata.user_id`, `service_tier`: gateway/normalise.py) are honoured
  and read leniently (`LENIENT`): a value of another type, or a tier the API does not name, is a hint, not a 400;
- *hint* (`HINTS`): metadata, cache hints, knobs without meaning for this model, hosted tools the model cannot call.
  The request is served; the field is named in the log and counted in `kvroute_request_fields_ignored_total{api,field}`.
  A field the type does not know is a hint too (new clients add fields every month), unless the operator runs with
  `--strict-api`: then it is a 400 naming it. The metric's `field` label is one of a fixed set (`labels`: the hints,
  the refused names, the hosted tools and hint headers), or `other` for any name a client made up; the log line names
  the first LOGGED_FIELDS of them;
- *refused* (`REFUSED`, and values the types reject): the client would rely on something kvroute cannot do; a 400
  naming the field.

Fields are named by pattern: `tools[].defer_loading` is that field in any element of `tools`.
docs/apis.md's "Request fields" table and docs/reference.md (generated) are this module written out.
"""

from __future__ import annotations

import collections
import functools
import itertools
import re
from typing import Any

import msgspec
import msgspec.inspect as mi
from prometheus_client import Counter

from common import logs
from gateway.errors import RequestError

log = logs.get(__name__)

FIELDS_IGNORED = Counter(
    "kvroute_request_fields_ignored_total", "Request fields accepted as hints and not acted on, by API", ["api", "field"]
)

_OPENAI_COMMON = (
    "metadata",
    "store",
    "prompt_cache_retention",
    "cache_prompt",  # llama-server's: kvroute caches every prefix anyway
    "stream_options.include_obfuscation",
)

HINTS: dict[str, tuple[str, ...]] = {
    "chat": (
        *_OPENAI_COMMON,
        "verbosity",
        "prediction",  # a speed-up hint: the reply does not depend on it
        "web_search_options",  # a hosted tool
        "modalities",  # ["text"]; audio output is refused (`audio`)
        "messages[].audio",  # an earlier audio reply's id: its transcript is the content
        "tools[].function.strict",
    ),
    "completions": _OPENAI_COMMON,
    "responses": (
        *_OPENAI_COMMON,
        "client_metadata",
        "include",  # extra output fields kvroute never produces (encrypted reasoning, search sources, ...)
        "stream_options",
        "reasoning.summary",
        "reasoning.generate_summary",
        "text.verbosity",
        "truncation",
        "max_tool_calls",  # bounds hosted tool calls, of which there are none
        "tools[].strict",
        "tools[].tools[].strict",
    ),
    "messages": (
        "cache_control",
        "context_management",
        "container",
        "mcp_servers",  # servers the hosted API would call: nothing here calls them
        "output_config.effort",
        "output_config.task_budget",
        "thinking.budget_tokens",
        "system[].cache_control",
        "system[].citations",
        "messages[].content[].cache_control",
        "messages[].content[].citations",
        "messages[].content[].caller",
        "messages[].content[].content[].cache_control",
        "tools[].cache_control",
        "tools[].defer_loading",
        "tools[].strict",
        "tools[].input_examples",
        "tools[].eager_input_streaming",
        "tools[].allowed_callers",
    ),
    "embeddings": ("user",),
    "rerank": (
        "user",
        "raw_scores",  # TEI's: scores are the model's raw output, as llama-server's (a sigmoid keeps the order)
        "truncate",  # TEI's: an input over the context is refused, naming it
        "truncation_direction",
        "rank_fields",  # Cohere's: a document is its `text`
        "max_chunks_per_doc",
        "max_tokens_per_doc",
    ),
}

# llama-server's samplers kvroute does not have: refused when set to anything but their neutral value
_LLAMA_SAMPLERS = {
    "mirostat": "mirostat sampling is not supported",
    "typical_p": "typical sampling is not supported",
    "tfs_z": "tail-free sampling is not supported",
    "xtc_probability": "XTC sampling is not supported",
    "dry_multiplier": "DRY sampling is not supported",
    "dynatemp_range": "dynamic temperature is not supported",
    "top_n_sigma": "top-n-sigma sampling is not supported",
    "samplers": "a custom sampler order is not supported",
}
NEUTRAL: dict[str, Any] = {"typical_p": 1.0, "tfs_z": 1.0, "top_n_sigma": -1.0}

REFUSED: dict[str, dict[str, str]] = {
    "chat": {
        "audio": "audio output is not supported: the served model writes text",
        "functions": "the legacy `functions` are not supported: send them as `tools`",
        "function_call": "the legacy `function_call` is not supported: send `tool_choice`",
        **_LLAMA_SAMPLERS,
    },
    "completions": dict(_LLAMA_SAMPLERS),
    "responses": {
        "previous_response_id": "kvroute keeps no responses; send the whole conversation in `input` (it is served from cache)",
        "conversation": "kvroute keeps no conversations; send the whole conversation in `input` (it is served from cache)",
        "background": "background responses are not supported: kvroute keeps no responses to fetch later",
        "prompt": "stored prompt templates are not supported: send the prompt in `input`",
    },
    "messages": {},
    "embeddings": {},
    "rerank": {},
}

# request headers that are hints, by API: counted like fields, as `header:NAME`
HINT_HEADERS: dict[str, tuple[str, ...]] = {"messages": ("anthropic-beta",)}

# hosted tools (the provider runs them; the model here is not offered them), counted as `tools[].type=KIND` with a
# version's date dropped (`web_search_20250305`: `web_search`); a kind not listed here is counted as `other`
HOSTED_TOOLS: dict[str, tuple[str, ...]] = {
    "responses": (
        "web_search",
        "web_search_preview",
        "file_search",
        "code_interpreter",
        "computer",
        "computer_use_preview",
        "image_generation",
        "local_shell",
        "shell",
        "apply_patch",
        "mcp",
        "custom",
        "tool_search",
    ),
    "messages": ("web_search", "web_fetch", "code_execution", "tool_search_tool_regex", "tool_search_tool_bm25", "mcp_toolset"),
}

# honoured fields read leniently (gateway/normalise.py: the session and priority they give): a value the request type
# does not take (a `user` that is not a string) is a hint, served as if absent, never a 400; so is a `service_tier`
# the API does not name
_OPENAI_SIGNALS = ("prompt_cache_key", "user", "safety_identifier", "service_tier")
LENIENT: dict[str, tuple[str, ...]] = {
    "chat": _OPENAI_SIGNALS,
    "completions": _OPENAI_SIGNALS,
    "responses": _OPENAI_SIGNALS,
    "messages": ("metadata", "service_tier"),
    "embeddings": (),
    "rerank": (),
}

# other hints a decoder records by value: a block that is not text and is dropped, an `x-priority` it does not know
_PRIORITY_HEADER = "header:x-priority"
VALUE_HINTS: dict[str, tuple[str, ...]] = {
    "chat": (_PRIORITY_HEADER,),
    "completions": (_PRIORITY_HEADER,),
    "responses": (_PRIORITY_HEADER,),
    "messages": ("messages[].content[].type=redacted_thinking", _PRIORITY_HEADER),
}

OTHER = "other"  # the metric's label for a field name outside the fixed set (a client's own, or a made-up one)
LOGGED_FIELDS = 20  # field names a log line names; the rest are a count
LOGGED_NAME_CHARS = 80  # of each (a JSON key may be a megabyte long)
_MAX_UNKNOWN = 256  # conversions of a body, each finding one unknown field the walk missed (none is known to)
_DATED = re.compile(r"_(\d{8}|\d{4}_\d{2}_\d{2})$")  # a hosted tool's version: `_20250305`, `_2025_03_11`


class Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A request shape that refuses fields it does not name (every HTTP API's body types derive from it): the policy
    finds a body's unknown fields by it, then strips them as hints or, with --strict-api, refuses them."""


class FieldError(ValueError):
    """A field refused by the policy: `param` names it (a path such as `tools[2].type`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def pattern(path: str) -> str:
    """A field path with its indices dropped: `tools[3].defer_loading` -> `tools[].defer_loading`."""
    return re.sub(r"\[\d+\]", "[]", path)


def _segments(pat: str) -> list[str]:
    return [s for s in re.split(r"\.|(\[\])", pat) if s]


def _pop(obj: Any, segments: list[str]) -> bool:
    """Remove the field a pattern names from everywhere it is in `obj`; whether anything was there."""
    if not segments:
        return False
    head, rest = segments[0], segments[1:]
    if head == "[]":
        return any([_pop(x, rest) for x in obj]) if isinstance(obj, list) else False
    if not isinstance(obj, dict) or head not in obj:
        return False
    if not rest:
        del obj[head]
        return True
    return _pop(obj[head], rest)


def validation_problem(exc: Exception) -> tuple[str | None, str, str]:
    """What a body failed on, from msgspec's error (or a struct's own check): (the path of a field the type does not
    have, or None; the path of the value at fault, '' for the body itself; the message without the path). Paths as
    `messages[0].role`."""
    text = str(exc)
    at = re.search(r" - at `\$\.?([^`]*)`$", text)
    where = at.group(1) if at else ""
    unknown = re.match(r"Object contains unknown field `([^`]*)`", text)
    if unknown:
        return (f"{where}.{unknown.group(1)}" if where else unknown.group(1)), where, text
    return None, where, text.split(" - at ")[0]


@functools.cache
def _field_types(kind: Any) -> dict[str, Any]:
    """A request type's fields by their JSON names, with their types."""
    return {f.encode_name: f.type for f in msgspec.structs.fields(kind)}


@functools.cache
def _info(kind: Any) -> mi.Type:
    return mi.type_info(kind)


def _struct_for(value: dict[str, Any], t: mi.Type) -> mi.StructType | None:
    """The struct type a JSON object is read as under `t` (a union's tagged member by its tag), if any."""
    if isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.StructType):
        return t
    if isinstance(t, mi.UnionType):
        structs = [m for m in t.types if isinstance(m, mi.StructType)]
        if len(structs) == 1:
            return structs[0]
        return next((m for m in structs if m.tag_field and value.get(m.tag_field) == m.tag), None)
    return None


def _items_type(t: mi.Type) -> mi.Type | None:
    """The type of a JSON array's items under `t`, if it reads arrays as lists."""
    if isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        t = next((m for m in t.types if isinstance(m, mi.ListType | mi.VarTupleType | mi.SetType)), mi.AnyType())
    return t.item_type if isinstance(t, mi.ListType | mi.VarTupleType | mi.SetType) else None


def unknown_fields(raw: Any, kind: Any, at: str = "") -> list[str]:
    """The paths of every field `kind` does not know in `raw` (a parsed JSON value), found in one walk beside the
    type's description and removed from `raw` (a loop of conversions, each stopping at the next unknown field, was
    quadratic: 256 of them in a large body took the HTTP loop seconds)."""
    found: list[str] = []
    stack: list[tuple[Any, mi.Type, str]] = [(raw, _info(kind), at)]
    while stack:
        value, t, where = stack.pop()
        if isinstance(value, dict):
            struct = _struct_for(value, t)
            if struct is None:
                continue
            fields = {f.encode_name: f.type for f in struct.fields}
            for key in list(value):
                path = f"{where}.{key}" if where else key
                if key in fields:
                    stack.append((value[key], fields[key], path))
                elif key != struct.tag_field and struct.forbid_unknown_fields:
                    found.append(path)
                    del value[key]
        elif isinstance(value, list) and (item := _items_type(t)) is not None:
            stack.extend((v, item, f"{where}[{i}]") for i, v in enumerate(value))
    return found


@functools.cache
def labels(api: str) -> frozenset[str]:
    """Every `field` label an API's hints are counted under but `other`: a fixed set, so that made-up names cannot
    add series to /metrics without bound."""
    return frozenset(
        (
            *HINTS[api],
            *REFUSED[api],
            *LENIENT[api],
            *(f"header:{h}" for h in HINT_HEADERS.get(api, ())),
            *(f"tools[].type={kind}" for kind in HOSTED_TOOLS.get(api, ())),
            *VALUE_HINTS.get(api, ()),
        )
    )


def undated(kind: str) -> str:
    """A hosted tool's kind without its version's date: `web_search_20250305` -> `web_search`."""
    return _DATED.sub("", kind)


def label(api: str, field: str) -> str:
    """The metric's label for a hint: the field's pattern when it is one of `labels(api)`, else `other`."""
    if field.startswith("tools[].type="):
        field = "tools[].type=" + undated(field.removeprefix("tools[].type="))
    return field if field in labels(api) else OTHER


class Policy:
    """One API's policy for one request: decodes bodies (and parts of them), strips hints, collects what it strips."""

    def __init__(self, api: str, *, strict: bool = False) -> None:
        self.api, self.strict = api, strict
        self._ignored: dict[str, None] = {}  # (a set in the order seen: one look-up per field, however many)

    @property
    def ignored(self) -> list[str]:
        """The hints recorded, each once, in the order first seen."""
        return list(self._ignored)

    def hint(self, field: str) -> None:
        """Record a field (a pattern) accepted and not acted on."""
        self._ignored[field] = None

    def decode(self, raw: Any, kind: Any, *, at: str = "") -> Any:
        """`raw` (a parsed JSON value, modified in place) as `kind`: refused fields raise FieldError; known hints are
        stripped and recorded; unknown fields too, or, with `strict`, raise FieldError. `at` is where `raw` is in
        the body (`input[2]`), for names. Other validation errors are raised as msgspec's."""
        prefix = pattern(at)
        if isinstance(raw, dict):
            for field, why in REFUSED[self.api].items() if not prefix else ():
                value = raw.get(field)
                if value not in (None, False, 0, NEUTRAL.get(field)):
                    raise FieldError(f"`{field}` is not supported: {why}", field)
        for pat in HINTS[self.api]:
            if prefix:
                if not pat.startswith(prefix + "."):
                    continue
                pat = pat[len(prefix) + 1 :]
            if _pop(raw, _segments(pat)):
                self.hint(f"{prefix}.{pat}" if prefix else pat)
        if not self.strict:
            for path in sorted(unknown_fields(raw, kind, at)):
                self.hint(pattern(path))
        if isinstance(raw, dict) and not prefix:
            self._lenient(raw, kind)
        for _ in range(_MAX_UNKNOWN):  # (what the walk did not see, and --strict-api's first unknown field)
            try:
                return msgspec.convert(raw, kind)
            except msgspec.ValidationError as exc:
                inner = validation_problem(exc)[0]
                if inner is None:
                    raise
                path = f"{at}.{inner}" if at and not inner.startswith("[") else f"{at}{inner}"
                if self.strict:
                    raise FieldError(f"`{path}` is not a field kvroute knows (the server runs with --strict-api)", path) from None
                _pop(raw, _segments(pattern(inner)))
                self.hint(pattern(path))
        raise FieldError("the request has too many unknown fields", at or "body")

    def _lenient(self, raw: dict[str, Any], kind: Any) -> None:
        """The API's LENIENT fields whose values `kind` does not take, removed from `raw` and recorded as hints."""
        types = _field_types(kind) if LENIENT[self.api] else {}
        for name in LENIENT[self.api]:
            if raw.get(name) is None or name not in types:
                continue
            try:
                msgspec.convert(raw[name], types[name])
            except msgspec.ValidationError:
                del raw[name]
                self.hint(name)

    def report(self, request_id: str) -> None:
        """Count and log the hints this request carried (once per request): each label once, by how many of the
        request's fields it stands for; the log names the first LOGGED_FIELDS fields and counts the rest."""
        if not self._ignored:
            return
        counts = collections.Counter(label(self.api, field) for field in self._ignored)
        for name, n in counts.items():
            FIELDS_IGNORED.labels(self.api, name).inc(n)
        named = [field[:LOGGED_NAME_CHARS] for field in itertools.islice(self._ignored, LOGGED_FIELDS)]
        more = len(self._ignored) - len(named)
        log.info("request_fields_ignored", api=self.api, request_id=request_id, fields=named, **({"more": more} if more else {}))


def decode(body: dict[str, Any], kind: Any, policy: Policy, *, at: str = "") -> Any:
    """A JSON body (or a part of one, at `at`) checked against its type under the policy. Raises RequestError naming
    the field."""
    try:
        return policy.decode(body, kind, at=at)
    except FieldError as exc:
        raise RequestError(exc.message, param=exc.param) from None
    except msgspec.ValidationError as exc:
        _, where, message = validation_problem(exc)
        if at:
            where = f"{at}.{where}" if where and not where.startswith("[") else f"{at}{where}"
        raise RequestError(
            f"invalid `{where}`: {message}" if where else f"invalid request: {message}", param=where or None
        ) from None


def table() -> dict[str, dict[str, list[str]]]:
    """The hints and refusals of every API (for docs/reference.md and tests)."""
    return {api: {"hints": list(HINTS[api]), "refused": list(REFUSED[api])} for api in HINTS}
