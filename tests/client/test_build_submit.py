"""A `submit` built from the Python clients' keywords (kvroute/requests.py `build_submit`): the session hints."""

from __future__ import annotations

import pytest

from kvroute.client import BadRequest, build_submit


def test_session_parent_session_and_priority_are_keywords() -> None:
    sub = build_submit(prompt="hi", session="s-1", parent_session="lead", priority=-1, temperature=0.0)
    assert (sub.session, sub.parent_session, sub.priority) == ("s-1", "lead", -1)
    assert sub.sampling.temperature == 0.0
    sub = build_submit(prompt="hi")
    assert (sub.session, sub.parent_session, sub.priority) == (None, None, 0)


@pytest.mark.parametrize("bad", [{"priority": 2}, {"session": ""}, {"session": "x" * 257}, {"parent_session": 5}])
def test_values_the_protocol_refuses_are_bad_requests(bad: dict[str, object]) -> None:
    with pytest.raises(BadRequest):
        build_submit(prompt="hi", **bad)
