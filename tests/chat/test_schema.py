"""Schemas as the grammars read them (llama.cpp's reading), and Gemma's argument grammar (no model)."""

from __future__ import annotations

import json
from typing import Any

import pytest

import chat.schema as schema_module
from chat.gemma_args import gemma_grammar, parse_gemma_args
from chat.grammar import ChatError, check, check_tools, response_rule
from chat.schema import BOUND, for_grammar, tightened
from protocol import ResponseFormat, Tool


def test_objects_are_closed_and_numbers_bounded_everywhere() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number", "maximum": 5},
            "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
            "any": {"type": "object"},
            "mode": {"enum": [{"properties": 1}]},
        },
        "$defs": {"p": {"type": "object", "properties": {"q": {"type": "integer"}}}},
    }
    out = tightened(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["n"] == {"type": "integer", "minimum": -BOUND, "maximum": BOUND}
    assert out["properties"]["x"]["maximum"] == 5 and out["properties"]["x"]["minimum"] == -BOUND
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["any"]  # says nothing of its properties: any object
    assert out["properties"]["mode"] == {"enum": [{"properties": 1}]}  # values are not schemas
    assert out["$defs"]["p"]["additionalProperties"] is False
    assert schema["properties"]["n"] == {"type": "integer"}  # the caller's schema is not changed
    assert for_grammar({"type": "object"})["x-guidance"]["item_separator"] == ", "


def test_gemma_argument_grammar_compiles_and_its_syntax_reads_back() -> None:
    params = {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "units": {"enum": ["c", "f"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "opts": {"type": "object", "properties": {"fast": {"type": "boolean"}}},
            "anything": {},
        },
        "required": ["city"],
    }
    rules = gemma_grammar("args", params, '<|"|>')
    check("start: args\n" + rules, "tools")
    assert '"14"' in rules and '"15"' not in rules  # a small range is written out
    text = '{city:<|"|>Rome<|"|>,days:3,opts:{fast:true},tags:[<|"|>a<|"|>,<|"|>b<|"|>]}'
    value, end = parse_gemma_args(text, 0, '<|"|>')
    assert end == len(text) and value == {"city": "Rome", "days": 3, "opts": {"fast": True}, "tags": ["a", "b"]}
    assert json.dumps(value)


def test_one_of_is_read_as_any_of_as_llama_cpp_reads_it() -> None:
    # Qwen Code's `agent` tool: alternatives llguidance cannot prove disjoint, refused unless coerced to anyOf
    schema = {
        "type": "object",
        "properties": {
            "subagent_type": {"oneOf": [{"type": "string"}, {"type": "string", "enum": ["fork"]}]},
            "n": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
        },
    }
    check(f"start: a\na: %json {json.dumps(for_grammar(schema))}\n", "tools[0].function.parameters")


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_tightening_visits_each_schema_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46: `properties` was tightened twice per level (2^depth calls: depth 20 held the router's loop 4-6 s)."""
    calls = 0
    inner = schema_module.tightened

    def counted(schema: Any) -> Any:
        nonlocal calls
        calls += 1
        # each level: the object, the `type` string (and the `properties` map at most): linear, not 2^depth
        assert calls <= 3 * 40 + 3, "a schema is tightened more than once"
        return inner(schema)

    monkeypatch.setattr(schema_module, "tightened", counted)
    out = schema_module.tightened(nested(40))
    for _ in range(40):
        assert out["additionalProperties"] is False
        out = out["properties"]["a"]
    assert out == {"type": "string"}


def test_x_guidance_that_is_not_an_object_is_the_clients_error() -> None:
    """Issue 46: `"x-guidance": 1` was a TypeError (a 500 without the request's id, the request stuck in the queue)."""
    fmt = ResponseFormat(type="json_schema", schema={"type": "object", "x-guidance": 1})
    with pytest.raises(ChatError) as err:
        response_rule(fmt)
    assert err.value.param == "response_format" and "x-guidance" in str(err.value)
    tool = Tool(name="f", parameters={"type": "object", "x-guidance": [1]})
    with pytest.raises(ChatError) as err:
        check_tools([tool])
    assert err.value.param == "tools[0].function.parameters"
