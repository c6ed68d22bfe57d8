"""Chat templates rendered as llama-server's --jinja does (no model)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
from conftest import chat_format

from chat.template import ChatTemplate, RawJSON, TemplateError, tojson


def render(tmpl: ChatTemplate, messages: list[dict], **kw) -> str:
    return tmpl.render(messages, **kw)[0]


def test_builtin_gemma_folds_the_system_prompt_into_the_first_user_turn() -> None:
    t = ChatTemplate.choose(None, None, "gemma")
    text, add_bos = t.render(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert add_bos and t.name == "gemma"
    assert text == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_builtin_chatml() -> None:
    assert render(ChatTemplate.choose(None, None, "chatml"), [{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_gguf_template_wins_and_its_bos_is_not_added_twice() -> None:
    src = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    src += "{% if add_generation_prompt %}[a]{% endif %}"
    t = ChatTemplate.choose(src, None, "gemma", bos_text="<bos>")
    text, add_bos = t.render([{"role": "user", "content": "Hi"}])
    assert t.name == "gguf" and text == "<bos>[user]Hi[a]" and not add_bos


def test_chat_template_flag_takes_a_builtin_name_or_a_file(tmp_path: Path) -> None:
    assert ChatTemplate.choose("{{ 'gguf' }}", "chatml", "gemma").name == "chatml"
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<{{ m.content }}>{% endfor %}")
    t = ChatTemplate.choose("{{ 'gguf' }}", str(f), "gemma")
    assert t.name == "file:t.jinja" and render(t, [{"role": "user", "content": "x"}]) == "<x>"
    with pytest.raises(ValueError, match=r"neither a built-in .* nor a readable file"):
        ChatTemplate.choose(None, str(tmp_path / "missing.jinja"), "gemma")
    f.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate.choose(None, str(f), "gemma")


def test_template_errors_quote_the_template() -> None:
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}", "x")
    with pytest.raises(TemplateError, match=r"^roles must alternate$"):
        t.render([{"role": "user", "content": "Hi"}])
    t = ChatTemplate("{{ messages[5].content }}", "x")
    with pytest.raises(TemplateError, match="chat template failed: UndefinedError"):
        t.render([{"role": "user", "content": "Hi"}])


def test_tojson_is_json_dumps_and_keeps_a_calls_arguments_as_written() -> None:
    assert tojson({"a": "<b>&é", "n": [1, 2]}) == '{"a": "<b>&é", "n": [1, 2]}'  # no HTML escaping
    raw = RawJSON('{"x":1,  "y": "z"}')
    assert raw["x"] == 1 and tojson(raw) == '{"x":1,  "y": "z"}'
    assert tojson({"function": {"name": "f", "arguments": raw}}) == '{"function": {"name": "f", "arguments": {"x":1,  "y": "z"}}}'
    assert tojson({"a": 1}, indent=2) == '{\n  "a": 1\n}'
    with pytest.raises(ValueError):
        RawJSON("[1, 2]")


def test_templates_see_only_the_fields_a_message_has() -> None:
    # Llama 3.x tests `'tool_calls' in message`: a key present as null would make every turn a tool call.
    t = chat_format("meta-llama-Llama-3.2-3B-Instruct").template
    text = render(t, [{"role": "user", "content": "Hi there"}])
    assert "Hi there<|eot_id|>" in text and "parameters" not in text


def test_strftime_now_and_chat_template_kwargs() -> None:
    today = datetime.datetime.now().strftime("%d %b %Y")
    for name in ("meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct"):  # date_string, strftime_now
        assert f"Today Date: {today}" in render(chat_format(name).template, [{"role": "user", "content": "x"}])
    qwen3 = chat_format("Qwen-Qwen3-0.6B").template
    msgs = [{"role": "user", "content": "x"}]
    assert render(qwen3, msgs).endswith("<|im_start|>assistant\n")
    assert render(qwen3, msgs, kwargs={"enable_thinking": False}).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_user_turn() -> None:
    gemma2 = chat_format("google-gemma-2-2b-it").template  # raises on a system message
    assert not gemma2.system_role
    text = render(gemma2, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>" in text


CLAUDE_CODE_TURNS = [
    {"role": "system", "content": "You are Claude Code."},
    {"role": "user", "content": "Hi"},
    {"role": "system", "content": "A reminder."},  # Claude Code and Codex put system messages mid-conversation
    {"role": "assistant", "content": "Hello"},
    {"role": "system", "content": "Another."},
    {"role": "user", "content": "Bye"},
]


def test_a_late_system_message_is_folded_in_order_where_the_template_takes_one_only_first() -> None:
    mistral = chat_format("Mistral-Small-3.2-24B-Instruct-2506").template  # raises when roles do not alternate
    assert mistral.system_role and not mistral.late_system
    text = render(mistral, CLAUDE_CODE_TURNS)
    assert "[INST]Hi\n\nA reminder.[/INST]Hello" in text
    assert "[INST]Another.\n\nBye[/INST]" in text
    turn_one = render(mistral, CLAUDE_CODE_TURNS[:3])  # the first turn renders as a prefix of the second
    assert text.startswith(turn_one)


def test_system_messages_at_the_start_become_one_where_the_template_takes_a_single_one() -> None:
    """Codex sends two developer messages first; Qwen 3.5's template raises at a second system message."""
    qwen35 = chat_format("Qwen3.5-4B").template
    assert qwen35.system_role and not qwen35.several_system
    two = [{"role": "developer", "content": "Rules."}, {"role": "developer", "content": "More rules."}]
    messages = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]} for m in two]
    text = render(qwen35, [*messages, {"role": "user", "content": "Hi"}])
    assert "<|im_start|>system\nRules.\n\nMore rules.<|im_end|>\n<|im_start|>user\nHi" in text
    qwen = chat_format("Qwen-Qwen2.5-7B-Instruct").template  # takes both: rendered as they stand
    assert qwen.several_system
    assert "Rules.<|im_end|>\n<|im_start|>system\nMore rules." in render(qwen, [*messages, {"role": "user", "content": "Hi"}])


def test_a_template_that_holds_a_late_system_message_back_gets_it_folded_so_each_request_extends_the_last() -> None:
    """The built-in gemma prepends a system message to the next user message: Claude Code's, sent after its first
    user message, rendered last on a turn's first request and after the model's call on the next one, so the second
    reused only what came before it (2.2k tokens computed again per request). Folded into the user message before."""
    gemma = ChatTemplate.choose(None, None, "gemma")
    assert gemma.system_role and not gemma.late_system
    first = render(gemma, CLAUDE_CODE_TURNS[:3])
    assert first.endswith("<start_of_turn>user\nYou are Claude Code.\n\nHi\n\nA reminder.<end_of_turn>\n<start_of_turn>model\n")
    assert render(gemma, CLAUDE_CODE_TURNS).startswith(first)


def test_a_template_that_takes_late_system_messages_renders_them_where_they_stand() -> None:
    qwen = chat_format("Qwen-Qwen2.5-7B-Instruct").template
    assert qwen.late_system
    text = render(qwen, CLAUDE_CODE_TURNS)
    assert "<|im_start|>system\nA reminder.<|im_end|>\n<|im_start|>assistant\nHello" in text


def test_what_vendored_templates_need_beyond_plain_jinja() -> None:
    """HF's generation block, list and dict methods, llama-server's `functions`, generators into tojson."""
    t = ChatTemplate("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}", "x")
    assert render(t, [{"role": "user", "content": "a"}]) == "[a]"
    t = ChatTemplate("{% set xs = [] %}{% do xs.append(1) if false %}{{ xs.append(2) or '' }}{{ xs | tojson }}", "x")
    assert render(t, [{"role": "user", "content": "a"}]).endswith("[2]")
    t = ChatTemplate("{% set d = {} %}{{ d.update({'k': 1}) or '' }}{{ d | tojson }}", "x")
    assert render(t, [{"role": "user", "content": "a"}]) == '{"k": 1}'
    t = ChatTemplate("{{ functions }}|{{ tools | map(attribute='function') | map(attribute='name') | list | tojson }}", "x")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    text = render(t, [{"role": "user", "content": "a"}], tools=tools)
    assert text == json.dumps([tools[0]["function"]], indent=2) + '|["f"]'
    t = ChatTemplate("{{ tools | map(attribute='function') | tojson }}", "x")
    assert render(t, [{"role": "user", "content": "a"}], tools=tools) == json.dumps([tools[0]["function"]])
    with pytest.raises(TemplateError, match="__class__"):  # (still a sandbox)
        render(ChatTemplate("{{ messages.__class__.__base__ }}", "x"), [{"role": "user", "content": "a"}])


def test_a_template_that_writes_arguments_as_text_gets_them_as_the_models_text() -> None:
    src = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ '>>>' + c.function.name + '\\n' + c.function.arguments }}{% endfor %}{% endfor %}"
    )
    t = ChatTemplate(src, "x")
    assert t.string_arguments
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": RawJSON('{"a":  1}')}}
    msgs = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    assert render(t, msgs) == '>>>f\n{"a":  1}'
    assert not chat_format("Qwen-Qwen2.5-7B-Instruct").template.string_arguments
