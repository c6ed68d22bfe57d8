"""Chat rendering: the GGUF's own jinja chat template when it has one, else a named built-in format.

Built-in formats (selected with --chat-format; listed in the README):
- `gemma`: `<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n...`; a system message is
  folded into the first user turn (Gemma has no system role); assistant turns use role `model`.
- `chatml`: `<|im_start|>{role}\\n...<|im_end|>\\n`, ending with `<|im_start|>assistant\\n`.
Both end with the opening of the assistant's turn, so the model writes the reply; BOS comes from the
tokenizer (the model's add_bos rule), not from the text.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol import ChatMessage


class TemplateError(ValueError):
    """The messages cannot be rendered (the template raised, or a role it does not take)."""


def _gemma(messages: Sequence[ChatMessage]) -> str:
    out: list[str] = []
    system = ""
    for m in messages:
        if m.role == "system":
            system += m.content + "\n\n"
            continue
        role = "model" if m.role == "assistant" else "user"
        content = m.content
        if role == "user" and system:
            content, system = system + content, ""
        out.append(f"<start_of_turn>{role}\n{content}<end_of_turn>\n")
    if system:  # only system messages: still a user turn
        out.append(f"<start_of_turn>user\n{system.rstrip()}<end_of_turn>\n")
    out.append("<start_of_turn>model\n")
    return "".join(out)


def _chatml(messages: Sequence[ChatMessage]) -> str:
    body = "".join(f"<|im_start|>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


BUILTIN = {"gemma": _gemma, "chatml": _chatml}


class ChatRenderer:
    """Renders messages to prompt text. `template` is the GGUF's jinja source (None: use `fmt`)."""

    def __init__(self, template: str | None, fmt: str, *, bos_text: str = "", eos_text: str = "") -> None:
        if fmt not in BUILTIN:
            raise ValueError(f"unknown chat format {fmt!r}; built-in: {sorted(BUILTIN)}")
        self.fmt = fmt
        self.bos_text, self.eos_text = bos_text, eos_text
        self._jinja = None
        if template:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(message: str) -> None:
                raise TemplateError(message)

            env.globals["raise_exception"] = raise_exception
            self._jinja = env.from_string(template)

    @property
    def name(self) -> str:
        return "gguf" if self._jinja is not None else self.fmt

    def render(self, messages: Sequence[ChatMessage]) -> tuple[str, bool]:
        """(prompt text, whether the tokenizer should add BOS): False when the template wrote it."""
        if self._jinja is None:
            return BUILTIN[self.fmt](messages), True
        try:
            text = self._jinja.render(
                messages=[{"role": m.role, "content": m.content} for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_text,
                eos_token=self.eos_text,
            )
        except TemplateError:
            raise
        except Exception as exc:  # a template error is the request's problem, not the router's
            raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        starts_with_bos = bool(self.bos_text) and text.startswith(self.bos_text)
        return text, not starts_with_bos
