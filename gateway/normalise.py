"""The one path from any API's request to a protocol `Submit`, after its dialect has read the body: the sampling
(each API names its fields; one mapping to `Sampling`, whose values stand for what a request leaves out, and the
fields left to the server listed for the router's --temp/--top-k/--top-p/--min-p/--seed), the `Submit` itself (built
in one place, with one set of errors the protocol's types raise turned into a 400), the tools offered, a thinking
effort as template variables, and what the gateway adds to every request (the model it named, keep_alive, the tenant
and the owner, the session it continues and its priority).

A request's session and priority (protocol `Submit.session`, `parent_session`, `priority`: hints to the router,
which keeps a paused agent session's KV warm and runs interactive work first) are read from what clients already
send. The session is the first found of (docs/apis.md writes this out):

1. the header `x-session-id` (kvroute's own, any client);
2. the header `x-claude-code-session-id` (Claude Code sends it on every request);
3. `prompt_cache_key` (OpenAI's; Codex CLI sends its conversation's id there);
4. `metadata.user_id` (Anthropic's; Claude Code's is `user_<hex>_account_<uuid>_session_<uuid>` or a JSON object
   string with a `session_id`: that id is taken; any other user id is taken whole);
5. `user`, then `safety_identifier` (OpenAI's; a user's id: its requests are one session).

The parent session (a sub-agent's): the header `x-parent-session-id`. The priority: the header `x-priority`
(`interactive` 1, `normal` 0, `background` -1), else `service_tier` (OpenAI's `priority` 1, `flex` -1, `auto`,
`default`, `scale` 0; Anthropic's `auto` and `standard_only` 0). An OpenAI reply that names a tier names the one
applied. None of these is ever refused: a value is stripped of blanks around it, an empty one is absent, and one
over SESSION_CHARS is cut to its head and a digest of the whole (two long ids with one head stay apart); a value of
another type (gateway/fields.py LENIENT), an unknown tier or `x-priority` is a hint (named in the log, counted),
served at priority 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from common.config import keep_alive_seconds
from gateway.errors import RequestError
from gateway.fields import Policy
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


# ---- session and priority ---------------------------------------------------------------------------------------

SESSION_CHARS = 256  # the protocol's bound (`SessionId`)
_HEAD_CHARS = SESSION_CHARS - 1 - 48  # an over-long id: its head, "~", 48 hex digits of its SHA-256

SESSION_HEADER = "x-session-id"
CLAUDE_CODE_HEADER = "x-claude-code-session-id"
PARENT_HEADER = "x-parent-session-id"
PRIORITY_HEADER = "x-priority"

PRIORITIES = {"interactive": 1, "normal": 0, "background": -1}  # x-priority
OPENAI_TIERS = {"priority": 1, "flex": -1, "auto": 0, "default": 0, "scale": 0}
ANTHROPIC_TIERS = {"auto": 0, "standard_only": 0}
TIERS = {1: "priority", 0: "default", -1: "flex"}  # the tier an OpenAI reply echoes, by the priority applied


def session_id(value: object) -> str | None:
    """A client's id as `Submit.session` takes it: stripped; None when empty or not a string; a lone surrogate (JSON's
    `\ud800`, which the protocol cannot carry) written as its escape; cut to its head and a digest of the whole when
    over SESSION_CHARS."""
    if not isinstance(value, str):
        return None
    value = value.strip()
    try:
        value.encode()
    except UnicodeEncodeError:
        value = value.encode("utf-8", "backslashreplace").decode()
    if len(value) <= SESSION_CHARS:
        return value or None
    digest = hashlib.sha256(value.encode()).hexdigest()[:48]
    return f"{value[:_HEAD_CHARS]}~{digest}"


def claude_user_id(user_id: str) -> str:
    """The session in Anthropic's `metadata.user_id` as Claude Code writes it: `user_<device>_account_<uuid>_session_
    <uuid>` (the account may be empty) or a JSON object with `session_id` (with `device_id`, `account_uuid`); any other
    user id whole."""
    text = user_id.strip()
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except (ValueError, RecursionError):
            return user_id
        session = fields.get("session_id") if isinstance(fields, dict) else None
        return session if isinstance(session, str) and session.strip() else user_id
    if text.startswith("user_") and "_session_" in text:
        session = text.rpartition("_session_")[2]
        return session if session.strip() else user_id
    return user_id


def session_of(*signals: object) -> str | None:
    """The first of a body's session signals (in precedence order) that is one."""
    return next((s for s in map(session_id, signals) if s is not None), None)


def priority_of(tier: object, tiers: Mapping[str, int], policy: Policy) -> int:
    """The priority a body's `service_tier` asks for (`tiers`: the API's names); a tier the API does not name is a
    hint (counted as `service_tier`), served as 0."""
    if tier is None:
        return 0
    if isinstance(tier, str) and tier in tiers:
        return tiers[tier]
    policy.hint("service_tier")
    return 0


@dataclass(frozen=True)
class SessionHeaders:
    """What a request's headers say of its session and priority (None: they say nothing), above its body's."""

    session: str | None = None
    parent: str | None = None
    priority: int | None = None

    @classmethod
    def read(cls, headers: Mapping[str, str], policy: Policy) -> SessionHeaders:
        """`x-session-id`, else `x-claude-code-session-id`; `x-parent-session-id`; `x-priority` (one it does not
        know is a hint, counted as `header:x-priority`)."""
        session = session_id(headers.get(SESSION_HEADER)) or session_id(headers.get(CLAUDE_CODE_HEADER))
        said = headers.get(PRIORITY_HEADER)
        priority = PRIORITIES.get(said.strip().lower()) if said is not None else None
        if said is not None and priority is None:
            policy.hint(f"header:{PRIORITY_HEADER}")
        return cls(session, session_id(headers.get(PARENT_HEADER)), priority)

    def apply(self, sub: Submit) -> Submit:
        """`sub` (its body's session and priority set) with what the headers say on top."""
        sub.session = self.session or sub.session
        sub.parent_session = self.parent or sub.parent_session
        if self.priority is not None:
            sub.priority = self.priority
        return sub


def service_tier(sub: Submit) -> str:
    """The OpenAI service tier a reply names: the one `sub`'s priority was served at."""
    return TIERS.get(sub.priority, "default")
