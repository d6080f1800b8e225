"""What the callbacks need from a data-parallel Trainer: collectives, sharded parameters, precision.

FSDP2 (``fully_shard``; Lightning's ``ModelParallelStrategy``) keeps each parameter as a DTensor whose
local piece is a shard. The reference engine needs whole tensors, so at an audited step every
trainable parameter and its ``.grad`` are gathered with ``full_tensor()`` (one all-gather per tensor,
every rank): for that step each rank holds the full parameters and the full averaged gradient once
more (``2·|θ|``), which is what FSDP otherwise saves. The module's forward is then evaluated on those
full tensors with FSDP's own forward hooks set aside, so FSDP neither all-gathers nor reshards (nor
reduce-scatters a gradient into ``.grad``) for the audit's passes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from lens_callbacks.credit.readings.distributed import Collectives

__all__ = [
    "strategy_collectives",
    "is_sharded",
    "full_params",
    "full_grads",
    "fsdp_hooks_off",
    "check_strategy",
    "whole_views",
    "write_back_grads",
    "precision_context",
]


def strategy_collectives(trainer: Any) -> Collectives:
    """:class:`Collectives` over the Trainer's strategy (every rank of the world).

    With a process group, ``torch.distributed``'s own ``all_gather``/``all_reduce`` on the default group:
    the audit needs no gradient through them, and Lightning's ``strategy.all_gather`` goes through the
    deprecated ``torch.distributed.nn.functional.all_gather`` (a FutureWarning per call).
    """
    strategy = trainer.strategy
    W, rank = int(trainer.world_size), int(trainer.global_rank)
    dist = torch.distributed
    ready = W > 1 and dist.is_available() and dist.is_initialized()

    def gather(x: torch.Tensor) -> torch.Tensor:
        x = x.to(strategy.root_device).contiguous()
        if not ready:
            return x[None]  # [1, *]
        out = [torch.empty_like(x) for _ in range(W)]
        dist.all_gather(out, x)
        return torch.stack(out)  # [W, *]

    def reduce_sum(x: torch.Tensor) -> torch.Tensor:
        x = x.to(strategy.root_device).clone()  # reduced in place: a copy
        if ready:
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def gather_object(obj: Any) -> list:
        if not ready:
            return [obj]
        out: list = [None] * W
        dist.all_gather_object(out, obj)
        return out

    return Collectives(rank, W, gather, reduce_sum, gather_object)


def _dtensor_type() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except Exception:  # torch built without distributed
        return None
    return DTensor


def is_sharded(module: nn.Module) -> bool:
    """Whether any parameter is a DTensor (FSDP2 / ``fully_shard``, or tensor parallel)."""
    kind = _dtensor_type()
    return kind is not None and any(isinstance(p, kind) for p in module.parameters())


def _full(t: torch.Tensor) -> torch.Tensor:
    kind = _dtensor_type()
    if kind is not None and isinstance(t, kind):
        return t.full_tensor()  # a collective: every rank gathers the same tensors in the same order
    return t.detach()


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """name → the whole (gathered) value of every parameter, detached."""
    return {n: _full(p.detach()) for n, p in module.named_parameters()}


def full_grads(module: nn.Module, trainable_only: bool = True) -> list[Optional[torch.Tensor]]:
    """The whole ``.grad`` of every (trainable) parameter, in ``named_parameters`` order; None where absent.

    Under FSDP2 the local ``.grad`` is the shard of the rank-averaged gradient; gathered, it is the same
    vector DDP holds at the optimizer step.
    """
    out: list[Optional[torch.Tensor]] = []
    for _, p in module.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        out.append(None if p.grad is None else _full(p.grad.detach()))
    return out


@contextlib.contextmanager
def fsdp_hooks_off(module: nn.Module) -> Iterator[None]:
    """Set FSDP2's forward hooks aside, so a forward on swapped-in full tensors stays a plain forward.

    ``fully_shard`` registers a pre-forward hook (all-gather the shards into the module) and a
    post-forward hook (reshard, and arm the reduce-scatter of the backward) on each sharded module.
    With them active, the parameters the audit swaps in would be replaced by FSDP's own.
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except Exception:
        yield
        return
    saved: list[tuple[Any, list]] = []  # (hook dict, its items in their original order)
    for m in module.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            fsdp = [k for k, h in hooks.items() if isinstance(getattr(h, "__self__", None), FSDPState)]
            if fsdp:
                saved.append((hooks, list(hooks.items())))
                for k in fsdp:
                    del hooks[k]
    try:
        yield
    finally:
        # The pre-hook was registered with prepend=True: restore the exact order, not the id order.
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


def whole_views(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """name → a plain tensor holding the whole value of each (sharded) parameter, its ``.grad`` whole too.

    A callback that reads and edits ``.grad`` works on these views as on DDP's replicated parameters;
    :func:`write_back_grads` then puts each rank's shard of the edited gradient back. Collective: every
    rank calls it with the same parameters.
    """
    out: dict[str, torch.Tensor] = {}
    for n, p in params.items():
        view = _full(p.detach()).clone()
        if p.grad is not None:
            view.grad = _full(p.grad.detach()).clone()
        out[n] = view
    return out


def write_back_grads(shards: dict[str, torch.Tensor], views: dict[str, torch.Tensor]) -> None:
    """Copy each whole ``.grad`` of ``views`` into the local shard of the matching sharded parameter."""
    kind = _dtensor_type()
    for n, p in shards.items():
        g, v = p.grad, views[n].grad
        if g is None or v is None:
            continue
        if kind is not None and isinstance(g, kind):
            from torch.distributed.tensor import distribute_tensor

            # Every rank holds the same whole tensor, so each takes its own shard without a collective.
            local = distribute_tensor(v.to(g.dtype), g.device_mesh, g.placements, src_data_rank=None)
            g.copy_(local)
        else:
            g.copy_(v)


def check_strategy(trainer: Any, who: str) -> None:
    """Raise at setup for a strategy whose parameters the callbacks cannot read.

    ``FSDPStrategy`` (FSDP1) flattens parameters into ``FlatParameter`` shards and re-installs its own
    views on every forward, so the audit's swapped-in tensors would never be used.
    """
    kind = type(trainer.strategy).__name__
    if kind == "FSDPStrategy" or any(k.__name__ == "FSDPStrategy" for k in type(trainer.strategy).__mro__):
        raise ValueError(
            f"{who} cannot read parameters sharded by FSDPStrategy (FSDP1 FlatParameters), got strategy={kind}. "
            "Use Lightning's ModelParallelStrategy with `fully_shard` in `configure_model` (FSDP2, DTensor "
            "parameters; see docs/credit_audit.md), or DDP."
        )


def precision_context(trainer: Any) -> Optional[Any]:
    """The Trainer's forward context factory (autocast under ``bf16-mixed``/``16-mixed``), or None."""
    plugin = getattr(trainer, "precision_plugin", None)
    fn = getattr(plugin, "forward_context", None)
    return fn if callable(fn) else None
