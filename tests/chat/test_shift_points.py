"""--context-shift's choice of messages to drop (no model): where a too-long history may resume."""

from __future__ import annotations

from typing import Any

from chat.request import shift_points, shifted, template_messages
from protocol import ChatMessage, ToolCall


def msg(role: Any, text: str = "") -> ChatMessage:
    return ChatMessage(role=role, content=text or role)


def call(i: int) -> ChatMessage:
    return ChatMessage(role="assistant", content="", tool_calls=[ToolCall(id=f"c{i}", name="f", arguments="{}")])


def answer(i: int) -> ChatMessage:
    return ChatMessage(role="tool", content=f"result {i}", tool_call_id=f"c{i}")


def roles(messages: list[ChatMessage]) -> list[str]:
    return [m.role for m in messages]


def test_a_chat_resumes_at_a_user_turn_and_keeps_the_system_messages() -> None:
    history = [msg("system"), msg("developer"), msg("user", "u1"), msg("assistant", "a1"), msg("user", "u2")]
    history += [msg("assistant", "a2"), msg("user", "u3")]
    points = shift_points(history)
    assert points == [4, 6]  # at u2 (u1 and a1 dropped), at u3 (the last user message)
    assert [m.text() for m in shifted(history, 4)] == ["system", "developer", "u2", "a2", "u3"]
    assert [m.text() for m in shifted(history, 6)] == ["system", "developer", "u3"]


def test_an_agent_loop_drops_calls_with_their_results_and_keeps_the_last_user_message() -> None:
    history = [msg("system"), msg("user", "old"), msg("assistant", "ok"), msg("user", "task")]
    history += [call(1), answer(1), call(2), answer(2), msg("assistant", "done")]
    points = shift_points(history)
    # at "task", then after it: never at a tool result; the end (9) keeps only the system message and "task"
    assert points == [3, 6, 8, 9]
    for at in points:
        kept = shifted(history, at)
        template_messages(kept)  # every kept call still has its results: the history stays valid
        assert kept[0].role == "system" and "task" in [m.text() for m in kept]
    assert roles(shifted(history, 6)) == ["system", "user", "assistant", "tool", "assistant"]
    assert [m.text() for m in shifted(history, 9)] == ["system", "task"]
    dropped = [len(history) - len(shifted(history, at)) for at in points]
    assert dropped == sorted(dropped) and dropped[0] == 2  # fewest dropped first


def test_nothing_can_be_dropped_from_a_system_message_and_one_question() -> None:
    assert shift_points([msg("system"), msg("user")]) == []
    assert shift_points([msg("user")]) == []
    assert shift_points([msg("system"), msg("assistant", "a"), msg("assistant", "b")]) == [2]  # no user message
