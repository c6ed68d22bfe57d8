"""The OpenAPI document served at /openapi.json, generated from the request types the gateway decodes with
(gateway/openai_bodies.py): what it documents is what the code checks."""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.anthropic import CountTokensRequest, MessagesRequest
from gateway.llama_helpers import TokenizeBody
from gateway.openai_bodies import ChatRequest, CompletionRequest
from gateway.responses import ResponsesRequest

_error = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}

_usage = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
        "completion_tokens_details": {"type": "object", "properties": {"reasoning_tokens": {"type": "integer"}}},
    },
}

# llama-server's: prompt tokens reused (cache_n) and computed (prompt_n), generated (predicted_n), with times and rates
_timings = {
    "type": "object",
    "properties": {"cache_n": {"type": "integer"}}
    | {
        f"{phase}_{k}": {"type": "integer" if k == "n" else "number"}
        for phase in ("prompt", "predicted")
        for k in ("n", "ms", "per_token_ms", "per_second")
    },
}

_reply = {"type": "object", "properties": {"choices": {"type": "array"}, "usage": _usage, "timings": _timings}}


def _responses() -> dict[str, Any]:
    err = {"content": {"application/json": {"schema": _error}}}
    return {
        "200": {
            "description": "OK",
            "content": {"application/json": {"schema": _reply}, "text/event-stream": {"schema": {"type": "string"}}},
        },
        "400": {"description": "Bad request (the field is named in `param`), or context overflow", **err},
        "401": {"description": "Missing or wrong API key", **err},
        "404": {"description": "Model not found", **err},
        "413": {"description": "Request too large", **err},
        "429": {"description": "Queue full", **err},
        "503": {"description": "No workers", **err},
        "504": {"description": "Deadline exceeded", **err},
    }


def _post(operation: str, body: str | dict[str, Any], ok: str = "OK") -> dict[str, Any]:
    schema = {"$ref": f"#/components/schemas/{body}"} if isinstance(body, str) else body
    responses = _responses()
    responses["200"]["description"] = ok
    return {
        "post": {
            "operationId": operation,
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
            "responses": responses,
        }
    }


_TYPES = [ChatRequest, CompletionRequest, ResponsesRequest, MessagesRequest, CountTokensRequest, TokenizeBody]
_, _schemas = msgspec.json.schema_components(_TYPES, ref_template="#/components/schemas/{name}")
_detokenize = {"type": "object", "properties": {"tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "kvroute OpenAI-compatible API", "version": "1"},
    "paths": {
        "/v1/completions": _post("createCompletion", "CompletionRequest"),
        "/v1/chat/completions": _post("createChatCompletion", "ChatRequest"),
        "/v1/responses": _post("createResponse", "ResponsesRequest", "A response, or its events (stateless: nothing is stored)"),
        "/v1/messages": _post(
            "createMessage", "MessagesRequest", "An Anthropic message, or its events (errors in Anthropic's shape)"
        ),
        "/v1/messages/count_tokens": _post("countTokens", "CountTokensRequest", "{input_tokens}"),
        "/tokenize": _post("tokenize", "TokenizeBody", "{tokens}: ids, or {id, piece} with with_pieces"),
        "/detokenize": _post("detokenize", _detokenize, "{content}"),
        "/apply-template": _post("applyTemplate", "ChatRequest", "{prompt}: the chat rendered by the template"),
        "/slots": {"get": {"operationId": "slots", "responses": {"200": {"description": "Every worker and slot"}}}},
        "/props": {
            "get": {
                "operationId": "props",
                "parameters": [{"name": "model", "in": "query", "required": False, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The generation settings a request that sets none gets"}},
            }
        },
        "/v1/models": {"get": {"operationId": "listModels", "responses": {"200": {"description": "The served model"}}}},
        "/health": {
            "get": {
                "operationId": "health",
                "responses": {"200": {"description": "A worker is ready"}, "503": {"description": "No worker ready yet"}},
            }
        },
    },
    "components": {"schemas": _schemas},
}
