"""The one path from any API's request to a protocol `Submit`, after its dialect has read the body: the sampling
(each API names its fields; one mapping to `Sampling`, whose values stand for what a request leaves out, and the
fields left to the server listed for the router's --temp/--top-k/--top-p/--min-p/--seed), and what the gateway adds
to every request (the model it named, keep_alive, the tenant and the owner)."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from gateway.errors import RequestError
from protocol import Defaultable, Sampling, Submit, sampling_of


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


def served(sub: Submit, model: str | None, keep_alive_s: float | None, cache_salt: str | None, owner: str | None) -> Submit:
    """What the gateway adds to every request, whatever its API: the model it asked for, how long to keep that model
    loaded, its tenant (the salt, per API key where the operator asks) and its owner (its key's share of the queue)."""
    sub.model, sub.keep_alive_s, sub.cache_salt, sub.owner = model, keep_alive_s, cache_salt, owner
    return sub
