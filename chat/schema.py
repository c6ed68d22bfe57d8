"""JSON Schemas as kvroute's grammars read them: llama.cpp's reading (what llama-server users get), compiled by
llguidance, which otherwise follows the JSON Schema defaults that let a small model run away."""

from __future__ import annotations

from typing import Any

JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
    "json_allowed_escapes": '"\\bfnrt',
    "coerce_one_of": True,
}
"""How JSON is written under a grammar: what Python's json.dumps writes (what templates' `tojson` shows the model),
without `\\u` escapes, and no free whitespace (a small model would pad it forever). `oneOf` is read as `anyOf`, as
llama.cpp's json-schema-to-grammar reads it (Qwen Code's `agent` tool has one)."""

DIGITS = 16  # llama.cpp's grammars allow at most 16 digits before the point; a small model would write forever
BOUND = 10**DIGITS - 1


VALUES = ("enum", "const", "default", "examples", "required")  # keys whose values are data, not schemas


class SchemaError(ValueError):
    """A schema kvroute cannot read; the caller names the field it came in."""


def tightened(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists its properties and says nothing of
    others, and the integral part of numbers bounded to 16 digits, as llama.cpp's json-schema-to-grammar reads a
    schema. Nested schemas (properties, items, anyOf, $defs ...) are tightened too, each once: linear in the size."""
    if isinstance(schema, list):
        return [tightened(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in VALUES:
            out[k] = v
        elif k == "properties" and isinstance(v, dict):  # a map of names to schemas, not a schema
            out[k] = {name: tightened(s) for name, s in v.items()}
        else:
            out[k] = tightened(v)
    if isinstance(schema.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    if schema.get("type") in ("integer", "number"):
        out.setdefault("minimum", -BOUND)
        out.setdefault("maximum", BOUND)
    return out


def for_grammar(schema: dict[str, Any]) -> dict[str, Any]:
    """A schema ready for `%json {...}`: tightened, with kvroute's formatting options. Raises SchemaError for an
    `x-guidance` (llguidance's options) that is not an object."""
    options = schema.get("x-guidance")
    if options is not None and not isinstance(options, dict):
        raise SchemaError(f"`x-guidance` must be an object of llguidance's JSON options, got {type(options).__name__}")
    out: dict[str, Any] = tightened(schema)
    out["x-guidance"] = {**JSON_OPTIONS, **(options or {})}
    return out
