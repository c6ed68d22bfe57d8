"""The OpenAPI document served at /openapi.json: the subset of the OpenAI API that kvroute serves."""

from __future__ import annotations

from typing import Any

from protocol import MAX_DEADLINE_MS

_error = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": "string", "nullable": True},
                "code": {"type": "string", "nullable": True},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}

_sampling: dict[str, Any] = {
    "model": {"type": "string"},
    "max_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "seed": {"type": "integer", "minimum": 0, "maximum": 4294967294, "nullable": True},
    "n": {"type": "integer", "enum": [1]},
    "logit_bias": {"type": "object", "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "deadline_ms": {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_DEADLINE_MS,
        "description": "kvroute extension: 504 when the request takes longer",
    },
}

_usage = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}},
    },
}


def _responses(ok: dict[str, Any]) -> dict[str, Any]:
    err = {"content": {"application/json": {"schema": _error}}}
    return {
        "200": {
            "description": "OK",
            "content": {"application/json": {"schema": ok}, "text/event-stream": {"schema": {"type": "string"}}},
        },
        "400": {"description": "Bad request or context overflow", **err},
        "401": {"description": "Missing or wrong API key", **err},
        "404": {"description": "Model not found", **err},
        "429": {"description": "Queue full", **err},
        "503": {"description": "No workers", **err},
        "504": {"description": "Deadline exceeded", **err},
    }


OPENAPI: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "kvroute OpenAI-compatible API", "version": "1"},
    "paths": {
        "/v1/completions": {
            "post": {
                "operationId": "createCompletion",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["prompt"],
                                "properties": {
                                    "prompt": {
                                        "oneOf": [
                                            {"type": "string"},
                                            {"type": "array", "items": {"type": "integer", "minimum": 0}},
                                        ]
                                    },
                                    **_sampling,
                                },
                            }
                        }
                    },
                },
                "responses": _responses({"type": "object", "properties": {"choices": {"type": "array"}, "usage": _usage}}),
            }
        },
        "/v1/chat/completions": {
            "post": {
                "operationId": "createChatCompletion",
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "required": ["messages"],
                                "properties": {
                                    "messages": {
                                        "type": "array",
                                        "minItems": 1,
                                        "items": {
                                            "type": "object",
                                            "required": ["role", "content"],
                                            "properties": {
                                                "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
                                                "content": {"type": "string"},
                                            },
                                        },
                                    },
                                    "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
                                    **_sampling,
                                },
                            }
                        }
                    },
                },
                "responses": _responses({"type": "object", "properties": {"choices": {"type": "array"}, "usage": _usage}}),
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
}
