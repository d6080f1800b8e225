"""A prefix trie over the completions of one group: n(s) and the Monte-Carlo value q(s) at every prefix."""

from __future__ import annotations

import math
from typing import Iterator, Sequence

__all__ = ["PrefixTrie", "TrieNode"]


class TrieNode:
    """One prefix ``s``: how many rollouts pass through it and what they scored.

    Attributes:
        n: ``n(s)``, the number of rollouts whose completion begins with ``s``.
        total: the sum of their outcomes (``q(s) = total / n``).
        lo, hi: the smallest and largest of their outcomes (``lo < hi``: outcomes differ here).
        children: next token → node.
    """

    __slots__ = ("n", "total", "lo", "hi", "children")

    def __init__(self) -> None:
        self.n = 0
        self.total = 0.0
        self.lo = math.inf
        self.hi = -math.inf
        self.children: dict[int, TrieNode] = {}

    @property
    def q(self) -> float:
        """``q(s) = E[R | prefix s]``, the mean outcome of the rollouts through ``s``."""
        return self.total / self.n if self.n else math.nan

    @property
    def mixed(self) -> bool:
        """Whether the rollouts through ``s`` do not all share one outcome."""
        return self.lo < self.hi

    def _add(self, reward: float) -> None:
        self.n += 1
        self.total += reward
        self.lo = min(self.lo, reward)
        self.hi = max(self.hi, reward)


class PrefixTrie:
    """Completions of one group inserted token by token; the root is the empty prefix.

    Example:
        >>> t = PrefixTrie()
        >>> t.insert([1, 2], 1.0); t.insert([1, 3], 0.0)
        >>> [(node.n, node.q) for node in t.path([1, 3])]
        [(2, 0.5), (1, 0.0)]
        >>> t.root.n, t.root.q
        (2, 0.5)
    """

    def __init__(self) -> None:
        self.root = TrieNode()

    def insert(self, tokens: Sequence[int], reward: float) -> None:
        node = self.root
        node._add(reward)
        for tok in tokens:
            node = node.children.setdefault(int(tok), TrieNode())
            node._add(reward)

    def path(self, tokens: Sequence[int]) -> list[TrieNode]:
        """The nodes of the prefixes ``tokens[:1], tokens[:2], …`` (the root excluded)."""
        out: list[TrieNode] = []
        node = self.root
        for tok in tokens:
            node = node.children[int(tok)]
            out.append(node)
        return out

    def nodes(self) -> Iterator[TrieNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
