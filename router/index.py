"""One prefix index over every slot of every worker: a radix tree over token ids.

Contract:
- `insert(owner, tokens)` records that `owner` (any hashable: the router uses its slot objects) holds
  exactly `tokens`; it first removes whatever the owner held. `remove(owner)` forgets it.
- `match(tokens)` returns a `Match`: for every owner holding at least one leading token of `tokens`,
  the length of the longest common prefix (LCP) of `tokens` and that owner's sequence. The walk
  compares tokens with numpy along one root-to-leaf path, so it costs O(len(tokens)) plus the owners
  met on the path, not O(number of owners).
- Memory: a node exists only while some owner's sequence passes through it, and a node whose only
  child has the same owners is merged into it, so the tree holds at most the tokens the owners hold
  (shared prefixes once) and at most 2 nodes per owner.
- Single-threaded: owned by the router's event loop.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import numpy as np

from common.slots import common_prefix

Tokens = np.ndarray  # int32, 1-D


def as_tokens(tokens: object) -> Tokens:
    arr = np.asarray(tokens, dtype=np.int32)
    if arr.ndim != 1:
        raise ValueError("token sequence must be one-dimensional")
    return arr


class _Node:
    __slots__ = ("children", "edge", "owners", "parent")

    def __init__(self, edge: Tokens, parent: _Node | None) -> None:
        self.edge = edge  # tokens on the edge from the parent to this node
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.owners: set[Hashable] = set()  # owners whose sequence contains the whole path to this node


@dataclass(frozen=True, slots=True)
class Match:
    """What `Index.match` found: per path node, its owners and how many prompt tokens they share."""

    path: list[tuple[set[Hashable], int]]  # (owners, matched depth), shallow to deep
    length: int  # len(tokens)

    def lcp(self, owner: Hashable) -> int:
        for owners, depth in reversed(self.path):
            if owner in owners:
                return depth
        return 0

    def all(self) -> dict[Hashable, int]:
        """Every owner with a non-zero LCP -> its LCP."""
        out: dict[Hashable, int] = {}
        for owners, depth in reversed(self.path):
            for o in owners:
                if o not in out:
                    out[o] = depth
        return out

    def levels(self) -> Iterator[tuple[set[Hashable], int]]:
        """(owners whose LCP is exactly `depth`, depth), deepest first. The sets must not be mutated."""
        deeper: set[Hashable] = set()
        for owners, depth in reversed(self.path):
            new = owners - deeper if deeper else owners  # a child's owners are a subset of its parent's
            if new:
                yield new, depth
            deeper = owners

    @property
    def best(self) -> int:
        return self.path[-1][1] if self.path else 0


class Index:
    """Radix tree over token sequences mapping prefixes to the owners (slots) that hold them."""

    def __init__(self) -> None:
        self.root = _Node(np.empty(0, dtype=np.int32), None)
        self._leaf: dict[Hashable, _Node] = {}  # owner -> deepest node of its sequence

    def __len__(self) -> int:
        return len(self._leaf)

    def __contains__(self, owner: Hashable) -> bool:
        return owner in self._leaf

    def match(self, tokens: object) -> Match:
        toks = as_tokens(tokens)
        path: list[tuple[set[Hashable], int]] = []
        node, depth = self.root, 0
        while depth < len(toks):
            child = node.children.get(int(toks[depth]))
            if child is None:
                break
            k = common_prefix(child.edge, toks[depth:])
            path.append((child.owners, depth + k))
            if k < len(child.edge):
                break
            node, depth = child, depth + k
        return Match(path, len(toks))

    def insert(self, owner: Hashable, tokens: object) -> None:
        self.remove(owner)
        toks = as_tokens(tokens)
        node, depth = self.root, 0
        while depth < len(toks):
            first = int(toks[depth])
            child = node.children.get(first)
            if child is None:
                child = _Node(toks[depth:].copy(), node)
                node.children[first] = child
                child.owners.add(owner)
                node, depth = child, len(toks)
                break
            k = common_prefix(child.edge, toks[depth:])
            if k < len(child.edge):
                child = self._split(child, k)
            child.owners.add(owner)
            node, depth = child, depth + k
        if node is not self.root:
            self._leaf[owner] = node

    def remove(self, owner: Hashable) -> None:
        node = self._leaf.pop(owner, None)
        while node is not None and node is not self.root:
            parent = node.parent
            node.owners.discard(owner)
            if not node.owners:
                # children's owners are subsets of ours, so the whole subtree is empty: drop it
                assert parent is not None
                del parent.children[int(node.edge[0])]
            else:
                self._merge(node)
            node = parent

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut `node`'s edge after k tokens; returns the new upper node (same owners)."""
        parent = node.parent
        assert parent is not None and 0 < k < len(node.edge)
        upper = _Node(node.edge[:k].copy(), parent)
        upper.owners = set(node.owners)
        parent.children[int(node.edge[0])] = upper
        node.edge = node.edge[k:].copy()
        node.parent = upper
        upper.children[int(node.edge[0])] = node
        return upper  # every owner of `node` holds its whole edge, so no leaf moves

    def _merge(self, node: _Node) -> None:
        """Fold a single child with the same owners into `node` (nobody ends at `node` then)."""
        if len(node.children) != 1:
            return
        (child,) = node.children.values()
        if child.owners != node.owners:
            return
        node.edge = np.concatenate([node.edge, child.edge])
        node.children = child.children
        for grandchild in node.children.values():
            grandchild.parent = node
        for o in child.owners:
            if self._leaf.get(o) is child:
                self._leaf[o] = node

    # ---- introspection (tests, metrics) ----

    def nodes(self) -> Iterator[_Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def stored_tokens(self) -> int:
        return sum(len(n.edge) for n in self.nodes())
