"""Walks of an autograd graph: pure torch, read-only."""

from __future__ import annotations

from typing import Any, Iterator

import torch

__all__ = ["graph_nodes"]


def graph_nodes(root: torch.Tensor) -> Iterator[Any]:
    """Every node of ``root``'s autograd graph, once each, depth first from ``root.grad_fn``.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> sorted(type(n).__name__ for n in graph_nodes((w * w).sum()))
        ['AccumulateGrad', 'MulBackward0', 'SumBackward0']
    """
    stack = [root.grad_fn] if root.grad_fn is not None else []
    seen: set = set()  # the nodes themselves (not their ids, which a collected wrapper could hand on)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        for nxt, _ in node.next_functions:  # a plain loop: no generator frame per node
            if nxt is not None:
                stack.append(nxt)
