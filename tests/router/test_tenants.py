"""Tenants (cache_salt): the mirror keeps one index per tenant, so a prompt is matched only against what its own
tenant left in slots and saved states, and a slot moves between tenants' indexes as it changes hands."""

from __future__ import annotations

import numpy as np
from test_select import hold, seq

from protocol import CacheEntry, token_hash
from router.mirror import Mirror
from router.requests import tenant


def test_a_prompt_matches_only_its_own_tenants_slots():
    m = Mirror()
    (a, b) = m.add_worker("w0", 2)
    prompt = seq(200)
    m.assign(a, "j1", prompt, salt="A")
    assert m.finish(a, "j1", prompt, prompt[:0], 200, token_hash(prompt)) is None
    assert m.match(prompt, "A").lcp(a) == 200
    assert m.match(prompt, "B").best == 0 and m.match(prompt).best == 0  # another tenant, or none: nothing
    m.assign(a, "j2", prompt[:50], salt="B")  # the slot changes hands: out of A's index, into B's
    assert m.match(prompt, "A").best == 0 and m.match(prompt, "B").lcp(a) == 50
    assert m.fail(a, "j2", prompt[:50], prompt[:0], False, 0, "") is None  # never touched: A's again
    assert a.salt == "A" and m.match(prompt, "A").lcp(a) == 200 and "B" not in m.indexes
    hold(m, b, prompt)  # no tenant
    assert m.match(prompt).lcp(b) == 200 and m.match(prompt, "A").lcp(b) == 0


def test_saved_states_are_indexed_under_their_tenant():
    m = Mirror()
    (a,) = m.add_worker("w0", 1)
    history = seq(300)
    m.assign(a, "j1", history, salt="A")
    m.finish(a, "j1", history, history[:0], 300, token_hash(history))
    new = seq(20)
    m.assign(a, "j2", new, salt="B")
    saved = CacheEntry(id=1, n_tokens=300, hash=token_hash(history), nbytes=10, slot=0, salt="A")
    assert m.cache_changed("w0", [saved]) == []
    prompt = np.concatenate([history, seq(5)])
    assert m.match(prompt, "A").best == 300 and m.match(prompt, "B").best == 0
    wrong = CacheEntry(id=2, n_tokens=300, hash=token_hash(history), nbytes=10, slot=0, salt="B")
    (problem,) = m.cache_changed("w0", [wrong])  # the slot held tenant A's prompt, not B's: a mismatch
    assert "another tenant" in problem and m.mismatches == 1


def test_a_tenant_is_a_digest_of_the_salt_never_the_salt():
    assert tenant(None) == "" and tenant("") == ""
    assert tenant("key:secret") == tenant("key:secret") != tenant("key:other")
    assert "secret" not in tenant("key:secret") and len(tenant("x")) <= 64
