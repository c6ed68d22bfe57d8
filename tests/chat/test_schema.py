"""Schemas as the grammars read them (llama.cpp's reading), and Gemma's argument grammar (no model)."""

from __future__ import annotations

import json

from chat.gemma_args import gemma_grammar, parse_gemma_args
from chat.grammar import check
from chat.schema import BOUND, for_grammar, tightened


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
