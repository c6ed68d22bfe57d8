"""The prefix index against a brute-force LCP over random token sequences."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from router.index import Index

# Small alphabets and lengths make shared prefixes, splits and merges common.
seqs = st.lists(st.integers(0, 3), min_size=0, max_size=12)


def brute_lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


ops = st.lists(st.tuples(st.integers(0, 5), st.one_of(st.none(), seqs)), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(ops=ops, queries=st.lists(seqs, min_size=1, max_size=5))
def test_index_matches_brute_force_after_inserts_and_removes(ops, queries):
    idx = Index()
    held: dict[int, list[int]] = {}
    for owner, seq in ops:
        if seq is None:
            idx.remove(owner)
            held.pop(owner, None)
        else:
            idx.insert(owner, seq)
            held[owner] = seq
    for q in queries:
        m = idx.match(q)
        expected = {o: brute_lcp(s, q) for o, s in held.items() if brute_lcp(s, q) > 0}
        assert m.all() == expected
        for o, s in held.items():
            assert m.lcp(o) == brute_lcp(s, q)
        assert m.best == max(expected.values(), default=0)
    # memory bound: the tree holds no more tokens than the owners do, at most 2 nodes per owner,
    # and no node outlives its owners
    nodes = list(idx.nodes())
    assert idx.stored_tokens() <= sum(len(s) for s in held.values())
    assert len(nodes) <= 2 * len(held)
    assert all(n.owners for n in nodes)
    if not held:
        assert not idx.root.children


def test_index_long_sequences_share_a_prefix():
    rng = np.random.default_rng(0)
    system = rng.integers(0, 262_000, 3000)
    idx = Index()
    tails = {}
    for owner in range(8):
        tails[owner] = rng.integers(0, 262_000, 500 + owner)
        idx.insert(owner, np.concatenate([system, tails[owner]]))
    prompt = np.concatenate([system, tails[3][:200], [7, 7, 7]])
    m = idx.match(prompt)
    assert m.lcp(3) == 3200
    assert all(m.lcp(o) == 3000 for o in range(8) if o != 3)
    # the shared prefix is stored once
    assert idx.stored_tokens() == 3000 + sum(len(t) for t in tails.values())
    for owner in range(8):
        idx.remove(owner)
    assert not idx.root.children and len(idx) == 0
