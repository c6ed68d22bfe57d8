"""Supervisor restart rules with stand-in processes, and chat rendering (no model)."""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from types import SimpleNamespace

import pytest

from protocol import ChatMessage
from router.supervisor import Supervisor, SupervisorConfig, WorkerSpec
from router.templates import ChatRenderer, TemplateError


class StubRouter:
    def __init__(self) -> None:
        self.exits: list[tuple[str, int, int | None]] = []
        self.restarts: dict[str, int] = {}
        self.metrics = SimpleNamespace(restarts=0)

    def worker_exited(self, worker: str, incarnation: int, rc: int | None) -> None:
        self.exits.append((worker, incarnation, rc))


def run_supervisor(code: int, cfg: SupervisorConfig) -> tuple[StubRouter, Supervisor]:
    router = StubRouter()
    program = [sys.executable, "-c", f"import sys; sys.exit({code})"]
    sup = Supervisor(router, [WorkerSpec("w0")], cfg, "tcp://127.0.0.1:1", program=program)  # type: ignore[arg-type]

    async def main() -> None:
        sup.start()
        await asyncio.wait_for(asyncio.gather(*sup._tasks), timeout=30)

    asyncio.run(main())
    return router, sup


def test_crash_looping_worker_is_restarted_with_backoff_then_given_up():
    cfg = SupervisorConfig(restart_backoff_s=0.01, restart_backoff_max_s=0.05, max_restarts=3, restart_window_s=60)
    router, sup = run_supervisor(1, cfg)
    assert sup.children["w0"].given_up
    # started once + 3 restarts; each exit reported with its own, growing incarnation
    assert [(w, inc, rc) for w, inc, rc in router.exits] == [("w0", i, 1) for i in range(1, 5)]
    assert router.restarts == {"w0": 3} and router.metrics.restarts == 3


def test_refused_worker_is_not_restarted():
    router, sup = run_supervisor(3, SupervisorConfig(restart_backoff_s=0.01))
    assert sup.children["w0"].given_up and Counter(rc for *_, rc in router.exits) == {3: 1}


def test_builtin_gemma_format_folds_the_system_prompt_into_the_first_user_turn():
    r = ChatRenderer(None, "gemma")
    text, add_bos = r.render(
        [
            ChatMessage(role="system", content="Be brief."),
            ChatMessage(role="user", content="Hi"),
            ChatMessage(role="assistant", content="Hello!"),
            ChatMessage(role="user", content="Bye"),
        ]
    )
    assert add_bos and r.name == "gemma"
    assert text == (
        "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n"
        "<start_of_turn>model\n"
    )


def test_builtin_chatml_format():
    text, _ = ChatRenderer(None, "chatml").render([ChatMessage(role="user", content="Hi")])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_template_wins_and_its_bos_is_not_added_twice():
    tmpl = (
        "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    r = ChatRenderer(tmpl, "gemma", bos_text="<bos>")
    text, add_bos = r.render([ChatMessage(role="user", content="Hi")])
    assert r.name == "gguf" and text == "<bos>[user]Hi[assistant]" and not add_bos


def test_template_errors_are_request_errors():
    r = ChatRenderer("{{ raise_exception('roles must alternate') }}", "gemma")
    with pytest.raises(TemplateError, match="alternate"):
        r.render([ChatMessage(role="user", content="Hi")])
