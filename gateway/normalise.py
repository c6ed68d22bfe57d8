"""The one path from any API's request to a protocol `Submit`, after its dialect has read the body: the sampling
(each API names its fields; one mapping to `Sampling`, whose values stand for what a request leaves out, and the
fields left to the server listed for the router's --temp/--top-k/--top-p/--min-p/--seed), the `Submit` itself (built
in one place, with one set of errors the protocol's types raise turned into a 400), the tools offered, a thinking
effort as template variables, and what the gateway adds to every request (the model it named, keep_alive, the tenant
and the owner)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import msgspec

from common.config import keep_alive_seconds
from gateway.errors import RequestError
from protocol import Defaultable, Sampling, Submit, Tool, sampling_of

# what the protocol's types raise for a request that cannot be made of them (msgspec's checks, their __post_init__)
REFUSED = (msgspec.ValidationError, ValueError, TypeError)


@contextlib.contextmanager
def refused() -> Iterator[None]:
    """The protocol's refusal of what a request is made into (a message without content, two shapes for one reply, a
    tool's name) as a 400 in its words: the one set of errors caught wherever a request's protocol parts are made."""
    try:
        yield
    except REFUSED as exc:
        raise RequestError(str(exc)) from None


def sampling(fields: dict[str, Any]) -> tuple[Sampling, list[Defaultable]]:
    """A request's `Sampling` from its API's values by `Sampling`'s names (None: the request did not set it), and the
    fields it left to the server (`Submit.sampling_unset`). A value out of range is a 400 naming its field."""
    try:
        return sampling_of(fields)
    except msgspec.ValidationError as exc:
        text = str(exc)
        at = re.search(r" - at `\$\.([A-Za-z_]+)", text)
        named = at.group(1) if at else next((f for f in fields if f in text), None)
        raise RequestError(f"invalid sampling parameter: {text}", param=named) from None
    except ValueError as exc:
        raise RequestError(f"invalid sampling parameter: {exc}", param=next((f for f in fields if f in str(exc)), None)) from None


def submit(request_id: str, sampling: tuple[Sampling, list[Defaultable]], **fields: Any) -> Submit:
    """The one place an API's request becomes a `Submit`: `sampling` as `sampling()` made it, the other fields by
    `Submit`'s names (its messages, prompt or tokens, tools, tool_choice, format, ...); a field given as None takes the
    protocol's default (every API streams from the router; a reply is one choice, with parallel calls allowed)."""
    params, unset = sampling
    given = {name: value for name, value in fields.items() if value is not None}
    with refused():
        return Submit(id=request_id, sampling=params, sampling_unset=unset, **given)


def tool(name: str, description: str, parameters: dict[str, Any], *, where: str, param: str) -> Tool:
    """A function the request offers the model, as the protocol's `Tool`; a name it refuses is a 400 saying `where`,
    naming `param`."""
    try:
        return msgspec.convert({"name": name, "description": description, "parameters": parameters}, Tool)
    except msgspec.ValidationError as exc:
        raise RequestError(f"{where}: {exc}", param=param) from None


def thinking_kwargs(kwargs: dict[str, Any] | None, effort: str | None) -> dict[str, Any]:
    """The template's variables with what an effort asks for (`chat_template_kwargs` win): `reasoning_effort` (gpt-oss
    reads it), and `enable_thinking` off for "none" (Qwen 3, GLM, ... read that)."""
    out = dict(kwargs or {})
    if effort is not None:
        if effort != "none":
            out.setdefault("reasoning_effort", effort)
        out.setdefault("enable_thinking", effort != "none")
    return out


def keep_alive_s(value: Any) -> float | None:
    """Ollama's `keep_alive` (honoured in every generating API): how long the model stays loaded after this request,
    as seconds or a duration ("5m", "1h30m", "300ms"); 0 unloads it once idle, a negative value keeps it. None: not
    given."""
    if value is None:
        return None
    try:
        return keep_alive_seconds(value)
    except ValueError as exc:
        raise RequestError(f"`keep_alive`: {exc}", param="keep_alive") from None


def served(sub: Submit, model: str | None, keep_alive_s: float | None, cache_salt: str | None, owner: str | None) -> Submit:
    """What the gateway adds to every request, whatever its API: the model it asked for, how long to keep that model
    loaded, its tenant (the salt, per API key where the operator asks) and its owner (its key's share of the queue)."""
    sub.model, sub.keep_alive_s, sub.cache_salt, sub.owner = model, keep_alive_s, cache_salt, owner
    return sub
