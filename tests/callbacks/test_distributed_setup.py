"""Set-up checks of the data-parallel adapters that need no second process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from lens_callbacks.callbacks._distributed import (
    check_strategy,
    full_grads,
    full_params,
    is_sharded,
    whole_views,
    write_back_grads,
)
from lens_callbacks.callbacks.anchor import AnchorProjectionCallback
from lens_callbacks.callbacks.conservation import ConservationCheckCallback
from lens_callbacks.callbacks.credit_audit import CreditAuditCallback


def test_fsdp1_is_refused_at_setup_with_what_to_use_instead():
    trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ValueError, match="FSDPStrategy.*ModelParallelStrategy with `fully_shard`"):
        check_strategy(trainer, "CreditAuditCallback")
    check_strategy(SimpleNamespace(strategy=DDPStrategy()), "CreditAuditCallback")  # DDP passes


@pytest.mark.parametrize(
    "make",
    [
        lambda: CreditAuditCallback(),
        lambda: ConservationCheckCallback(),
    ],
)
def test_callbacks_refuse_fsdp1_in_setup(make):
    cb = make()
    trainer = SimpleNamespace(strategy=FSDPStrategy(), callbacks=[cb], world_size=1, accumulate_grad_batches=1)

    class M(torch.nn.Module):
        device = torch.device("cpu")

        def credit_terms(self, batch):  # pragma: no cover - never reached
            raise AssertionError

    with pytest.raises(ValueError, match="FSDPStrategy"):
        cb.setup(trainer, M(), "fit")


def test_anchor_refuses_fsdp1_before_the_first_step():
    cb = AnchorProjectionCallback(mode="signed_ema")
    with pytest.raises(ValueError, match="FSDPStrategy"):
        cb.on_fit_start(SimpleNamespace(strategy=FSDPStrategy()), torch.nn.Linear(2, 2))


def test_plain_parameters_pass_through_unchanged():
    m = torch.nn.Linear(3, 2)
    m(torch.ones(1, 3)).sum().backward()
    assert not is_sharded(m)
    full = full_params(m)
    assert all(torch.equal(full[n], p) for n, p in m.named_parameters())
    assert all(torch.equal(g, p.grad) for g, p in zip(full_grads(m), m.parameters()))
    params = dict(m.named_parameters())
    views = whole_views(params)
    views["weight"].grad.mul_(2.0)
    before = m.weight.grad.clone()
    write_back_grads(params, views)
    assert torch.equal(m.weight.grad, 2.0 * before)
